"""The design of a study (harness.design, harness.sweep): ablations/study_tricks.yaml's Sobol design covers
every value of every choice and reproduces exactly (one runner, two runners on one storage, a made-up
trial in between); dependent choices are drawn only where their parents allow them and their runs get
the `otherwise` value; groups set their settings; a random (TrialSeeded) design reproduces as well; bad
study files are refused before any store exists, naming the file and the field. Fast: no training."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import optuna
import pytest
import yaml

from harness import design, sweep, sweepfile
from harness.config import from_dict
from harness.schema import ConfigError

from helpers import study_storage

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "ablations" / "study_tricks.yaml"
CRITIC = ["ppo", "apa", "awr"]


def study_copy(tmp_path: Path, name: str = "study_tricks", **changes) -> Path:
    """ablations/study_tricks.yaml beside tmp_path (its base made absolute), with top-level `changes`."""
    data = yaml.safe_load(STUDY.read_text())
    data["base"] = str(REPO / "ablations" / data["base"])
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return sweepfile.load_sweep(study_copy(tmp_path_factory.mktemp("design")))


def ask(study: optuna.Study, spec: sweepfile.SweepSpec) -> dict:
    trial = study.ask()
    params = design.suggest(spec.space, trial)
    study.tell(trial, 0.0)
    return params


def test_the_study_file_covers_every_value_with_its_dependencies(spec):
    assert spec.file.sampler.name == "sobol" and spec.trials * len(spec.units) == 256 and not spec.warnings
    counts = design.coverage(spec.space, spec.design)
    assert all(n > 0 for c in counts.values() for n in c.values()), counts
    assert sum(counts["algorithm"].values()) == 128 and min(counts["algorithm"].values()) >= 21  # balanced
    for params in spec.design:
        assert ("reward.clip" in params) == (params["reward"] == "normalize")
        assert ("ppo.adv_clip" in params) == params["ppo.adv_normalize"]
        assert ("ppo.kl_placement" in params) == ("ppo.kl_estimator" in params) == (params["ppo.kl_coef"] > 0)
        critic = params["algorithm"] in CRITIC
        assert all((k in params) == critic for k in ("model.critic_init", "ppo.critic_pretrain_steps",
                                                      "ppo.value_clip", "ppo.gae_lambda"))
        assert ("ppo.importance_sampling" in params) == ("ppo.clip_eps" in params) == (params["algorithm"]
                                                                                      not in ("apa", "awr"))


def test_the_first_eight_sobol_points_meet_every_value_of_each_choice_drawn_always(spec):
    first = spec.design[:8]  # a scrambled Sobol net: each 1/8 stratum of every coordinate once
    for key, dim in spec.space.items():
        if not dim.when and len(dim.choices) <= 8:
            assert {design.label(p[key]) for p in first} == {design.label(c) for c in dim.choices}, key


def test_a_trial_config_takes_group_settings_and_otherwise_values(spec):
    params = next(p for p in spec.design if p["algorithm"] == "grpo" and p["reward"] == "scale")
    cfg = from_dict(sweepfile.trial_config(spec, params))
    assert cfg.ppo.adv_estimator == "grpo" and cfg.generation.samples_per_prompt == 4
    assert cfg.reward.scale and not cfg.reward.normalize and cfg.reward.clip is None  # reward.clip: otherwise null
    assert cfg.ppo.critic_pretrain_steps == 0 and cfg.ppo.value_clip is None and cfg.ppo.gae_lambda == 0.9
    params = next(p for p in spec.design if p["ppo.kl_coef"] == 0.0)
    assert from_dict(sweepfile.trial_config(spec, params)).ppo.kl_estimator == "k1"


@pytest.mark.parametrize("sampler", ["sobol", "random"])
def test_a_seeded_design_reproduces_with_two_runners_and_a_made_up_trial(tmp_path, spec, sampler):
    s = spec if sampler == "sobol" else sweepfile.load_sweep(study_copy(tmp_path, sampler={"name": "random", "seed": 3}))
    alone = design.simulate(s.space, lambda: sweepfile.make_sampler(s), 12, s.direction)
    assert alone == design.simulate(s.space, lambda: sweepfile.make_sampler(s), 12, s.direction)
    url = study_storage(tmp_path)
    a = optuna.create_study(storage=url, study_name="x", sampler=sweepfile.make_sampler(s), direction=s.direction)
    b = optuna.load_study(storage=url, study_name="x", sampler=sweepfile.make_sampler(s))  # a second runner
    got = [ask(a, s), ask(b, s), ask(b, s), ask(a, s)]
    a.enqueue_trial(got[1], user_attrs={"retry_of": 1})  # trial 1 interrupted: made up with its values
    got += [ask(a, s)] + [ask(r, s) for r in (b, a, b, a, b, a, b, a)]
    assert got[4] == got[1]  # the make-up
    assert got[:4] + got[5:] == alone  # the design's points 0..11, whoever asked and whatever was made up
    trials = a.get_trials()
    assert [t.user_attrs.get("retry_of") for t in trials][4] == 1
    assert [design.design_index(a, t) for t in trials] == [0, 1, 2, 3, None, *range(4, 12)]


def test_choices_added_to_the_design_keep_the_committed_studys_draws(spec):
    """The committed study (reports/study_tricks: its best trial and its draws per value) ran before the
    tricks since the paper were added to the file (sampler.added): every trial still draws what it drew."""
    committed = json.loads((REPO / "reports" / "study_tricks" / "tricks.json").read_text())
    first = [k for k in spec.space if k not in spec.file.sampler.added]
    assert set(committed["best"]["values"]) <= set(first) and spec.file.sampler.added  # the file has added choices
    best = spec.design[committed["best"]["number"]]
    assert {k: design.label(best[k]) for k in committed["best"]["values"]} == committed["best"]["values"]
    with (REPO / "reports" / "study_tricks" / "tricks_values.csv").open() as f:
        drawn = {(r["choice"], r["value"]): int(r["n"]) for r in csv.DictReader(f) if r["value"] != "(not drawn)"}
    counts = design.coverage(spec.space, spec.design[:committed["configs"]])
    assert {(k, v): n for k in first for v, n in counts[k].items()} == drawn
    # one sequence over every choice (added ignored) would have moved the committed trials' draws
    moved = design.simulate(spec.space, lambda: design.Sobol(spec.space, spec.file.sampler.seed), committed["configs"])
    assert {k: design.label(moved[committed["best"]["number"]].get(k)) for k in committed["best"]["values"]} != \
        committed["best"]["values"]
    # the added choices are balanced with the others, not aligned with them: each value drawn, in both halves
    # of every first choice they depend on
    for k in spec.file.sampler.added:
        assert min(counts[k].values()) >= 8, (k, counts[k])
    normalized = [p for p in spec.design if p.get("ppo.adv_normalize_mode")]
    assert {p["ppo.adv_normalize_mode"] for p in normalized} == {"minibatch", "group_mean_batch_std"}


def test_a_dependent_choice_is_checked_where_its_parents_draw_it(spec):
    """ppo.adv_normalize_mode=group_mean_batch_std is valid only with normalization on and groups of samples
    (its parents), ppo.dynamic_sampling_tol only with a group estimator: accepted as the file draws them."""
    for params in spec.design:
        cfg = from_dict(sweepfile.trial_config(spec, params))
        if "ppo.adv_normalize_mode" in params:
            assert cfg.ppo.adv_normalize and cfg.generation.samples_per_prompt == 4
        if params.get("ppo.dynamic_sampling_tol") is not None:
            assert cfg.ppo.adv_estimator in ("grpo", "rloo")


def bad(tmp_path: Path, edit) -> Path:
    data = yaml.safe_load(STUDY.read_text())
    data["base"] = str(REPO / "ablations" / data["base"])
    edit(data)
    path = tmp_path / "study_tricks.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def space(**dims):
    def edit(data):
        data["search_space"].update(dims)
    return edit


BAD = {  # edit -> what the error must say (after "<file>: ")
    "not a config key": (space(**{"ppo.kl_cof": [0.0, 0.1]}), "search_space.ppo.kl_cof: not a TrainConfig key; did "
                                                              "you mean ppo.kl_coef?"),
    "value out of range": (space(**{"ppo.clip_eps": {"choices": [0.1, 2.0], "when": {"algorithm": "ppo"},
                                                     "otherwise": 0.2}}),
                           "search_space.ppo.clip_eps.choices: ppo.clip_eps: got 2.0; allowed: a number > 0 and <= 1"),
    "empty choices": (space(**{"ppo.kl_coef": []}), "search_space.ppo.kl_coef.choices: got []; allowed: a non-empty"),
    "unknown parent": (space(**{"reward.clip": {"choices": [0.3], "when": {"rewrad": "normalize"}, "otherwise": None}}),
                       "search_space.reward.clip.when.rewrad: not a choice of this study; did you mean 'reward'?"),
    "a value the parent never takes": (
        space(**{"reward.clip": {"choices": [0.3], "when": {"reward": "normalise"}, "otherwise": None}}),
        "search_space.reward.clip.when.reward: got 'normalise'; allowed: values reward takes, one of "
        "['raw', 'scale', 'normalize']"),
    "when without otherwise": (space(**{"reward.clip": {"choices": [0.3], "when": {"reward": "normalize"}}}),
                               "search_space.reward.clip.otherwise: missing; allowed: a choice drawn only `when`"),
    "otherwise without when": (space(**{"ppo.entropy_coef": {"choices": [0.0, 0.01], "otherwise": 0.0}}),
                               "search_space.ppo.entropy_coef.otherwise: given without `when`"),
    "otherwise out of range": (space(**{"reward.clip": {"choices": [0.3], "when": {"reward": "normalize"},
                                                        "otherwise": 0.0}}),
                               "search_space.reward.clip.otherwise: reward.clip: got 0.0; allowed: a number > 0"),
    "a cycle": (space(**{"ppo.adv_normalize": {"choices": [False, True], "when": {"ppo.adv_clip": 0.5},
                                               "otherwise": False}}),
                "search_space.ppo.adv_normalize.when: a cycle of dependencies leads back to ppo.adv_normalize"),
    "a group's unknown key": (space(reward={"group": {"raw": {"reward.sacle": False}, "normalize": {}}}),
                              "search_space.reward.group.raw: reward.sacle: unknown config key; did you mean "
                              "reward.scale?"),
    "a group's bad value": (space(reward={"group": {"raw": {"reward.normalize": "no"}, "normalize": {}}}),
                            "search_space.reward.group.raw.reward.normalize: got 'no'; allowed: true or false"),
    "a group keyed by a config key": (space(**{"ppo.kl_coef": {"group": {"a": {"ppo.entropy_coef": 0.0}}}}),
                                      "search_space.ppo.kl_coef: ppo.kl_coef is a config key; allowed: a group"),
    "a key set twice": (space(extra={"group": {"a": {"ppo.kl_coef": 0.1}}}),
                        "search_space.extra: sets ppo.kl_coef, which search_space.ppo.kl_coef sets too"),
    "a group's config invalid": (space(algorithm={"group": {"g": {"generation.samples_per_prompt": 3}}}),
                                 "search_space.algorithm.group.g.ppo.rollout_batch_size: got 32; allowed: a multiple"),
    "no valid config in the design": (  # each value valid alone, not 32 responses in 3 minibatches
        lambda d: (d["set"].update({"ppo.rollout_batch_size": 36}),
                   d["search_space"].update({"ppo.num_minibatches": [2, 3], "ppo.rollout_batch_size": [36, 32]})),
        "search_space: the design's trial "),
    "objective not logged (no eval)": (
        lambda d: d.update(objectives=[{"name": "win", "metric": "eval/win_rate_vs_sft"}], set={**d["set"],
                                                                                             "logging.eval_every": 0}),
        "objectives.0.metric: got 'eval/win_rate_vs_sft'; allowed: a metric every run logs (harness/keys.py) "
        "(logging.eval_every is 0)"),
    "objective a world-build metric": (lambda d: d.update(objectives=[{"name": "acc", "metric": "rm/eval_acc"}]),
                                       "objectives.0.metric: got 'rm/eval_acc'; allowed: a metric every run logs"),
    "objective mistyped": (lambda d: d.update(objectives=[{"name": "kl", "metric": "objective/kl_k"}]),
                           "objectives.0.metric: got 'objective/kl_k'; allowed: a metric every run logs "
                           "(harness/keys.py); did you mean objective/kl_k3?"),
    "objective collapsed with a metric": (
        lambda d: d.update(objectives=[{"name": "c", "stat": "collapsed", "metric": "objective/kl"}]),
        "objectives.0.metric: got 'objective/kl' with stat collapsed; allowed: no metric"),
    "objective stat": (lambda d: d.update(objectives=[{"name": "x", "stat": "median", "metric": "objective/kl"}]),
                       "objectives.0.stat: got 'median'; allowed: one of 'final', 'initial'"),
    "objective names twice": (lambda d: d.update(objectives=[{"name": "x", "metric": "objective/kl"}] * 2),
                              "objectives.1.name: got 'x'; a name is listed twice"),
    "when with a grid sampler": (lambda d: d.update(sampler={"name": "grid"}),
                                 "sampler.name: got 'grid' with a choice drawn only `when`"),
    "worlds twice": (lambda d: d.update(worlds=[0, 0]), "worlds: got [0, 0]; a world seed is listed twice"),
    "a dependent value invalid where it is drawn": (  # valid with grpo, not with ppo (both allowed by its when)
        space(**{"ppo.dynamic_sampling_tol": {"choices": [None, 0.1], "when": {"algorithm": ["grpo", "ppo"]},
                                              "otherwise": None}}),
        "search_space.ppo.dynamic_sampling_tol.choices: ppo.dynamic_sampling_tol: got 0.1 with ppo.adv_estimator=gae"),
    "added with another sampler": (lambda d: d.update(sampler={"name": "random", "seed": 0, "added": ["ppo.dual_clip_c"]}),
                                   "sampler.added: got ['ppo.dual_clip_c'] with sampler random; allowed: []"),
    "added names no choice": (lambda d: d["sampler"].update(added=["ppo.dual_clip"]),
                              "sampler.added: got 'ppo.dual_clip'; allowed: choices of search_space"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_study_files_are_refused_before_any_store_naming_file_and_field(tmp_path, monkeypatch, capsys, case):
    monkeypatch.chdir(tmp_path)
    edit, expected = BAD[case]
    path = bad(tmp_path, edit)
    assert sweep.main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {expected}" in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("*.db")) and not (tmp_path / "runs").exists()


def test_the_dry_run_prints_the_plan_and_the_design(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert sweep.main([str(study_copy(tmp_path)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "128 trials x 1 seed(s) x 2 world(s) [0, 1] = 256 runs x 120 steps" in out and "sampler sobol" in out
    assert "objective final_gold: final of objective/gold_score" in out and "world 1: .harness/worlds/" in out
    assert "  algorithm: ppo 21, apa 21, awr 22, grpo 21, rloo 22, reinforce_pp 21" in out
    assert not list(tmp_path.glob("*.db"))


def test_a_design_too_short_for_a_value_warns(tmp_path):
    s = sweepfile.load_sweep(study_copy(tmp_path, trials=4))
    assert len(s.warnings) == 1 and "trials never draw" in s.warnings[0] and "ppo.gae_lambda=" in s.warnings[0], s.warnings
    with pytest.raises(ConfigError, match="sampler.seed: got None with sampler sobol"):
        sweepfile.load_sweep(study_copy(tmp_path, sampler={"name": "sobol", "seed": None}))
