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
    from test_detector import collapsing_stream

    m = Monitor(CollapseConfig(detector=str(detector_file)), has_gold=False)
    out = [m.update(s, x) for s, x in enumerate(collapsing_stream(60, at=30), 1)]
    warned = [(s, o[0][keys.WARNING_STEP]) for s, o in enumerate(out, 1) if keys.WARNING_STEP in o[0]]
    flagged = [(s, o[1].step) for s, o in enumerate(out, 1) if o[1] is not None]
    assert len(warned) == 1 and flagged == warned and warned[0][0] == warned[0][1]  # once, when it is raised
    assert all(keys.GOLD_ONSET not in o[0] for o in out) and "detector" in m.event.reason
    assert all(keys.WARNING in o[0] for o in out[15:])  # a score on every step after the first full window


# -- real tiny-world runs: the rule replayed offline, and the best policy before collapse ----------
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from harness import tracking  # noqa: E402
from harness.config import load_config  # noqa: E402
from harness.detector import SIGNALS, load_params  # noqa: E402
from harness.detector import replay as detector_replay  # noqa: E402
from harness.train import BEST_POLICY, train  # noqa: E402
from conftest import fast_overrides  # noqa: E402
from test_detector import write_detector  # noqa: E402

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
    table = collapse_rule.run_table(uri).set_index("run_id").loc[res.run_id]
    assert (pd.isna(table["gold_fell"]) and onset is None) or table["gold_fell"] == onset


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


# -- the rule scored against gold (analysis.collapse_rule) on a synthetic store ---------------------
from analysis import collapse_rule  # noqa: E402
from analysis.synthetic import Curve, write_ablation  # noqa: E402

CURRENT, TOKENS = collapse_rule.RULES


def test_lead_misses_and_false_alarms_on_a_synthetic_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 's.db'}"
    write_ablation(uri, "rule", "4", {
        "healthy": Curve(),
        "collapses": Curve(collapse_at=30),  # gold falls fast: both rules fire, gold falls
        "gold holds": Curve(collapse_at=30, gold_fall=0.0),  # indicators collapse, gold does not: false alarm
        # gold sinks slowly; per-sample perplexity spikes hide the fall: only the token-pooled rule sees
        # perplexity and length together
        "spiky": Curve(reward_slope=0.0, kl_slope=0.0, collapse_at=30, gold_fall=0.03, ppl_spikes=True),
    }, seeds=[0], steps=70, sample_every=0)
    t = collapse_rule.run_table(uri).set_index("variant")
    assert t.loc["healthy", ["gold_fell", CURRENT, TOKENS]].isna().all()
    assert t.loc["collapses", ["gold_fell", CURRENT, TOKENS]].notna().all()
    assert t.loc["gold holds", "gold_fell"] != t.loc["gold holds", "gold_fell"]  # NaN: never fell
    assert t.loc["gold holds", [CURRENT, TOKENS]].notna().all()
    assert pd.isna(t.loc["spiky", CURRENT]) and t.loc["spiky", ["gold_fell", TOKENS]].notna().all()
    s = collapse_rule.score(t.reset_index())
    assert (s[CURRENT]["misses"], s[CURRENT]["false alarms"], s[CURRENT]["hits"]) == (1, 1, 1)
    assert (s[TOKENS]["misses"], s[TOKENS]["false alarms"], s[TOKENS]["hits"]) == (0, 1, 2)
    lead = t.loc["collapses", "gold_fell"] - t.loc["collapses", CURRENT]
    assert s[CURRENT]["lead median"] == s[CURRENT]["lead min"] == lead
    assert collapse_rule.better(s) == TOKENS
    s[TOKENS]["misses"] = 1  # equal errors and lead: no choice
    s[TOKENS]["lead median"] = s[CURRENT]["lead median"]
    assert collapse_rule.better(s) is None


def test_only_finished_runs_are_scored_against_the_starts_gold(tmp_path):
    """A run in flight is not scored (its gold may yet fall); the baseline is the run's own early
    per-step gold, not the eval gold at step 0 (other prompts, another level)."""
    uri = f"sqlite:///{tmp_path / 's.db'}"
    write_ablation(uri, "rule", "4", {"healthy": Curve()}, seeds=[0], steps=40, sample_every=0)
    (rid,) = collapse_rule.run_table(uri)["run_id"]
    tracking.MetricLogger(uri, rid).log({keys.EVAL_GOLD: 5.0}, step=0)  # far above every training-prompt gold
    assert pd.isna(collapse_rule.run_table(uri).set_index("run_id").loc[rid, "gold_fell"])
    tracking.reopen_run(uri, rid)
    assert collapse_rule.run_table(uri).empty
