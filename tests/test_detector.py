"""The early warning (harness.detector): its features on synthetic indicator streams where it must and
must not fire, its file's validation and exact reload, and the fit-and-score of analysis.detector on a
synthetic store whose truth is known (fit on one part, scored on the held-out rest)."""
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from harness import keys as K
from harness import tracking
from harness.detector import (
    BASE_FEATURES,
    BASE_SIGNALS,
    DEFAULT_PARAMS,
    DEFAULT_PARAMS_NO_AUDIT,
    FEATURES,
    Detector,
    DetectorParams,
    Features,
    load_params,
    replay,
)
from harness.schema import ConfigError

from helpers import sqlite_uri, stream, write_detector


def test_features_are_relative_to_the_runs_own_start():
    f = Features(window=2, baseline_steps=2)
    rows = stream(6)
    assert [f.update(m) is None for m in rows[:3]] == [True, True, True]  # the start and one window first
    x = f.update(rows[3])
    assert set(x) == set(BASE_FEATURES)
    # a run that is the same one scaled (twice the entropy and KL, longer responses): the same features
    g = Features(window=2, baseline_steps=2)
    scaled = [{**m, K.ENTROPY: 2 * m[K.ENTROPY], K.KL_K3: 2 * m[K.KL_K3], K.LENGTH: 10 * m[K.LENGTH],
               K.LENGTH_STD: 10 * m[K.LENGTH_STD], K.RM_SCORE: 5 * m[K.RM_SCORE], K.RM_SCORE_STD: 5 * m[K.RM_SCORE_STD],
               K.PPL_TOKENS: 7 * m[K.PPL_TOKENS]} for m in rows[:4]]
    y = [g.update(m) for m in scaled][-1]
    assert all(math.isclose(x[k], y[k], rel_tol=1e-9, abs_tol=1e-9) for k in BASE_FEATURES), (x, y)


def test_the_detector_fires_on_the_pattern_and_not_on_a_healthy_run(tmp_path):
    params = load_params(write_detector(tmp_path / "d.json"))
    _, alert = replay(params, list(enumerate(stream(120, at=60), 1)))
    assert alert is not None and 60 < alert.step < 80
    for seed in range(3):
        assert replay(params, list(enumerate(stream(200, seed=seed), 1)))[1] is None
    with pytest.raises(KeyError, match="needs"):  # a run that does not log a signal: said, not guessed
        Detector(params).update(1, {K.KL_K3: 0.1})


def test_state_roundtrip_continues_identically(tmp_path):
    params = load_params(write_detector(tmp_path / "d.json"))
    rows = list(enumerate(stream(90, at=40), 1))
    a = Detector(params)
    whole = [a.update(s, m) for s, m in rows]
    b = Detector(params)
    for s, m in rows[:50]:
        b.update(s, m)
    c = Detector(params)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))  # as the checkpoint stores it
    rest = [c.update(s, m) for s, m in rows[50:]]
    assert [x[0] for x in rest] == [x[0] for x in whole[50:]]
    assert c.warning == a.warning


def test_detector_files_are_validated(tmp_path):
    good = dataclasses.asdict(
        DetectorParams(features=["kl", "ppl"], mean=[0, 0], scale=[1, 1], coef=[1, 1], intercept=0, threshold=0.5))
    cases = {
        "unknown feature": ({**good, "features": ["kl", "perplexity"]}, "features.1: got 'perplexity'"),
        "lengths": ({**good, "coef": [1.0]}, "coef: got 1 values for 2 features"),
        "scale": ({**good, "scale": [1, 0]}, "scale: got 0"),
        "threshold": ({**good, "threshold": 2}, "threshold: got 2"),
    }
    for name, (data, expected) in cases.items():
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(data))
        with pytest.raises(ConfigError) as e:
            load_params(p)
        assert str(p) in str(e.value) and expected in str(e.value), (name, str(e.value))
    with pytest.raises(ConfigError, match="no such detector file"):
        load_params(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ConfigError, match="not a detector file"):
        load_params(tmp_path / "junk.json")
    # a config naming a bad detector is refused when it is loaded, before any run
    from harness.config import load_config

    with pytest.raises(ConfigError, match="no such detector file"):
        load_config(None, [f"collapse.detector={tmp_path / 'missing.json'}"])


def test_the_committed_detector_loads_and_names_its_provenance():
    from harness.detector import DEFAULT_PARAMS_NO_AUDIT as DEFAULT_PARAMS  # runs without audit RMs: today's detector

    p = load_params(DEFAULT_PARAMS)
    prov = p.provenance
    assert prov["commit"] and prov["worlds"] and prov["split"]["files"] and prov["fit_runs"] >= 20
    assert set(p.features) <= set(FEATURES) and 0 < p.threshold < 1


@pytest.mark.parametrize("default, folder", [(DEFAULT_PARAMS_NO_AUDIT, "detector"), (DEFAULT_PARAMS, "detector/audit")])
def test_the_default_detectors_are_the_ones_their_committed_held_out_evaluation_scored(default, folder):
    """reports/detector/ (and audit/) hold the defaults' held-out evaluations, which the READMEs quote: each names
    its default's file and scored that detector (its threshold, patience and provenance), on runs none of whose
    worlds it was fit on."""
    ev = json.loads((ROOT / "reports" / folder / "evaluation.json").read_text())
    p = load_params(default)
    assert ev["detector"]["file"] == default.relative_to(ROOT).as_posix()
    assert (ev["detector"]["threshold"], ev["detector"]["patience"]) == (p.threshold, p.patience)
    assert ev["detector"]["provenance"] == json.loads(json.dumps(p.provenance))
    fit_worlds = p.provenance["split"]["world"]
    held = ev["store"]["provenance"]["world.hash"]
    assert held and not any(h.startswith(w) for h in held for w in fit_worlds)
    assert "fit" not in ev["groups"] and ev["groups"]["held-out (all)"]["runs"] == ev["store"]["runs"]


# ---------------------------------------------------------------- fit and score (analysis.detector)
def write_store(uri: str, runs: list[tuple[str, str, int, str, list[dict[str, float]]]]) -> None:
    """Finished train runs: (figure file, variant, seed, world hash, per-step metrics)."""
    for ablation, variant, seed, world, rows in runs:
        rid = tracking.start_run(uri, ablation, f"{variant}-s{seed}-{world}", tags={
            K.TAG_ROLE: "train", K.TAG_ABLATION: ablation, K.TAG_VARIANT: variant, K.TAG_SEED: str(seed),
            K.TAG_CONFIG_HASH: f"{ablation}:{variant}:{world}", "provenance.world.hash": world})
        tracking.log_params(uri, rid, {"collapse.margin": 0.3, "collapse.confirm": 10, "generation.max_new_tokens": 24})
        tracking.MetricLogger(uri, rid).log_points([(k, v, s) for s, m in enumerate(rows, 1) for k, v in m.items()])
        tracking.end_run(uri, rid, "FINISHED")


def synthetic_runs() -> list:
    """Collapsing runs (the pattern at steps 30-70, at two speeds) and healthy ones, on two worlds
    and two figure files, seeds 0-5."""
    out = []
    for w, world in enumerate(("w0", "w1")):
        for a, ablation in enumerate(("fitfile", "otherfile")):
            for seed in range(6):
                rng = np.random.default_rng([w, a, seed])  # the same store in every process (str hashes are not)
                at = int(rng.integers(30, 70))
                out.append((ablation, "collapses", seed, world, stream(at + 40, at=at, rate=1 + seed % 2, seed=seed)))
                out.append((ablation, "holds", seed, world, stream(160, seed=seed + 10)))
    return out


def test_fit_and_score_out_of_sample_on_a_synthetic_store(tmp_path, capsys):
    from analysis import detector as D

    uri = sqlite_uri(tmp_path / "s.db")
    runs = synthetic_runs()
    first = [r for r in runs if r[0] == "fitfile" and r[3] == "w0"]  # the 12 runs of the first split, alone in the store
    write_store(uri, first)  # (each load below reads every run of the store: 12 here, not 48)
    save = tmp_path / "fitted.json"
    argv = ["--tracking-uri", uri, "--fit-world", "w0", "--fit-files", "fitfile", "--fit-seeds", "0-5",
            "--out", str(tmp_path / "out")]
    with pytest.raises(ConfigError, match="at least 20 runs"):  # 12 fit runs are too few to fit on
        D.fit([r for r in D.assign(D.load_runs(uri), D.Split("w0", ["fitfile"], list(range(6)))) if r.group == "fit"])
    assert D.main(["fit", *argv, "--save", str(save)]) == 2 and "at least 20 runs" in capsys.readouterr().err

    # enough runs: the fit world and both files, seeds 0-4 (20 runs); held out: seed 5 and world w1
    write_store(uri, [r for r in runs if r not in first])
    argv = ["--tracking-uri", uri, "--fit-world", "w0", "--fit-files", "fitfile,otherfile", "--fit-seeds", "0-4",
            "--out", str(tmp_path / "out")]
    assert D.main(["fit", *argv, "--save", str(save)]) == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("held-out: recall ") and "false alarms" in last and "median lead" in last
    ev = json.loads((tmp_path / "out" / "evaluation.json").read_text())
    assert set(ev["groups"]) == {"fit", "held-out seeds", "held-out world: w1 (cap 24)", "held-out (all)"}
    held = ev["groups"]["held-out (all)"]
    assert held["runs"] == 4 + 24 and held["fell"] == held["held"] == 14
    assert held["recall"] >= 0.9 and held["fa_rate"] <= 0.1 and held["lead_median"] > 0  # the pattern is plain here
    assert held["recall_ci"][0] <= held["recall"] <= held["recall_ci"][1]
    assert set(ev["baselines"]) == set(D.BASELINES) and ev["curve"]
    assert (tmp_path / "out" / "detector.png").is_file()
    # the fitted file reloads to the same detector, its provenance names the split and the store
    p = load_params(save)
    assert p.provenance["split"] == {"world": "w0", "files": ["fitfile", "otherfile"], "seeds": [0, 1, 2, 3, 4], "trials": None}
    assert p.provenance["fit_runs"] == 20 and p.provenance["fit_fell"] == 10
    # the baselines' thresholds, fit on the same runs, travel with it: a store without its fit runs uses them
    assert p.provenance["baselines"] == {n: b["threshold"] for n, b in ev["baselines"].items()}
    again = D.main(["evaluate", *argv, "--params", str(save)])
    assert again == 0 and capsys.readouterr().out.strip().splitlines()[-1] == last
    from_store = json.loads((tmp_path / "out" / "evaluation.json").read_text())

    # the store's runs in a runs file: read back equal, scored the same without the store
    runs_file = tmp_path / "campaign" / "runs.npz"
    assert D.main(["export", "--tracking-uri", uri, "--to", str(runs_file)]) == 0
    assert "written 48 runs (24 whose gold fell" in capsys.readouterr().out
    back, prov = D.read_runs(runs_file)
    assert prov["store"] == uri and prov["runs"] == 48 and prov["worlds"] == ["w0", "w1"]
    key = lambda r: r.run_id  # noqa: E731
    assert sorted(back, key=key) == sorted(D.load_runs(uri), key=key)  # every field, every step's every signal
    file_argv = ["--runs", str(runs_file), *argv[2:]]
    assert D.main(["evaluate", *file_argv, "--params", str(save)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == last
    from_file = json.loads((tmp_path / "out" / "evaluation.json").read_text())
    assert from_file["groups"] == from_store["groups"] and from_file["baselines"] == from_store["baselines"]
    assert from_file["store"]["uri"].startswith(f"{runs_file} (exported from {uri}")
    # several runs files pool their runs, each run once: the file twice scores as the file once
    assert D.main(["evaluate", "--runs", f"{runs_file},{runs_file}", *argv[2:], "--params", str(save)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == last
    assert json.loads((tmp_path / "out" / "evaluation.json").read_text())["store"]["runs"] == 48
    # bad input: said with the flag, the value and what is allowed
    junk = tmp_path / "junk.npz"
    np.savez(junk, x=np.zeros(2))
    for extra, expected in ((["--runs", str(tmp_path / "none.npz")], "no such file"),
                            (["--runs", f"{runs_file},{tmp_path / 'none.npz'}"], "no such file"),
                            (["--runs", str(junk)], "is not a runs file"),
                            (["--runs", str(runs_file), "--tracking-uri", uri], "both given")):
        assert D.main(["evaluate", *extra, "--params", str(save)]) == 2
        err = capsys.readouterr().err
        assert expected in err and "allowed:" in err, err
    assert D.main(["export", "--tracking-uri", uri, "--to", str(tmp_path / "runs.json")]) == 2
    assert "allowed: a file name ending in .npz" in capsys.readouterr().err
    assert D.main(["evaluate", *file_argv[:2], "--fit-world", "w", "--params", str(save)]) == 2  # w0 or w1?
    assert "--fit-world: got w; allowed: the hashes (or unique prefixes" in capsys.readouterr().err
    assert D.main(["families", *file_argv[:2], "--fit-files", "fitfile,nope"]) == 2  # before any fit
    assert "--fit-files: got nope, which no run here is of; allowed: figure files of these runs: fitfile, otherfile" in (
        capsys.readouterr().err)
    # every run a fit run: fit writes the detector and says there is nothing to score it on; families chooses
    # the family set on the fit runs alone (cross-validated) and writes its detectors, for runs still to come;
    # evaluate, whose point is the held-out score, refuses before it scores anything
    everything = ["--runs", str(runs_file), "--fit-world", "w0,w1", "--fit-files", "fitfile,otherfile",
                  "--fit-seeds", "0-5", "--out", str(tmp_path / "all")]
    assert D.main(["evaluate", *everything, "--params", str(save)]) == 2
    assert "every run here is a fit run (48 runs of world w0,w1" in capsys.readouterr().err
    assert D.main(["fit", *everything, "--save", str(tmp_path / "all.json"), "--fa-by", "estimator"]) == 0
    assert "none to score it on" in capsys.readouterr().out
    assert load_params(tmp_path / "all.json").provenance["fit_runs"] == 48
    assert load_params(tmp_path / "all.json").provenance["fa_by"] == "estimator" and p.provenance["fa_by"] == "pooled"
    assert D.main(["families", *everything, "--save", str(tmp_path / "fam.json"),
                   "--save-no-audit", str(tmp_path / "fam_no_audit.json")]) == 0
    out = capsys.readouterr().out
    assert "none to score the detectors on" in out and "held-out:" not in out
    fam = json.loads((tmp_path / "all" / "families.json").read_text())
    chosen = fam["chosen"]
    assert f"chosen on the fit runs: {chosen}" in out and fam["sets"][chosen]["evaluation"] is None
    assert not (tmp_path / "all" / "evaluation.json").exists()
    saved = load_params(tmp_path / "fam.json")
    assert saved.provenance["fit_runs"] == 48 and saved.features == fam["sets"][chosen]["features"]


def test_each_detector_is_scored_with_its_own_scores_even_after_another_is_freed():
    """warn_step caches a run's scores by the detector's id: a freed detector's id must not hand its scores to the
    next one (CPython reuses ids), so the cache keeps each detector it scored alive and checks it is the same."""
    import gc
    import weakref

    from analysis import detector as D

    rows = stream(160, at=60, rate=2, seed=3)  # a fall the committed detector warns on (step 136)
    run = D.RunData("r-ids", "a", "v", 0, "w0", "a:gae", list(enumerate(rows, 1)), 60, len(rows), 24, estimator="gae")
    first = load_params(DEFAULT_PARAMS_NO_AUDIT)
    assert D.warn_step(first, run) == replay(first, run.rows)[1].step
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is not None  # still held by the cache, so its id is not free for another detector
    p = load_params(DEFAULT_PARAMS_NO_AUDIT)
    late = dataclasses.replace(p, threshold=1.0 - 1e-9, patience=1000)  # another detector: never warns here
    assert replay(late, run.rows)[1] is None and D.warn_step(late, run) is None


def test_campaigns_scored_each_with_its_own_detector_pool_their_warnings_and_leave_out_fit_runs(tmp_path, capsys):
    """`declared`: each runs file with the detector declared before it; the pooled counts are the files' counts
    summed (not one detector over all), and a run its detector was fit on is left out."""
    from analysis import detector as D
    from analysis.detector_runs import save_runs

    base = load_params(DEFAULT_PARAMS_NO_AUDIT)
    never = dataclasses.replace(base, threshold=1.0 - 1e-12, patience=1000)  # a detector that never warns
    never_file = tmp_path / "never.json"
    never_file.write_text(json.dumps(dataclasses.asdict(never)))
    split = base.provenance["split"]  # its world: one hash, or a list of their prefixes
    fit_world = split["world"][0] if isinstance(split["world"], list) else split["world"]

    def run(i: int, world: str, at: int | None, ablation: str = "a", seed: int = 1) -> D.RunData:
        rows = stream(160, at=at, rate=2, seed=i)
        return D.RunData(f"r{i}", ablation, "v", seed, world, f"{ablation}:{i}", list(enumerate(rows, 1)), at, len(rows),
                         24, estimator="gae")

    a = [run(0, "w1", 60), run(1, "w1", None), run(2, fit_world, 60, ablation=split["files"][0], seed=split["seeds"][0])]  # r2: a fit run
    b = [run(3, "w2", 60), run(4, "w2", None)]
    pooled, each, dropped = D.declared([(a, base), (b, never)])
    assert dropped == 1 and [s["runs"] for s in each] == [2, 2] and pooled["runs"] == 4
    assert each[0]["warned_fell"] == 1 and each[1]["warned_fell"] == 0  # the fall in b: its own detector never warns
    assert pooled["warned_fell"] == 1 and pooled["fell"] == 2 and pooled["recall"] == 0.5
    save_runs(a, tmp_path / "a.npz", {"commit": "t"})
    save_runs(b, tmp_path / "b.npz", {"commit": "t"})
    assert D.main(["declared", "--runs", f"{tmp_path / 'a.npz'},{tmp_path / 'b.npz'}",
                   "--params", f"{DEFAULT_PARAMS_NO_AUDIT},{never_file}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "held-out: recall 0.5, false alarms 0, median lead " + D.fmt_steps(pooled["lead_median"]) + " steps (4 runs)"
    assert "1 runs left out" in "\n".join(out)
    assert D.main(["declared", "--runs", str(tmp_path / "a.npz"), "--params", f"{never_file},{never_file}"]) == 2
    assert "one detector per runs file" in capsys.readouterr().err


def test_held_out_runs_are_scored_once_and_pooled_by_whether_their_estimator_has_a_critic():
    """One configuration in two figure files is the same training twice: scored once, not as two runs. The
    committed detectors were fit on PPO runs with a critic; held-out critic-free runs are pooled apart."""
    from analysis import detector as D

    def run(i: int, ablation: str, estimator: str, seed: int, at: int | None = None, config: str = "") -> D.RunData:
        rows = stream(160 if at is None else at + 40, at=at, seed=seed)
        return D.RunData(f"r{i}", ablation, "v", seed, "w0", config or f"{ablation}:{estimator}",
                         list(enumerate(rows, 1)), at, len(rows), 24, estimator=estimator)

    runs = [run(0, "fitfile", "gae", 0), run(1, "a", "gae", 1), run(2, "b", "gae", 1, config="a:gae"),
            run(3, "a", "grpo", 1), run(4, "a", "grpo", 2, at=50), run(5, "fitfile", "gae", 1, config="fitfile:gae")]
    kept = D.assign(runs, D.Split("w0", ["fitfile"], [0]))
    assert [r.run_id for r in kept] == ["r0", "r1", "r3", "r4", "r5"]  # r2 repeats r1 (another file, same run)
    groups = D.evaluate(kept, load_params(DEFAULT_PARAMS_NO_AUDIT))["groups"]
    assert {g: s["runs"] for g, s in groups.items()} == {
        "fit": 1, "held-out figure files": 3, "held-out seeds": 1, "held-out, with a critic": 2,
        "held-out, critic-free": 2, "held-out (all)": 4}
    assert groups["held-out, critic-free"]["fell"] == 1 and groups["held-out, with a critic"]["fell"] == 0
    only_ppo = D.evaluate([r for r in kept if r.estimator == "gae"], load_params(DEFAULT_PARAMS_NO_AUDIT))["groups"]
    assert "held-out, critic-free" not in only_ppo and "held-out, with a critic" not in only_ppo


def test_cross_validation_leaves_a_file_out_or_keeps_a_configuration_in_one_fold():
    from types import SimpleNamespace

    from analysis.detector import CV_FOLDS, MIN_EACH, cv_folds

    def runs(files: list[str], configs: int, worlds: int = 2, fell=lambda f, c: c % 2 == 0) -> list:
        # a figure file's runs: no trial, one configuration on each world
        return [SimpleNamespace(ablation=f, config_hash=f"{f}-c{c}", run_id=f"{f}-c{c}-w{w}", trial=None, world=f"w{w}",
                                fell=fell(f, c)) for f in files for c in range(configs) for w in range(worlds)]

    two = runs(["a", "b"], 12)
    how, folds = cv_folds(two)
    assert how == "leave one figure file out" and len(folds) == 2
    assert [{two[i].ablation for i in test} for _, test in folds] == [{"a"}, {"b"}]
    one = runs(["study"], 12)  # a design study: one file, each configuration on two worlds
    how, folds = cv_folds(one)
    assert how == f"{CV_FOLDS} folds by configuration" and len(folds) == CV_FOLDS
    tested = [one[i].config_hash for _, test in folds for i in test]
    assert sorted(tested) == sorted(r.config_hash for r in one)  # every run tested once
    for train, test in folds:  # a configuration's other world never trains the fold that tests it
        assert not {one[i].config_hash for i in train} & {one[i].config_hash for i in test}
        assert {one[i].fell for i in test} == {True, False}  # stratified: each fold tests both kinds
    # every run whose gold held in one file: leaving it out leaves nothing to set a threshold on, so the
    # folds go by configuration, each training on at least MIN_EACH of each kind
    held_in_b = runs(["a", "b", "c"], 6, fell=lambda f, c: f != "b")
    how, folds = cv_folds(held_in_b)
    assert how == f"{CV_FOLDS} folds by configuration"
    for train, test in folds:
        assert min(sum(held_in_b[i].fell for i in train), sum(not held_in_b[i].fell for i in train)) >= MIN_EACH
        assert not {held_in_b[i].config_hash for i in train} & {held_in_b[i].config_hash for i in test}
    # a design study's trial on two worlds: two config hashes (the world is in the config), one configuration
    study = [SimpleNamespace(ablation="study", config_hash=f"h{c}-w{w}", run_id=f"c{c}-w{w}", trial=c, fell=c % 3 == 0,
                             world=f"w{w}") for c in range(12) for w in range(2)]
    _, folds = cv_folds(study)
    for train, test in folds:
        assert not {study[i].trial for i in train} & {study[i].trial for i in test}


def test_cross_validation_leaves_a_world_out_when_asked():
    """--cv world leaves one world out; auto (the default) leaves a figure file out whatever the worlds; a named
    split the runs cannot give is an error naming it."""
    from types import SimpleNamespace

    from analysis.detector import MIN_EACH, cv_folds
    from harness.schema import ConfigError

    def runs(worlds: int, files=("a", "b"), configs: int = 6) -> list:
        return [SimpleNamespace(ablation=f, config_hash=f"{f}-c{c}", run_id=f"{f}-c{c}-w{w}", trial=None, world=f"w{w}",
                                fell=c % 2 == 0) for f in files for c in range(configs) for w in range(worlds)]

    three = runs(3)
    how, folds = cv_folds(three, "world")
    assert how == "leave one world out" and len(folds) == 3
    assert [{three[i].world for i in test} for _, test in folds] == [{"w0"}, {"w1"}, {"w2"}]
    for train, test in folds:  # no world both trains and tests a fold; each fold fits on both kinds
        assert not {three[i].world for i in train} & {three[i].world for i in test}
        assert min(sum(three[i].fell for i in train), sum(not three[i].fell for i in train)) >= MIN_EACH
    assert cv_folds(three)[0] == cv_folds(three, "file")[0] == "leave one figure file out"
    assert cv_folds(three, "config")[0].endswith("folds by configuration")
    with pytest.raises(ConfigError, match=r"--cv world: the fit runs span 1 world\(s\)"):
        cv_folds(runs(1), "world")
    with pytest.raises(ConfigError, match=r"--cv file: the fit runs span 1 figure file\(s\)"):
        cv_folds(runs(3, files=("a",)), "file")
    # every run whose gold held on one world: leaving it out leaves nothing to set a threshold on
    lopsided = [r for r in runs(3, configs=10) if r.world == "w0" or r.fell]
    with pytest.raises(ConfigError, match="--cv world"):
        cv_folds(lopsided, "world")
    with pytest.raises(ConfigError, match=r"--cv: got 'worlds'; allowed: auto, file, config, world"):
        cv_folds(three, "worlds")


def test_a_split_by_trials_holds_a_design_studys_other_configurations_out():
    from types import SimpleNamespace

    from analysis.detector import Split

    split = Split(["w0", "w1"], ["study", "fig"], [0], trials=[0, 1])

    def group(**kw) -> str:
        return split.group(SimpleNamespace(**{"world": "w0", "ablation": "study", "seed": 0, "trial": 0, **kw}), {})

    assert group() == group(world="w1") == "fit"
    assert group(trial=2) == "held-out configurations"
    assert group(ablation="fig", trial=None) == "fit"  # a figure file's runs have no trial
    assert group(ablation="other") == "held-out figure files" and group(seed=1) == "held-out seeds"
    assert group(world="w2").startswith("held-out world")
    assert Split("w0", ["study"], [0]).group(SimpleNamespace(world="w0", ablation="study", seed=0, trial=7), {}) == "fit"


def test_fit_refuses_a_store_without_gold(tmp_path, capsys):
    from analysis import detector as D

    uri = sqlite_uri(tmp_path / "s.db")
    rows = [{k: v for k, v in m.items() if k != K.GOLD_SCORE} for m in stream(40)]
    write_store(uri, [("hh", "ppo", 0, "none", rows)])
    assert D.main(["fit", "--tracking-uri", uri, "--out", str(tmp_path / "o")]) == 2
    assert "no finished train run with a gold reward" in capsys.readouterr().err


def test_only_finished_runs_count_and_the_start_is_the_runs_own_early_gold(tmp_path):
    """A run in flight is not scored (its gold may yet fall); the start is the run's own per-step gold on
    its training prompts, not the eval gold at step 0 (other prompts, another level)."""
    from analysis import detector as D

    uri = sqlite_uri(tmp_path / "s.db")
    write_store(uri, [("f", "holds", 0, "w0", stream(60)), ("f", "falls", 0, "w0", stream(60, at=20))])
    by = {r.variant: r for r in D.load_runs(uri)}
    assert by["holds"].onset is None and by["falls"].onset is not None
    rid = by["holds"].run_id
    tracking.MetricLogger(uri, rid).log({K.EVAL_GOLD: 5.0}, step=0)  # far above every training-prompt gold
    assert {r.variant: r.onset for r in D.load_runs(uri)}["holds"] is None
    tracking.reopen_run(uri, rid)
    assert [r.variant for r in D.load_runs(uri)] == ["falls"]


def test_signals_the_detector_reads_are_logged_by_every_run():
    assert set(BASE_SIGNALS.values()) <= set(K.STEP_METRICS) | {K.PPL_TOKENS}


ROOT = Path(__file__).resolve().parents[1]
COMMITTED_EVALUATIONS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "reports" / "detector").rglob("evaluation.json"))


@pytest.mark.parametrize("summary", [*COMMITTED_EVALUATIONS, "reports/reference.json"])
def test_committed_evaluations_print_their_held_out_line_and_the_readmes_agree(summary, capsys):
    """`python -m analysis.detector evaluate --summary FILE` on each committed evaluation (an evaluation.json
    itself, whose "detector" is the detector's parameters, or reference.json) prints its held-out line, and
    reports/README.md carries that line."""
    from pathlib import Path

    from analysis.detector import main

    root = Path(__file__).resolve().parents[1]
    ref = json.loads((root / summary).read_text())
    line = (ref if "groups" in ref else ref["detector"])["line"]
    assert main(["evaluate", "--summary", str(root / summary)]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == line
    assert f"`{line}`" in (root / "reports" / "README.md").read_text()


FROM_RUNS_FILES = [e for e in COMMITTED_EVALUATIONS
                   if json.loads((ROOT / e).read_text()).get("store", {}).get("uri", "").split(" (exported from")[0].endswith(".npz")]


@pytest.mark.parametrize("summary", FROM_RUNS_FILES)
def test_committed_runs_files_give_their_committed_evaluations_again(summary, tmp_path, capsys, monkeypatch):
    """Every committed evaluation scored from committed runs files (a campaign's `runs.npz`, or several pooled:
    `--runs A,B`) comes out the same when its detector is scored on those files again: the line, every group
    and baseline."""
    from analysis.detector import main

    monkeypatch.chdir(ROOT)  # the evaluation names its runs files and detector as the README's command does
    ev = json.loads((ROOT / summary).read_text())
    # the store as `--runs A,B` records it: "A (exported from ... at C) + B (exported from ...)"
    runs = ",".join(part.split(" (exported from")[0] for part in ev["store"]["uri"].split(" + "))
    params = ev["detector"]["file"]
    assert main(["evaluate", "--runs", runs, "--params", params, "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == ev["line"]
    again = json.loads((tmp_path / "evaluation.json").read_text())
    assert again["groups"] == ev["groups"] and again["baselines"] == ev["baselines"] and again["curve"] == ev["curve"]


def test_false_alarms_held_per_kind_of_estimator_set_a_threshold_no_kind_exceeds():
    """--fa-by estimator: a threshold whose pooled false alarms are within the target but whose critic-free ones
    are not is refused; the lowest threshold that keeps each kind within the target is taken. Warnings here
    are a run's score against the threshold: a run warns where its score reaches it."""
    from types import SimpleNamespace

    from analysis.detector import choose_threshold, fa_gate, held_kinds
    from harness.schema import ConfigError

    # 10 held runs with a critic, none warned above 0.3; 5 held critic-free runs, one of them scoring 0.8
    held = [SimpleNamespace(fell=False, estimator="gae", score=0.2) for _ in range(10)]
    held += [SimpleNamespace(fell=False, estimator="grpo", score=s) for s in (0.8, 0.1, 0.1, 0.1, 0.1)]
    runs = held + [SimpleNamespace(fell=True, estimator="gae", score=0.9)]
    grid = [0.1, 0.3, 0.5, 0.85]

    def warns(t: float) -> list:
        return [0 if r.score >= t else None for r in runs]

    # pooled: 1 false alarm of 15 held (0.067) at 0.3 is within 0.1; by kind the critic-free 1 of 5 (0.2) is not
    assert choose_threshold(warns, runs, grid, 0.1) == 0.3
    assert choose_threshold(warns, runs, grid, 0.1, "estimator") == 0.85
    assert fa_gate(runs, warns(0.3)) == pytest.approx(1 / 15)
    assert fa_gate(runs, warns(0.3), "estimator") == pytest.approx(1 / 5)
    assert [len(k) for k in held_kinds(runs, "estimator")] == [10, 5]
    assert [len(k) for k in held_kinds(runs[:10] + runs[-1:], "estimator")] == [10]  # a kind with no held run: none
    with pytest.raises(ConfigError, match="--fa-by: got 'critic'; allowed: pooled, estimator"):
        held_kinds(runs, "critic")
