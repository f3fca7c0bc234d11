"""The statistics behind every verdict: per-seed summaries in (one number per run,
`harness.summary.reduce_run`), a stated test with an interval out. The tests suit small n:

- two groups (`compare`): exact two-sided permutation test of the difference of means (every
  relabelling up to EXACT_LIMIT, else a seeded Monte-Carlo sample); the interval is the set of
  shifts d for which (a - d) vs b is not rejected (test inversion), so interval and p-value agree;
- one group vs a value (`compare_to`): one-sample t-test and t-interval (an exact sign-flip test
  cannot reject at 0.05 with 5 seeds: its smallest p-value is 2/32);
- a rate vs 1/2 (`rate_vs_half`): exact one-sided binomial test, Clopper-Pearson interval at level
  1 - 2 alpha (beyond 1/2 exactly when the test rejects);
- effect size: Hedges' g = (mean_a - mean_b) / s_pooled * (1 - 3 / (4 (n_a + n_b) - 9));
- power limit (`min_detectable`): (z_{1-alpha/2} + z_power) * sd * sqrt(1/n_a + 1/n_b);
- censored collapse steps (`censor`): min(collapse step, budget), the restricted mean survival
  time (RMST) comparison when every run is censored at the same budget.
Verdicts: reproduced when the interval lies wholly on the claimed side, not reproduced when wholly
on the other, else inconclusive; always inconclusive below MIN_SEEDS values per group.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from scipy.optimize import bisect
from scipy.stats import binomtest
from scipy.stats import t as student_t

ALPHA = 0.05
POWER = 0.8
EXACT_LIMIT = 200_000  # relabellings enumerated exactly up to this many
MC_SAMPLES = 20_000
MIN_SEEDS = 5  # below this a verdict is "inconclusive" whatever the data say

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"


@dataclass(frozen=True)
class Comparison:
    """The outcome of one test, with everything a reviewer asks for."""

    n_a: int
    n_b: int
    """Size of the second group (0: one group against a value)."""
    statistic: str
    """What `estimate` is, in words (e.g. "mean difference")."""
    estimate: float
    ci_low: float
    ci_high: float
    p_value: float
    effect_size: float
    """Hedges' g (two groups), (mean - value) / sd (one group), Cohen's h (a rate vs 1/2)."""
    min_detectable: float
    """Smallest |difference| detectable with 80% power at these n and spread (NaN when unknown)."""
    verdict: str
    test: str
    """The test, in words, for the report."""
    level: float = 1 - ALPHA
    """Confidence level of the interval."""

    @classmethod
    def undecided(cls, n_a: int, statistic: str, test: str, n_b: int = 0) -> "Comparison":
        """No test possible (no data, or too little): every number NaN, inconclusive."""
        return cls(n_a, n_b, statistic, *[math.nan] * 6, INCONCLUSIVE, test)

    def describe(self) -> str:
        n = f"{self.n_a}" + (f" vs {self.n_b}" if self.n_b else "")
        power = f"; below {self.min_detectable:.2g} undetectable" if math.isfinite(self.min_detectable) else ""
        sign = "+" if "mean" in self.statistic else ""  # a difference is signed, a rate is not
        return (f"{self.statistic} {self.estimate:{sign}.3g}, {self.level:.0%} CI [{self.ci_low:.3g}, "
                f"{self.ci_high:.3g}], p = {self.p_value:.2g}, effect {self.effect_size:.2f}, n = {n}{power}")


def _labelings(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Boolean masks (rows) choosing k of n items: all of them, or a seeded sample."""
    if math.comb(n, k) > EXACT_LIMIT:
        return rng.permuted(np.tile(np.arange(n) < k, (MC_SAMPLES, 1)), axis=1)
    idx = np.array(list(itertools.combinations(range(n), k)), dtype=int).reshape(-1, k)
    rows = np.zeros((len(idx), n), dtype=bool)
    rows[np.arange(len(idx))[:, None], idx] = True
    return rows


def _two_sample_p(a: np.ndarray, b: np.ndarray, masks: np.ndarray) -> float:
    pooled = np.concatenate([a, b])
    sums = masks @ pooled
    diffs = sums / len(a) - (pooled.sum() - sums) / len(b)
    observed = a.mean() - b.mean()
    # a small tolerance so that float rounding never splits ties
    return float(np.mean(np.abs(diffs) >= abs(observed) - 1e-12 * max(1.0, abs(observed))))


def _invert(p_at, center: float, scale: float, alpha: float) -> tuple[float, float]:
    """Interval of shifts d with p_at(d) > alpha: on each side of `center`, double the step until the
    test rejects, then bisect for the edge (+1 inside, -1 outside)."""
    def edge(direction: float) -> float:
        step = max(scale, 1e-12)
        for _ in range(60):
            if p_at(center + direction * step) <= alpha:
                inside = lambda d: 1.0 if p_at(center + direction * d) > alpha else -1.0  # noqa: E731
                return center + direction * bisect(inside, 0.0, step, xtol=1e-12 * step)
            step *= 2
        return direction * math.inf
    return edge(-1.0), edge(1.0)


def _pooled_sd(a: np.ndarray, b: np.ndarray) -> float:
    """sqrt(((n_a - 1) s_a^2 + (n_b - 1) s_b^2) / (n_a + n_b - 2)); NaN below 2 values in a group."""
    if len(a) < 2 or len(b) < 2:
        return math.nan
    return math.sqrt(((len(a) - 1) * a.var(ddof=1) + (len(b) - 1) * b.var(ddof=1)) / (len(a) + len(b) - 2))


def hedges_g(a: np.ndarray, b: np.ndarray) -> float:
    sp, diff = _pooled_sd(a, b), a.mean() - b.mean()
    if sp == 0:
        return math.copysign(math.inf, diff) if diff else 0.0
    return diff / sp * (1 - 3 / (4 * (len(a) + len(b)) - 9))


def min_detectable(sd: float, n_a: int, n_b: int | None = None, alpha: float = ALPHA, power: float = POWER) -> float:
    """Smallest true difference a two-sided level-alpha test finds with the given power."""
    if not math.isfinite(sd) or n_a < 2:
        return math.nan
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return z * sd * math.sqrt(1 / n_a + (1 / n_b if n_b else 0.0))


def _verdict(lo: float, hi: float, expect: str, n_min: int, margin: float = math.nan) -> str:
    if n_min < MIN_SEEDS:
        return INCONCLUSIVE
    if expect == "greater":
        return REPRODUCED if lo > 0 else NOT_REPRODUCED if hi < 0 else INCONCLUSIVE
    if expect == "less":
        return REPRODUCED if hi < 0 else NOT_REPRODUCED if lo > 0 else INCONCLUSIVE
    if expect == "equal":  # alike: no difference found, and the interval rules out any beyond the margin
        return NOT_REPRODUCED if lo > 0 or hi < 0 else REPRODUCED if (hi - lo) / 2 < margin else INCONCLUSIVE
    raise ValueError(f"expect: got {expect!r}; allowed: 'greater', 'less', 'equal'")


def _clean(x) -> np.ndarray:
    v = np.asarray([float(t) for t in x], dtype=float)
    return v[np.isfinite(v)]


def compare(a, b, expect: str = "greater", alpha: float = ALPHA, seed: int = 0, margin: float = math.nan) -> Comparison:
    """Is mean(a) greater (less) than mean(b), or (expect "equal") within `margin` of it?
    Permutation test and its inverted interval."""
    a, b = _clean(a), _clean(b)
    test = "exact permutation test of the difference of means, CI by test inversion"
    if expect == "equal":
        test += f"; alike when the CI holds 0 and its half-width is below {margin:.2g}"
    if len(a) == 0 or len(b) == 0:
        return Comparison.undecided(len(a), "mean difference", test + ": no data", len(b))
    masks = _labelings(len(a) + len(b), len(a), np.random.default_rng(seed))
    est = float(a.mean() - b.mean())
    spread = float(np.concatenate([a - a.mean(), b - b.mean()]).std()) or abs(est) or 1.0
    lo, hi = _invert(lambda d: _two_sample_p(a - d, b, masks), est, spread, alpha)
    verdict = _verdict(lo, hi, expect, min(len(a), len(b)), margin)
    return Comparison(len(a), len(b), "mean difference", est, lo, hi, _two_sample_p(a, b, masks), hedges_g(a, b),
                      min_detectable(_pooled_sd(a, b), len(a), len(b), alpha), verdict, test)


def compare_to(a, value: float, expect: str = "greater", alpha: float = ALPHA) -> Comparison:
    """Is mean(a) greater (less) than a fixed value? One-sample t-test and its interval."""
    a = _clean(a)
    test = f"one-sample t-test of the mean against {value:g}"
    if len(a) < 2:
        return Comparison.undecided(len(a), f"mean − {value:g}", test + ": needs at least 2 runs")
    est, sd = float(a.mean() - value), float(a.std(ddof=1))
    se = sd / math.sqrt(len(a))
    q = float(student_t.ppf(1 - alpha / 2, len(a) - 1))
    lo, hi = est - q * se, est + q * se
    p = float(2 * student_t.sf(abs(est) / se if se else math.inf if est else 0.0, len(a) - 1))
    g = est / sd if sd else math.copysign(math.inf, est) if est else 0.0
    return Comparison(len(a), 0, f"mean − {value:g}", est, lo, hi, p, g, min_detectable(sd, len(a), None, alpha),
                      _verdict(lo, hi, expect, len(a)), test)


def rate_vs_half(k: int, n: int, expect: str = "greater", what: str = "rate", alpha: float = ALPHA) -> Comparison:
    """Is the rate k/n above (below) 1/2? Exact one-sided binomial test, Clopper-Pearson interval
    at level 1 - 2 alpha; the test names the smallest count that decides at this n."""
    side = "greater" if expect == "greater" else "less"
    decides = [j for j in range(n + 1) if binomtest(j, n, 0.5, alternative=side).pvalue < alpha] if n else []
    need = (f"decides at ≥ {min(decides)}/{n}" if side == "greater" else f"at ≤ {max(decides)}/{n}") if decides \
        else f"cannot decide with n = {n}"
    test = f"exact one-sided binomial test of {what} {'>' if side == 'greater' else '<'} 1/2 ({need})"
    if n == 0:
        return Comparison.undecided(0, what, test)
    lo, hi = proportion_ci(k, n, 2 * alpha)
    h = 2 * math.asin(math.sqrt(k / n)) - math.pi / 2  # Cohen's h against 1/2
    return Comparison(n, 0, what, k / n, lo, hi, binomtest(k, n, 0.5, alternative=side).pvalue, h, math.nan,
                      _verdict(lo - 0.5, hi - 0.5, side, n), test, level=1 - 2 * alpha)


def censor(collapse_steps, budget: float) -> np.ndarray:
    """min(collapse step, budget), a never-collapsed run (None/NaN) counting as the budget (RMST)."""
    return np.array([budget if s is None or not math.isfinite(float(s)) else min(float(s), budget)
                     for s in collapse_steps], dtype=float)


def proportion_ci(k: int, n: int, alpha: float = ALPHA) -> tuple[float, float]:
    """Clopper-Pearson (exact binomial) two-sided interval for k successes in n trials."""
    if n == 0:
        return math.nan, math.nan
    ci = binomtest(k, n).proportion_ci(1 - alpha, method="exact")
    return float(ci.low), float(ci.high)
