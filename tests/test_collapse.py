"""The collapse rule fires on the paper's pattern and not on a healthy run."""
from harness import keys
from harness.config import CollapseConfig
from harness.metrics import CollapseDetector


def healthy(gold=0.5):
    return {keys.KL: 0.3, keys.PPL: 3.0, keys.FRAC_AT_CAP: 0.1, keys.GOLD_SCORE: gold}


def test_healthy_run_never_collapses():
    d = CollapseDetector(CollapseConfig(patience=3))
    for s in range(1, 50):
        _, ev = d.update(s, healthy(0.5 + 0.01 * s))
        assert ev is None


def test_pattern_collapse_detected_at_start_of_streak():
    d = CollapseDetector(CollapseConfig(patience=3, smoothing=0.0))
    for s in range(1, 6):
        assert d.update(s, healthy())[1] is None
    bad = {keys.KL: 5.0, keys.PPL: 1.05, keys.FRAC_AT_CAP: 1.0, keys.GOLD_SCORE: 0.4}
    events = [d.update(s, bad)[1] for s in range(6, 10)]
    assert events[0] is None and events[1] is None
    assert events[2] is not None and events[2].step == 6
    assert "KL" in events[2].reason and "perplexity" in events[2].reason
    assert events[3] is None  # reported once


def test_single_generic_signal_is_not_enough_but_gold_fall_is():
    d = CollapseDetector(CollapseConfig(patience=2, smoothing=0.0))
    for s in range(1, 10):  # long responses alone: not collapse
        assert d.update(s, {keys.KL: 0.1, keys.PPL: 3.0, keys.FRAC_AT_CAP: 1.0})[1] is None
    d = CollapseDetector(CollapseConfig(patience=2, smoothing=0.0, gold_drop=0.5))
    d.update(1, healthy(1.0))
    d.update(2, healthy(0.2))
    _, ev = d.update(3, healthy(0.1))
    assert ev is not None and ev.step == 2 and "gold reward" in ev.reason


def test_detector_state_roundtrip():
    d = CollapseDetector(CollapseConfig(patience=2, smoothing=0.0))
    d.update(1, healthy(1.0))
    d.update(2, healthy(0.2))
    e = CollapseDetector(CollapseConfig(patience=2, smoothing=0.0))
    e.load_state_dict(d.state_dict())
    assert e.update(3, healthy(0.1))[1].step == 2


# -- real tiny-world runs: the rule replayed offline, and the best policy before collapse ----------
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from harness import tracking  # noqa: E402
from harness.config import load_config  # noqa: E402
from harness.metrics import replay  # noqa: E402
from harness.train import BEST_POLICY, train  # noqa: E402
from conftest import fast_overrides  # noqa: E402

# every step collapsing from the first: perplexity below 100 and KL above 1e-9 (two generic signals)
COLLAPSING = {"collapse.patience": 1, "collapse.smoothing": 0.0, "collapse.ppl_min": 100, "collapse.kl_max": 1e-9}


@pytest.fixture(scope="module", params=["healthy", "collapsing"])
def tiny_run(request, tiny_world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    cfg = load_config(None, fast_overrides(tiny_world, tmp, **(COLLAPSING if request.param == "collapsing" else {})))
    res = train(cfg)
    assert res.status == "FINISHED" and res.collapsed == (request.param == "collapsing"), res.error
    return cfg, res


def test_offline_replay_of_logged_rows_fires_where_the_trainer_did(tiny_run):
    cfg, res = tiny_run
    uri = cfg.logging.tracking_uri
    keys_needed = [keys.KL, keys.PPL, keys.FRAC_AT_CAP, keys.GOLD_SCORE]
    rows: dict[int, dict] = {}
    for k in keys_needed:
        for step, v in tracking.metric_history(uri, res.run_id, k):
            rows.setdefault(step, {})[k] = v
    event = replay(cfg.collapse, sorted(rows.items()))
    logged = tracking.metric_history(uri, res.run_id, keys.COLLAPSE_STEP)
    assert (event is None) == (not res.collapsed) and (event is None or [(event.step, event.step)] ==
                                                       [(s, int(v)) for s, v in logged])
    # the scoring reads the run's own collapse settings back from its params (kl_max 1e-09 is no YAML 1.1 float)
    fired = collapse_rule.run_table(uri).set_index("run_id").loc[res.run_id, CURRENT]
    assert (pd.isna(fired) and event is None) or fired == event.step


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


def test_gold_fall_is_the_first_step_of_the_ema_streak_below_sft():
    cfg = CollapseConfig(smoothing=0.5, patience=2)
    # EMA 1, 1, 0, -0.5, -0.75: below 0 from step 4 (0 itself is not below)
    assert collapse_rule.gold_fall(list(enumerate([1, 1, -1, -1, -1], 1)), 0.0, cfg) == 4
    assert collapse_rule.gold_fall(list(enumerate([1, -1, 1, -1], 1)), 0.0, cfg) is None


def test_lead_misses_and_false_alarms_on_a_synthetic_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 's.db'}"
    write_ablation(uri, "rule", "4", {
        "healthy": Curve(),
        "collapses": Curve(collapse_at=30),  # gold falls fast: both rules fire, gold falls
        "gold holds": Curve(collapse_at=30, gold_fall=0.0),  # indicators collapse, gold does not: false alarm
        # gold sinks slowly (never 0.5 below its best); per-sample perplexity spikes hide the fall: only the
        # token-pooled rule sees perplexity and length together
        "spiky": Curve(reward_slope=0.0, kl_slope=0.0, collapse_at=30, gold_fall=0.01, ppl_spikes=True),
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
