"""What "collapsed" means: the gold truth (harness.metrics.GoldTruth) and the indicator rule."""
from harness import keys
from harness.config import CollapseConfig
from harness.metrics import GoldTruth, IndicatorRule, IndicatorThresholds, Monitor, gold_onset


def healthy(gold=0.5):
    return {keys.KL: 0.3, keys.PPL: 3.0, keys.FRAC_AT_CAP: 0.1, keys.GOLD_SCORE: gold}


def test_healthy_run_never_trips_the_indicator_rule():
    d = IndicatorRule(IndicatorThresholds(patience=3))
    for s in range(1, 50):
        _, ev = d.update(s, healthy(0.5 + 0.01 * s))
        assert ev is None


def test_pattern_collapse_detected_at_start_of_streak():
    d = IndicatorRule(IndicatorThresholds(patience=3, smoothing=0.0))
    for s in range(1, 6):
        assert d.update(s, healthy())[1] is None
    bad = {keys.KL: 5.0, keys.PPL: 1.05, keys.FRAC_AT_CAP: 1.0, keys.GOLD_SCORE: 0.4}
    events = [d.update(s, bad)[1] for s in range(6, 10)]
    assert events[0] is None and events[1] is None
    assert events[2] is not None and events[2].step == 6
    assert "KL" in events[2].reason and "perplexity" in events[2].reason
    assert events[3] is None  # reported once


def test_single_generic_signal_is_not_enough():
    d = IndicatorRule(IndicatorThresholds(patience=2, smoothing=0.0))
    for s in range(1, 10):  # long responses alone: not collapse
        assert d.update(s, {keys.KL: 0.1, keys.PPL: 3.0, keys.FRAC_AT_CAP: 1.0})[1] is None


TRUTH = CollapseConfig(baseline_steps=2, window=2, margin=0.5, confirm=3, detector="off")


def onset(gold):
    return gold_onset(TRUTH, list(enumerate(gold, 1)))


def test_gold_onset_is_the_first_step_of_a_confirmed_fall_below_the_start():
    # start 0 (steps 1-2); trailing means (window 2) from step 3: 0, -0.5, -1, -1, -1: below -0.5 from step 5
    assert onset([0, 0, 0, -1, -1, -1, -1]) == 5
    assert onset([0, 0, 0, -1, -1, -1]) is None  # below for 2 steps only: not confirmed yet


def test_an_early_dip_that_recovers_or_a_fall_from_a_peak_above_the_start_is_no_collapse():
    assert onset([0, 0, -2, -2, 1, 1, 1, 1, 1]) is None  # below for 2 steps (means -1, -2), then recovers
    assert onset([0, 0, 2, 2, 2, 2, 0.2, 0.2, 0.2, 0.2]) is None  # fell 1.8 from its peak, still above its start


def test_the_noise_of_the_first_steps_is_not_a_fall():
    """The old rule (EMA from step 1 against the mean of the first 10%) marked runs whose gold rose
    as fallen at step 1; here a rise never counts."""
    rising = [-0.5, -0.6, -0.4, -0.55] + [-0.5 + 0.02 * s for s in range(60)]
    assert gold_onset(CollapseConfig(), list(enumerate(rising, 1))) is None


def test_truth_state_roundtrip_and_the_monitor_logs_the_onset_once():
    gold = [0, 0, 0, -1, -1, -1, -1, -1]
    a = GoldTruth(TRUTH)
    for s, g in enumerate(gold[:4], 1):
        a.update(s, g)
    b = GoldTruth(TRUTH)
    b.load_state_dict(a.state_dict())
    events = [b.update(s, g) for s, g in enumerate(gold[4:], 5)]
    assert [e and e.step for e in events] == [None, None, 5, None]
    m = Monitor(TRUTH, has_gold=True)
    logged = [m.update(s, healthy(g))[0] for s, g in enumerate(gold, 1)]
    assert [x.get(keys.GOLD_ONSET) for x in logged] == [None] * 6 + [5, None]
    assert [x.get(keys.COLLAPSE_STEP) for x in logged] == [None] * 6 + [5, None]
    assert m.event.step == 5 and "gold" in m.event.reason


def test_without_gold_the_detectors_warning_is_the_flag(detector_file):
    from helpers import collapsing_stream

    m = Monitor(CollapseConfig(detector=str(detector_file)), has_gold=False)
    out = [m.update(s, x) for s, x in enumerate(collapsing_stream(60, at=30), 1)]
    warned = [(s, o[0][keys.WARNING_STEP]) for s, o in enumerate(out, 1) if keys.WARNING_STEP in o[0]]
    flagged = [(s, o[1].step) for s, o in enumerate(out, 1) if o[1] is not None]
    assert len(warned) == 1 and flagged == warned and warned[0][0] == warned[0][1]  # once, when it is raised
    assert all(keys.GOLD_ONSET not in o[0] for o in out) and "detector" in m.event.reason
    assert all(keys.WARNING in o[0] for o in out[15:])  # a score on every step after the first full window


# -- real tiny-world runs: the rule replayed offline, and the best policy before collapse ----------
import pytest  # noqa: E402
import torch  # noqa: E402

from analysis import detector as detector_eval  # noqa: E402
from harness import tracking  # noqa: E402
from harness.config import load_config  # noqa: E402
from harness.detector import SIGNALS, load_params  # noqa: E402
from harness.detector import replay as detector_replay  # noqa: E402
from harness.train import BEST_POLICY, train  # noqa: E402

from helpers import (
    fast_overrides,  # noqa: E402
    write_detector,  # noqa: E402
)

# the gold truth marks every step after the first as fallen (a margin of -100: "did not rise by 100"),
# so the run is collapsed at step 2
COLLAPSING = {"collapse.baseline_steps": 1, "collapse.window": 1, "collapse.confirm": 1, "collapse.margin": -100}


@pytest.fixture(scope="module", params=["healthy", "collapsing"])
def tiny_run(request, tiny_world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    cfg = load_config(None, fast_overrides(tiny_world, tmp, **(COLLAPSING if request.param == "collapsing" else {}),
                                           **{"ppo.steps": 20, "collapse.detector": write_detector(tmp / "d.json")}))
    res = train(cfg)
    assert res.status == "FINISHED" and res.collapsed == (request.param == "collapsing"), res.error
    return cfg, res


def test_offline_replay_of_logged_rows_finds_what_the_trainer_did(tiny_run):
    cfg, res = tiny_run
    uri = cfg.logging.tracking_uri
    keys_needed = [keys.GOLD_SCORE]
    rows: dict[int, dict] = {}
    for k in keys_needed:
        for step, v in tracking.metric_history(uri, res.run_id, k):
            rows.setdefault(step, {})[k] = v
    rows = sorted(rows.items())
    # the flag on the world is the gold truth: the same onset replayed from the logged gold
    onset = gold_onset(cfg.collapse, [(s, m[keys.GOLD_SCORE]) for s, m in rows])
    logged = {k: [(s, int(v)) for s, v in tracking.metric_history(uri, res.run_id, k)]
              for k in (keys.COLLAPSE_STEP, keys.GOLD_ONSET)}
    assert (onset is None) == (not res.collapsed)
    assert logged[keys.COLLAPSE_STEP] == logged[keys.GOLD_ONSET] == ([] if onset is None else [(onset, onset)])
    # the detector replayed over the logged rows gives the scores and the warning the trainer logged
    full: dict[int, dict] = {}
    for k in set(SIGNALS.values()):
        for step, v in tracking.metric_history(uri, res.run_id, k):
            full.setdefault(step, {})[k] = v
    scores, alert = detector_replay(load_params(cfg.collapse.detector), sorted(full.items()))
    logged_scores = sorted(tracking.metric_history(uri, res.run_id, keys.WARNING))
    assert len(scores) == len(logged_scores) == 20 - 14 and all(
        a == b and abs(x - y) < 1e-9 for (a, x), (b, y) in zip(scores, logged_scores))
    warned = tracking.metric_history(uri, res.run_id, keys.WARNING_STEP)
    assert warned == ([] if alert is None else [(alert.step, alert.step)])
    # the detector's evaluation reads the same truth back from the store (the run's own collapse params)
    (loaded,) = [r for r in detector_eval.load_runs(uri) if r.run_id == res.run_id]
    assert loaded.onset == onset


def test_best_policy_is_the_best_eval_before_collapse(tiny_run):
    cfg, res = tiny_run
    uri, run_dir = cfg.logging.tracking_uri, res.run_dir
    tag = tracking.client(uri).get_run(res.run_id).data.tags[keys.TAG_BEST_STEP]
    gold = dict(tracking.metric_history(uri, res.run_id, keys.EVAL_GOLD))  # evals at steps 0, 2, 4
    if res.collapsed:  # the rule fired at step 1 or 2, before the eval of step 2: the SFT model (step 0) is best
        assert res.collapse_step <= 2 and tag == "0"
    else:
        assert int(tag) == max(gold, key=lambda s: (gold[s], -s))
    weights = torch.load(f"{run_dir}/{BEST_POLICY}", weights_only=True)
    assert weights.keys() == torch.load(f"{run_dir}/ckpt/state.pt", weights_only=True)["policy"].keys()
