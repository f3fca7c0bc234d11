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
