"""The verdict statistics (analysis/stats.py) on cases with known answers."""
import math

import numpy as np
import pytest

from analysis.stats import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    censor,
    compare,
    compare_strata,
    compare_to,
    hedges_g,
    min_detectable,
    proportion_ci,
    rate_vs_half,
)


def test_permutation_p_value_is_the_exact_count():
    # 5 vs 5 seeds: 252 relabellings; |diff| >= 4 happens for the observed split, its mirror and
    # the two splits that swap one extreme (hand count) -> p = 4/252
    c = compare([5, 6, 7, 8, 9], [1, 2, 3, 4, 5], expect="greater")
    assert c.p_value == pytest.approx(4 / 252)
    assert c.estimate == 4
    assert c.verdict == REPRODUCED
    assert c.ci_low > 0 and c.ci_low < 4 < c.ci_high
    assert compare([1, 2, 3, 4, 5], [5, 6, 7, 8, 9], expect="greater").verdict == NOT_REPRODUCED


def test_interval_and_p_value_agree():
    rng = np.random.default_rng(3)
    for _ in range(40):
        a, b = rng.normal(0.5, 1, 6), rng.normal(0, 1, 6)
        c = compare(a, b)
        assert (c.ci_low <= 0 <= c.ci_high) == (c.p_value > 0.05) or math.isclose(c.p_value, 0.05)
        assert c.ci_low <= c.estimate <= c.ci_high


def test_identical_distributions_are_inconclusive_at_the_stated_rate():
    rng = np.random.default_rng(0)
    trials = 300
    decided = sum(compare(rng.normal(size=5), rng.normal(size=5)).verdict != INCONCLUSIVE for _ in range(trials))
    # exact permutation test at alpha = 0.05: about 5% false decisions (binomial sd ~1.3%)
    assert decided / trials <= 0.08


def test_fewer_than_five_seeds_never_decide():
    assert compare([10, 11, 12], [0, 1, 2]).verdict == INCONCLUSIVE
    assert compare_to([10, 11, 12, 13], 0.0).verdict == INCONCLUSIVE


def test_one_sample_t_interval_by_hand():
    c = compare_to([1, 2, 3, 4, 5], 0.0)
    half = 2.7764451051977987 * math.sqrt(2.5) / math.sqrt(5)  # t(0.975, 4) * sd / sqrt(n)
    assert (c.ci_low, c.ci_high) == pytest.approx((3 - half, 3 + half))
    assert c.verdict == REPRODUCED
    assert compare_to([1, 2, 3, 4, 5], 3.0, expect="greater").verdict == INCONCLUSIVE


def test_effect_size_power_and_censoring():
    assert hedges_g(np.array([2.0, 4.0]), np.array([0.0, 2.0])) == pytest.approx(math.sqrt(2) * (1 - 3 / 7))
    # (z_0.975 + z_0.8) * sd * sqrt(2/n) for n = 5 per arm, sd 1
    assert min_detectable(1.0, 5, 5) == pytest.approx((1.959964 + 0.841621) * math.sqrt(0.4), rel=1e-5)
    assert censor([30, None, float("nan"), 500], 120).tolist() == [30, 120, 120, 120]


def test_clopper_pearson():
    lo, hi = proportion_ci(5, 5)
    assert lo == pytest.approx(0.025 ** (1 / 5)) and hi == 1.0
    lo, hi = proportion_ci(0, 5)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 5))


def test_rate_against_one_half_is_the_one_sided_binomial_test():
    c = rate_vs_half(5, 5, "greater", "collapse rate")
    assert c.p_value == pytest.approx(1 / 32) and c.verdict == REPRODUCED and c.estimate == 1.0
    # the interval is at level 0.9, so its lower edge is the one-sided 95% bound
    assert c.ci_low == pytest.approx(0.05 ** (1 / 5)) and c.ci_low > 0.5 and c.level == pytest.approx(0.9)
    assert "decides at ≥ 5/5" in c.test
    assert rate_vs_half(4, 5, "greater").verdict == INCONCLUSIVE  # p = 6/32
    assert rate_vs_half(0, 5, "greater").verdict == NOT_REPRODUCED
    assert rate_vs_half(0, 5, "less").verdict == REPRODUCED
    assert rate_vs_half(3, 3, "greater").verdict == INCONCLUSIVE
    assert "cannot decide with n = 3" in rate_vs_half(3, 3).test


def test_alike_is_equivalence_within_the_margin_tost():
    """Two one-sided tests: the 90% interval within ±margin (reproduced), wholly outside (not), else inconclusive."""
    a, b = [1.0, 1.01, 0.99, 1.02, 0.98], [1.005, 0.995, 1.0, 1.015, 0.985]
    same = compare(a, b, "equal", margin=0.1)
    assert same.verdict == REPRODUCED and same.level == pytest.approx(0.9) and same.margin == 0.1
    assert "TOST" in same.test and "90% CI" in same.test and "margin ±0.1" in same.describe()
    assert -0.1 < same.ci_low < same.ci_high < 0.1
    assert compare(a, b, "equal", margin=0.001).verdict == INCONCLUSIVE  # cannot rule out a difference that small
    # clearly different, beyond the margin: the whole interval above +1
    apart = compare([5, 6, 7, 8, 9], [1, 2, 3, 4, 5], "equal", margin=1)
    assert apart.verdict == NOT_REPRODUCED and apart.ci_low > 1
    # the same samples against a margin wider than the difference: equivalent, TOST p = the one relabelling
    # as extreme as the observed split, in each one-sided test (hand count: 1/252 for both)
    wide = compare([5, 6, 7, 8, 9], [1, 2, 3, 4, 5], "equal", margin=10)
    assert wide.verdict == REPRODUCED and wide.p_value == pytest.approx(1 / 252)


def test_a_small_real_difference_within_the_margin_is_equivalent_with_many_runs():
    """More data narrow the interval: a difference that is real (the interval leaves 0) but within the
    margin is reproduced, where the old rule (not reproduced whenever the 95% interval leaves 0) refuted it."""
    rng = np.random.default_rng(7)
    a, b = rng.normal(1.05, 0.1, 60), rng.normal(1.0, 0.1, 60)
    c = compare(a, b, "equal", margin=0.2)
    assert c.ci_low > 0 and c.verdict == REPRODUCED and c.p_value <= 0.05
    assert compare(a, b, "greater").verdict == REPRODUCED  # the difference itself is there
    # too few runs, or too noisy for this margin: inconclusive
    assert compare(a[:4], b[:4], "equal", margin=0.2).verdict == INCONCLUSIVE
    noisy = compare(rng.normal(1.05, 1.0, 5), rng.normal(1.0, 1.0, 5), "equal", margin=0.2)
    assert noisy.verdict == INCONCLUSIVE and noisy.ci_low < -0.2 and noisy.ci_high > 0.2


def test_tost_interval_is_the_two_sided_one_at_twice_alpha_and_agrees_with_its_p_value():
    """Equal group sizes: the permutation distribution is symmetric, so the one-sided bounds at alpha are the
    two-sided interval at 2 alpha; and the verdict "equivalent" is exactly TOST p <= alpha."""
    rng = np.random.default_rng(11)
    for _ in range(15):
        a, b = rng.normal(0.1, 1, 6), rng.normal(0, 1, 6)
        m = float(rng.uniform(0.5, 3))
        c = compare(a, b, "equal", margin=m)
        two = compare(a, b, "greater", alpha=0.1)
        assert (c.ci_low, c.ci_high) == pytest.approx((two.ci_low, two.ci_high)) and two.level == pytest.approx(0.9)
        assert (c.verdict == REPRODUCED) == (c.p_value <= 0.05)


def test_equivalence_pooled_over_worlds_takes_the_world_offsets_out():
    """Worlds move all their runs alike: stratified by world, a small within-world difference is equivalent;
    the same runs pooled without worlds carry the offsets as noise and cannot tell."""
    rng = np.random.default_rng(5)
    offsets = [0.0, 3.0, -3.0]
    a = [rng.normal(o + 0.02, 0.05, 5) for o in offsets]
    b = [rng.normal(o, 0.05, 5) for o in offsets]
    pooled = compare_strata(a, b, "equal", margin=0.1)
    assert pooled.verdict == REPRODUCED and pooled.level == pytest.approx(0.9) and "stratified" in pooled.test
    assert "TOST" in pooled.test and pooled.margin == 0.1
    assert compare(np.concatenate(a), np.concatenate(b), "equal", margin=0.1).verdict == INCONCLUSIVE
    apart = compare_strata([x + 0.5 for x in a], b, "equal", margin=0.1)
    assert apart.verdict == NOT_REPRODUCED and apart.ci_low > 0.1


def test_equivalence_needs_a_positive_margin():
    for bad in (math.nan, 0.0, -0.1):
        with pytest.raises(ValueError, match="margin > 0"):
            compare([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], "equal", margin=bad)
