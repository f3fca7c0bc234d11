"""Warn before the fall (issue 35): the new signals on hand-made batches, the forecast on a known
curve, the audit reward models (world and HH-RLHF paths), the actions on a warning, and bad input."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from harness import keys as K
from harness import signals, tracking
from harness.config import ConfigError, load_config
from harness.detector import (
    BASE_FEATURES,
    FEATURES,
    TREND,
    TREND_WINDOWS,
    DetectorParams,
    Features,
    GaoFit,
    family_features,
    fingerprint,
    least_squares_slope,
    load_params,
    needs_audit,
    reads_audit,
    replay,
)
from harness.train import train

from helpers import HH, fast_overrides, hh_tokenizer, sqlite_uri

needs_shared = pytest.mark.skipif(not HH.is_file(), reason=f"{HH} not present")


# ------------------------------------------------------------------ signals on batches with known values
def test_diversity_of_identical_and_of_all_distinct_responses():
    same = [[5, 6, 7, 8]] * 4
    assert signals.distinct_n(same, 1) == 4 / 16 and signals.distinct_n(same, 2) == 3 / 12
    distinct = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert signals.distinct_n(distinct, 1) == 1.0 and signals.distinct_n(distinct, 2) == 1.0
    assert signals.group_similarity(same, 2, 2) == 1.0  # each prompt's two samples alike
    assert signals.group_similarity(distinct[:2] * 1, 2, 2) == 0.0
    assert signals.group_similarity(same, 1, 2) is None  # one sample per prompt: nothing to compare
    assert signals.distinct_n([[1]], 2) == 1.0  # no 2-gram at all


def test_repetition_inside_a_response():
    # "good good good good": 3 bigrams, all (good, good): the 2nd and 3rd seen before
    assert signals.repeated_share([9, 9, 9, 9], 2) == pytest.approx(2 / 3)
    assert signals.repeated_share([1, 2, 3, 4], 2) == 0.0
    assert signals.repeated_share([1, 2, 1, 2, 1], 2) == pytest.approx(2 / 4)  # (1,2),(2,1),(1,2)*,(2,1)*
    assert signals.repeated_ngrams([[9, 9, 9, 9], [1, 2, 3, 4]], 2) == pytest.approx(1 / 3)
    s = signals.batch_signals([[9, 9, 9, 9], [9, 9, 9, 9]], group_size=2)
    assert s["group_similarity"] == 1.0 and s["distinct_1"] == 1 / 8


def test_audit_statistics():
    proxy = torch.tensor([2.0, 4.0])
    audit = torch.tensor([[1.0, 3.0], [3.0, 5.0]])  # members' per-sample means 2 and 4
    a = signals.audit_stats(proxy, audit)
    assert a["mean"] == 3.0 and a["gap"] == 0.0
    assert a["disagreement"] == pytest.approx(math.sqrt(2))  # std over 2 members of (1, 3) and (3, 5)
    assert a["std"] == pytest.approx(math.sqrt(2))
    assert signals.audit_stats(proxy, audit[:1])["disagreement"] == 0.0


# ------------------------------------------------------------------ the forecast
def test_gao_fit_finds_the_peak_of_a_known_curve():
    alpha, beta = 1.0, 0.5  # R(d) = d (1 - 0.5 ln d): peak at d* = exp(alpha / beta - 1) = e
    fit = GaoFit(min_points=5)
    ds = [0.2 * i for i in range(1, 12)]  # up to d = 2.2, before the peak
    for d in ds:
        ratio = fit.update(d, d * (alpha - beta * math.log(d)))
    assert fit.peak() == pytest.approx(math.e, rel=1e-6)
    assert ratio == pytest.approx(2.2 / math.e, rel=1e-6)
    rising = GaoFit(min_points=5)  # a reward still rising like sqrt(KL) with no bend: beta <= 0, no peak
    for d in ds:
        assert rising.update(d, 2 * d) == 0.0
    assert rising.peak() is None


def stream(n: int, *, audit_falls_at: int | None = None) -> list[dict[str, float]]:
    """Steps of a run with every signal: KL grows; the held-out reward rises, then falls after `audit_falls_at`."""
    rows = []
    for t in range(n):
        kl = 0.01 * t
        audit = 0.02 * t if audit_falls_at is None or t < audit_falls_at else 0.02 * audit_falls_at - 0.05 * (t - audit_falls_at)
        rows.append({K.KL_K3: kl, K.ENTROPY: 2.0, K.PPL_TOKENS: 5.0, K.PPL_REF: 5.0, K.LENGTH: 10.0, K.LENGTH_STD: 2.0,
                     K.FRAC_AT_CAP: 0.0, K.RM_SCORE: 0.03 * t, K.RM_SCORE_STD: 1.0, K.POLICY_CLIPFRAC: 0.1,
                     K.DISTINCT_1: 0.5, K.DISTINCT_2: 0.8, K.REPEATED_2GRAM: 0.01, K.AUDIT_MEAN: audit,
                     K.AUDIT_STD: 1.0, K.AUDIT_DISAGREEMENT: 0.5})
    return rows


def falling_run(n: int, fall: int | None, seed: int) -> list[dict[str, float]]:
    """A run whose held-out (audit) reward turns 25 steps before its gold falls at `fall` (None: never),
    while the base signals move only with the gold; per-step noise of a batch."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for t, m in enumerate(stream(n), 1):
        a = 0.0 if fall is None else max(0.0, t - fall) * 0.05
        early = 0.0 if fall is None else max(0.0, t - (fall - 25)) * 0.05
        noise = 0.05 * rng.standard_normal()
        rows.append({**m, K.AUDIT_MEAN: 0.01 * t - early + noise, K.GOLD_SCORE: -0.5 - 0.8 * a + noise,
                     K.KL: m[K.KL_K3], K.PPL: 5.0, K.APPROX_KL: 0.01, K.PPL_TOKENS: 5.0 * math.exp(-0.4 * a) + noise,
                     K.RM_SCORE: m[K.RM_SCORE] + noise})
    return rows


def test_the_family_ablation_fits_each_set_on_fit_runs_and_scores_it_held_out(tmp_path, capsys, monkeypatch):
    """On a store where only the audit RMs see the fall coming, the sets with them warn earlier held
    out; the choice is made on the fit runs; the reports' table and the evaluation are written."""
    from analysis import detector as D

    uri = sqlite_uri(tmp_path / "s.db")
    for world in ("w0", "w1"):
        for seed in range(12):
            for variant, fall in (("falls", 60 + 3 * seed), ("holds", None)):
                rows = falling_run(fall + 30 if fall else 140, fall, seed + 100 * (world == "w1"))
                rid = tracking.start_run(uri, "f", f"{variant}-{seed}-{world}", tags={
                    K.TAG_ROLE: "train", K.TAG_ABLATION: "f", K.TAG_VARIANT: variant, K.TAG_SEED: str(seed),
                    K.TAG_CONFIG_HASH: f"{variant}:{seed}", "provenance.world.hash": world})
                tracking.log_params(uri, rid, {"collapse.margin": 0.3, "collapse.confirm": 10})
                tracking.MetricLogger(uri, rid).log_points([(k, v, s) for s, m in enumerate(rows, 1) for k, v in m.items()])
                tracking.end_run(uri, rid, "FINISHED")
    out = tmp_path / "out"
    sets = {"base (today's features)": ("base",), "base + audit RMs": ("base", "audit")}
    monkeypatch.setattr(D, "FAMILY_SETS", sets)  # two of the six sets: the same code, in half the time
    assert D.main(["families", "--tracking-uri", uri, "--fit-world", "w0", "--fit-files", "f", "--fit-seeds", "0-11",
                   "--out", str(out), "--save", str(tmp_path / "d.json")]) == 0
    printed = capsys.readouterr().out
    assert "chosen on the fit runs: base + audit RMs" in printed
    assert printed.strip().splitlines()[-1].startswith("held-out: recall")
    fam = json.loads((out / "families.json").read_text())
    base, audit = (fam["sets"][n]["evaluation"]["groups"]["held-out (all)"] for n in sets)
    assert base["runs"] == audit["runs"] == 24  # the same held-out runs: world w1
    assert audit["lead_median"] > base["lead_median"] + 10
    ev = json.loads((out / "evaluation.json").read_text())
    assert ev["families"]["rows"][0][0] == "signals" and (out / "families.png").is_file()
    assert set(json.loads((tmp_path / "d.json").read_text())["features"]) <= set(FEATURES)


def test_features_by_family_and_the_signals_they_need():
    assert set(family_features(["base"])) == set(BASE_FEATURES)
    f = Features(window=3, baseline_steps=2, names=family_features(["audit", "forecast"]))
    rows = stream(40, audit_falls_at=20)
    out = [f.update(m) for m in rows]
    assert out[3] is None and out[4] is not None  # the start and one window first
    assert out[-1]["audit_slope"] < 0 < out[15]["audit_slope"]  # the held-out reward turns
    assert out[-1]["audit_gap"] > out[15]["audit_gap"]  # the proxy goes on rising past it
    assert out[-1]["audit_peak"] > out[10]["audit_peak"]
    base_only = {k: v for k, v in rows[0].items() if not k.startswith("audit/")}
    with pytest.raises(KeyError, match="audit/score_mean"):
        Features(3, 2, ["audit_gain"]).update(base_only)
    Features(3, 2).update(base_only)  # today's features need no audit signal


# ------------------------------------------------------------------ the trend family (measured, not adopted)
def trend_stream(n: int, *, rm=lambda t: 0.0, audit=lambda t: 0.0, dis=lambda t: 0.5, kl=lambda t: 0.01 * t,
                 rm_std: float = 1.0, audit_std: float = 1.0, entropy: float = 2.0) -> list[dict[str, float]]:
    """stream()'s signals with the proxy RM, the audit RMs' mean and disagreement and the KL as given."""
    return [{**m, K.RM_SCORE: rm(t), K.RM_SCORE_STD: rm_std, K.AUDIT_MEAN: audit(t), K.AUDIT_STD: audit_std,
             K.AUDIT_DISAGREEMENT: dis(t), K.KL_K3: kl(t), K.ENTROPY: entropy} for t, m in enumerate(stream(n))]


def trend_features(rows, window: int = 3, baseline_steps: int = 2, names=TREND) -> list[dict[str, float] | None]:
    f = Features(window, baseline_steps, names)
    return [f.update(m) for m in rows]


def test_least_squares_slope():
    assert least_squares_slope([1.0, 3.0, 5.0, 7.0]) == pytest.approx(2.0)
    assert least_squares_slope([0.0, 1.0, 0.0, 1.0]) == pytest.approx(0.2)  # 3 / 15 by hand
    assert least_squares_slope([4.0]) == least_squares_slope([]) == 0.0


def test_trend_features_on_streams_of_known_shape():
    window, span = 3, TREND_WINDOWS * 3
    # the proxy climbs 0.1 a step in spreads of 2, the audit RMs 0.02 a step in spreads of 0.5: the gap
    # grows (0.05 - 0.04) = 0.01 a step, 0.03 a window
    out = trend_features(trend_stream(40, rm=lambda t: 0.1 * t, rm_std=2.0, audit=lambda t: 0.02 * t, audit_std=0.5))
    assert out[window] is None and out[window + 1] is not None  # the same steps as every other family
    assert out[-1]["gap_trend"] == pytest.approx(0.03)
    # a gap rising throughout: all of it since the start (trailing mean of steps 37-39 less the start, 0-1)
    assert out[-1]["gap_cusum"] == pytest.approx(0.01 * (38 - 0.5))
    # disagreement growing 5% a step: the ratio of trailing means L steps apart is exp(0.05 L) exactly
    out = trend_features(trend_stream(40, dis=lambda t: 0.5 * math.exp(0.05 * t)))
    assert out[-1]["audit_dis_trend"] == pytest.approx(0.05 * span)
    assert out[-1]["kl_curvature"] == pytest.approx(0.0, abs=1e-12)  # KL linear in t: no curvature
    # KL = c t^2: the second difference of its trailing mean over h steps is 2 c h^2, in the start's entropy
    out = trend_features(trend_stream(40, kl=lambda t: 0.001 * t * t, entropy=2.0))
    h = span // 2
    assert out[-1]["kl_curvature"] == pytest.approx(2 * 0.001 * h * h / 2.0)
    assert out[-1]["gap_trend"] == out[-1]["gap_cusum"] == out[-1]["audit_dis_trend"] == 0.0


def test_the_gap_cusum_counts_the_rise_from_the_gaps_lowest_point():
    """The audit RMs first rise faster than the proxy (the gap falls), then stop while it climbs on."""
    rows = trend_stream(44, rm=lambda t: 0.1 * t, audit=lambda t: 0.2 * min(t, 25))
    out = trend_features(rows, names=TREND + ("audit_gap",))
    gaps = [x["audit_gap"] for x in out if x is not None]
    cusum = [x["gap_cusum"] for x in out if x is not None]
    low = gaps.index(min(gaps))
    assert 20 < low < 35 and all(c == 0.0 for c in cusum[:low + 1])  # while the gap falls: nothing
    assert cusum[-1] == pytest.approx(gaps[-1] - min(gaps)) and cusum[-1] > 1.0
    assert gaps[-1] < 0  # audit_gap is still below the start's: only the drift statistic sees the turn
    assert out[-1]["gap_trend"] == pytest.approx(0.1 * 3)  # the last L steps: the proxy alone climbs



def test_a_resumed_run_goes_on_with_the_detector_it_started_with(tmp_path, capsys):
    """The checkpoint holds the run's detector: resumed after `collapse.detector` came to mean another one (an
    update that changed the default), the run warns as if never killed. A checkpoint of older code (the state
    alone) whose signals the new detector does not all find starts the warning over, and says so."""
    from harness.config import CollapseConfig
    from harness.metrics import Monitor

    def write(name: str, **kw) -> str:
        (tmp_path / name).write_text(json.dumps(dataclasses.asdict(DetectorParams(**kw))))
        return str(tmp_path / name)

    started = write("a.json", features=["audit_peak", "kl"], mean=[0.0, 0.0], scale=[1.0, 1.0], coef=[20.0, 0.0],
                    intercept=-18.0, threshold=0.5, patience=2, window=3, baseline_steps=2)
    now = write("b.json", features=["distinct_1"], mean=[0.0], scale=[1.0], coef=[1.0], intercept=50.0, threshold=0.5,
                patience=1, window=3, baseline_steps=2)  # warns on its first scored step
    rows = [{**m, K.DISTINCT_1: 0.4} for m in stream(80, audit_falls_at=30)]

    def warnings(monitor: Monitor, steps: range) -> list[int]:
        return [s for s in steps if K.WARNING_STEP in monitor.update(s, rows[s - 1])[0]]

    whole = warnings(Monitor(CollapseConfig(detector=started), has_gold=False, has_audit=True), range(1, 81))
    assert len(whole) == 1 and whole[0] > 20
    first = Monitor(CollapseConfig(detector=started), has_gold=False, has_audit=True)
    before = warnings(first, range(1, 21))
    state = json.loads(json.dumps(first.state_dict()))
    resumed = Monitor(CollapseConfig(detector=now), has_gold=False, has_audit=True)
    resumed.load_state_dict(state)
    assert before + warnings(resumed, range(21, 81)) == whole and resumed.detector.params.features == ["audit_peak", "kl"]
    # older code's checkpoint: no detector in it, and its state lacks signal/distinct_1
    del state["detector"]["params"], state["detector"]["threshold"]
    older = Monitor(CollapseConfig(detector=now), has_gold=False, has_audit=True)
    older.load_state_dict(state)
    assert "lacks distinct_1" in capsys.readouterr().err
    assert warnings(older, range(21, 81)) == [20 + 2 + 3]  # started over at step 21: its start and window again

def test_trend_features_are_scale_free_online_and_survive_a_checkpoint():
    rows = trend_stream(50, rm=lambda t: 0.1 * t + 0.01 * (t % 3), audit=lambda t: 0.2 * min(t, 25),
                        dis=lambda t: 0.3 + 0.01 * t, kl=lambda t: 0.002 * t * t)
    whole = trend_features(rows)
    # the same run in other units, with other offsets: the same features
    scaled = [{**m, K.RM_SCORE: 5 * m[K.RM_SCORE] + 7, K.RM_SCORE_STD: 5 * m[K.RM_SCORE_STD],
               K.AUDIT_MEAN: 3 * m[K.AUDIT_MEAN] - 1, K.AUDIT_STD: 3 * m[K.AUDIT_STD],
               K.AUDIT_DISAGREEMENT: 4 * m[K.AUDIT_DISAGREEMENT], K.KL_K3: 2 * m[K.KL_K3], K.ENTROPY: 2 * m[K.ENTROPY]}
              for m in rows]
    for x, y in zip(whole[5:], trend_features(scaled)[5:]):
        assert all(math.isclose(x[k], y[k], rel_tol=1e-9, abs_tol=1e-9) for k in TREND), (x, y)
    # online: a step's features do not change with what comes after it
    assert trend_features(rows[:30]) == whole[:30]
    # a run killed at step 20 and resumed from its checkpoint goes on as if never killed
    first = Features(3, 2, TREND)
    for m in rows[:20]:
        first.update(m)
    resumed = Features(3, 2, TREND)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [resumed.update(m) for m in rows[20:]] == whole[20:]


def test_trend_features_need_the_audit_rms_where_they_read_them():
    assert set(family_features(["trend"])) == set(TREND) == {"gap_trend", "gap_cusum", "audit_dis_trend", "kl_curvature"}
    assert reads_audit(["gap_trend"]) and reads_audit(family_features(["base", "trend"]))
    assert not reads_audit(["kl_curvature"]) and not reads_audit(BASE_FEATURES)
    p = DetectorParams(features=["gap_cusum"], mean=[0.0], scale=[1.0], coef=[1.0], intercept=0.0, threshold=0.5)
    assert needs_audit(p) and not needs_audit(dataclasses.replace(p, features=["kl_curvature"]))
    with pytest.raises(KeyError, match="audit/disagreement"):
        Features(3, 2, ["audit_dis_trend"]).update({k: v for k, v in stream(1)[0].items() if k != K.AUDIT_DISAGREEMENT})


def test_the_default_family_ablation_leaves_the_trend_family_out():
    """Measured, not adopted (bench/RESULTS.md session 16): the default sets, and so the detector they
    choose, are session 15's; `families --trend` adds the trend sets."""
    from analysis import detector as D

    assert not any("trend" in fams for fams in D.FAMILY_SETS.values())
    assert D.FAMILY_SETS["every family"] == ("base", "diversity", "audit", "forecast")
    assert all("trend" in fams for fams in D.TREND_SETS.values())
    args = D.build_parser().parse_args(["families", "--trend"])
    assert args.trend and not D.build_parser().parse_args(["families"]).trend


def test_a_detector_on_the_forecast_warns_when_the_held_out_reward_turns(tmp_path):
    p = DetectorParams(features=["audit_peak"], mean=[0.0], scale=[1.0], coef=[20.0], intercept=-18.0, threshold=0.5,
                       patience=2, window=3, baseline_steps=2)  # warns once d / d* reaches 0.9
    assert needs_audit(p) and not needs_audit(dataclasses.replace(p, features=["kl"]))
    _, alert = replay(p, list(enumerate(stream(80, audit_falls_at=30), 1)))
    assert alert is not None and alert.step < 80
    _, never = replay(p, list(enumerate(stream(80), 1)))  # the held-out reward rises throughout
    assert never is None


# ------------------------------------------------------------------ the world's audit RMs and a run that logs them
def test_audit_rms_beside_the_world_leave_it_unchanged_and_runs_log_their_opinion(tiny_world, tmp_path):
    import shutil

    from harness.world.audit import audit_dir, ensure_audit, member_dirs
    from harness.world.shipped import content_hash

    world = shutil.copytree(tiny_world, tmp_path / "world")  # the session's world stays without audit RMs
    before = content_hash(world)
    assert member_dirs(world) == []
    dirs = ensure_audit(world, 2, progress=False)
    assert len(dirs) == 2 and dirs == member_dirs(world) and audit_dir(world) not in Path(world).parents
    assert content_hash(world) == before  # the world the reference ran on is untouched
    assert ensure_audit(world, 2, progress=False) == dirs  # cached
    cfg = load_config(None, fast_overrides(world, tmp_path, **{"ppo.steps": 3}))
    res = train(cfg)
    assert res.status == "FINISHED", res.error
    m = tracking.client(cfg.logging.tracking_uri).get_run(res.run_id).data.metrics
    for k in (K.AUDIT_MEAN, K.AUDIT_STD, K.AUDIT_GAP, K.AUDIT_DISAGREEMENT, K.AUDIT_MEMBER.format(k=1), K.DISTINCT_1,
              K.DISTINCT_2, K.REPEATED_2GRAM):
        assert k in m, k
    assert 0 < m[K.DISTINCT_1] <= 1
    none = load_config(None, fast_overrides(world, tmp_path / "b", **{"ppo.steps": 2,
                                                                            "model.audit_reward_paths": "none"}))
    res = train(none)
    assert res.status == "FINISHED" and K.AUDIT_MEAN not in tracking.client(
        none.logging.tracking_uri).get_run(res.run_id).data.metrics


# ------------------------------------------------------------------ acting on the warning
def always_warns(path: Path) -> str:
    """A detector whose score is 0.993 from its first window on (warns at step 5 + 10 + 2 = 17)."""
    path.write_text(json.dumps(dataclasses.asdict(DetectorParams(
        features=["kl"], mean=[0.0], scale=[1.0], coef=[0.0], intercept=5.0, threshold=0.5))))
    return str(path)


@pytest.mark.parametrize("action", ["stop", "raise_kl", "rollback"])
def test_each_action_acts_once_on_the_warning_step(tiny_world, tmp_path, action):
    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **{
        "ppo.steps": 20, "logging.eval_every": 0, "logging.sample_every": 0, "logging.checkpoint_every": 0,
        "model.audit_reward_paths": "none", "ppo.kl_coef": 0.02, "collapse.on_warning": action,
        "collapse.rollback_steps": 5, "collapse.detector": always_warns(tmp_path / "d.json")}))
    res = train(cfg)
    assert res.status == "FINISHED", res.error
    c = tracking.client(cfg.logging.tracking_uri)
    tags = c.get_run(res.run_id).data.tags
    assert tags[K.TAG_WARNING_ACTION] == action
    assert tags[K.TAG_DETECTOR] == fingerprint(load_params(cfg.collapse.detector))  # the detector it ran with
    assert [(m.step, m.value) for m in c.get_metric_history(res.run_id, K.ACTION_STEP)] == [(17, 17.0)]
    eta = dict((m.step, m.value) for m in c.get_metric_history(res.run_id, K.KL_COEF))
    if action == "stop":
        assert res.steps_done == 17 and tags[K.TAG_STOPPED] == "warning"
    else:
        assert res.steps_done == 20 and eta[17] == 0.02 and eta[18] == pytest.approx(0.05)  # max(0.02 * 2, 0.05)


def test_a_rollback_restores_the_policy_of_the_snapshot(tiny_world, tmp_path):
    """The weights after a rollback at the warning are those of the snapshot, not the warned step's."""
    from harness.train import warning_action

    class Stub:  # the two things warning_action touches
        def __init__(self):
            self.restored = None
            self.kl_ctl = type("K", (), {"value": 0.0})()

        def restore_models(self, s):
            self.restored = s

    from collections import deque

    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **{"collapse.warning_kl_min": 0.1}))
    t = Stub()
    warning_action(t, cfg.collapse, deque([(10, "snapshot at 10"), (15, "snapshot at 15")], maxlen=2))
    assert t.restored == "snapshot at 10" and t.kl_ctl.value == 0.1


# ------------------------------------------------------------------ bad input, before any run exists
def test_bad_input_is_refused_before_a_run_exists(tiny_world, tmp_path):
    store = tmp_path / "m.db"

    def refused(over: dict, match: str) -> None:
        cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **{"logging.tracking_uri": sqlite_uri(store), **over}))
        with pytest.raises(ConfigError, match=match):
            train(cfg)
        assert not store.exists()

    refused({"model.audit_reward_paths": f"[{tmp_path}/nope/]"}, r"model\.audit_reward_paths\[0\]: .*nope/")
    audit_file = tmp_path / "audit_detector.json"
    audit_file.write_text(json.dumps(dataclasses.asdict(DetectorParams(
        features=["audit_gain"], mean=[0.0], scale=[1.0], coef=[1.0], intercept=0.0, threshold=0.5))))
    refused({"model.audit_reward_paths": "none", "collapse.detector": str(audit_file)},
            r"collapse\.detector: .* reads the audit reward models' signals")
    with pytest.raises(ConfigError, match=r"collapse\.on_warning: got 'stop' .*allowed: none"):
        load_config(None, fast_overrides(tiny_world, tmp_path, **{"collapse.on_warning": "stop", "collapse.detector": "off"}))
    with pytest.raises(ConfigError, match=r"model\.audit_reward_paths: got 'world' with data\.source='hh_rlhf'"):
        load_config(None, fast_overrides(tiny_world, tmp_path, **{"model.audit_reward_paths": "world",
                                                                  "data.source": "hh_rlhf", "data.hh_path": str(HH)}))
    with pytest.raises(ConfigError, match=r"collapse\.warning_kl_factor"):
        load_config(None, fast_overrides(tiny_world, tmp_path, **{"collapse.warning_kl_factor": 0.5}))


@needs_shared
def test_an_audit_rm_on_hh_rlhf_with_tiny_hf_models(tmp_path):
    """The HH-RLHF path with an audit RM from a local folder; one with two labels, or another vocabulary, is refused."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    tok = hh_tokenizer(200, 400)
    torch.manual_seed(0)

    def save(name: str, cls, vocab: int = len(tok), labels: int = 1) -> str:
        c = GPT2Config(vocab_size=vocab, n_positions=96, n_embd=16, n_layer=1, n_head=2, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id, num_labels=labels)
        cls(c).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    sft, rm, audit = save("sft", GPT2LMHeadModel), save("rm", GPT2ForSequenceClassification), save("audit", GPT2ForSequenceClassification)
    two, other = save("two", GPT2ForSequenceClassification, labels=2), save("other", GPT2ForSequenceClassification, vocab=50)

    def cfg(paths: str):
        return load_config(None, [f"{k}={v}" for k, v in {
            "data.source": "hh_rlhf", "data.hh_path": str(HH), "data.max_prompt_tokens": 32, "data.eval_prompts": 0,
            "model.sft_path": sft, "model.reward_path": rm, "model.critic_init": "reward", "model.audit_reward_paths": paths,
            "ppo.steps": 2, "ppo.rollout_batch_size": 4, "ppo.ppo_epochs": 1, "generation.max_new_tokens": 4,
            "logging.tracking_uri": sqlite_uri(tmp_path / "m.db"), "logging.output_dir": str(tmp_path / "runs"),
            "logging.progress": False, "logging.eval_every": 0, "threads": 1}.items()])

    res = train(cfg(f"[{audit},{audit}]"))
    assert res.status == "FINISHED", res.error
    m = tracking.client(sqlite_uri(tmp_path / "m.db")).get_run(res.run_id).data.metrics
    assert K.AUDIT_MEAN in m and m[K.AUDIT_DISAGREEMENT] == 0.0  # one model twice: no disagreement
    with pytest.raises(ConfigError, match=r"audit_reward_paths\[0\]: .* has 2 labels"):
        train(cfg(f"[{two}]"))
    with pytest.raises(ConfigError, match="vocabularies differ"):
        train(cfg(f"[{other}]"))
    assert set(FEATURES) >= {"audit_gain", "distinct_1", "audit_peak"}


def test_a_resumed_run_warns_and_acts_once(tmp_path):
    """The monitor's state (features, the forecast's sums, the warning) travels in the checkpoint: a run
    killed after its warning and resumed from there logs no second warning (so no second action), and one
    killed before it warns on the same step as if never killed."""
    from harness.config import CollapseConfig
    from harness.metrics import Monitor

    detector = tmp_path / "d.json"
    detector.write_text(json.dumps(dataclasses.asdict(DetectorParams(
        features=["audit_peak", "kl"], mean=[0.0, 0.0], scale=[1.0, 1.0], coef=[20.0, 0.0], intercept=-18.0,
        threshold=0.5, patience=2, window=3, baseline_steps=2))))
    cfg = CollapseConfig(detector=str(detector))
    rows = stream(80, audit_falls_at=30)

    def warnings(monitor: Monitor, steps: range) -> list[int]:
        return [s for s in steps if K.WARNING_STEP in monitor.update(s, rows[s - 1])[0]]

    whole = warnings(Monitor(cfg, has_gold=False, has_audit=True), range(1, 81))
    assert len(whole) == 1
    for cut in (whole[0] - 5, whole[0] + 5):
        first = Monitor(cfg, has_gold=False, has_audit=True)
        before = warnings(first, range(1, cut + 1))
        resumed = Monitor(cfg, has_gold=False, has_audit=True)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert before + warnings(resumed, range(cut + 1, 81)) == whole
