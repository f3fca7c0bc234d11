"""The statistics behind every verdict: per-seed summaries in, a stated test with an interval out.

A claim compares per-seed numbers (one number per run, `harness.summary.reduce_run`) of two
variants, or checks one variant against a fixed value. The test is chosen for small n (5-10 seeds)
and makes no normality assumption:

- **Two variants** (`compare`): exact two-sided permutation test of the difference of means
  (every relabelling of the pooled seeds when there are at most `EXACT_LIMIT` of them, else a
  seeded Monte-Carlo sample). The confidence interval of the difference is the set of shifts d for
  which the test of (a - d) vs b does not reject (test inversion), so the interval and the p-value
  always agree: "inconclusive" exactly when the interval holds 0.
- **One variant vs a value** (`compare_to`): one-sample t-test and t-interval (an exact sign-flip
  test cannot reject at 0.05 with 5 seeds).
- **Effect size**: Hedges' g (the standardized mean difference with the small-sample correction).
- **Power limit** (`min_detectable`): the difference that a two-sided level-alpha test detects with
  80% power at these n and this spread (normal approximation): smaller differences can go unseen.
- **Censored collapse steps**: a run that never collapsed is censored at the step budget; comparing
  min(collapse step, budget) is the restricted mean survival time (RMST) comparison, the standard
  treatment when every censoring happens at the same horizon (`censor`).
- **Proportions** (`proportion_ci`): Clopper-Pearson interval for k of n runs (e.g. collapsed).

Verdicts: `reproduced` when the interval lies wholly on the claimed side, `contradicted` when
wholly on the other side, else `inconclusive`.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

ALPHA = 0.05
POWER = 0.8
EXACT_LIMIT = 200_000  # relabellings enumerated exactly up to this many
MC_SAMPLES = 20_000
MIN_SEEDS = 5  # below this a verdict is "inconclusive (n < 5)" whatever the data say

REPRODUCED, CONTRADICTED, INCONCLUSIVE = "reproduced", "contradicted", "inconclusive"


@dataclass(frozen=True)
class Comparison:
    """The outcome of one test, with everything a reviewer asks for."""

    n_a: int
    n_b: int
    estimate: float
    """mean(a) - mean(b) (two variants) or mean(a) - value (one variant)."""
    ci_low: float
    ci_high: float
    p_value: float
    effect_size: float
    """Hedges' g (two variants) or the mean difference in sds of a (one variant)."""
    min_detectable: float
    """Smallest |difference| detectable with 80% power at these n and spread (NaN when unknown)."""
    verdict: str
    test: str
    """The test, in words, for the report."""

    def describe(self) -> str:
        return (f"diff {self.estimate:+.3g}, {int((1 - ALPHA) * 100)}% CI [{self.ci_low:.3g}, {self.ci_high:.3g}], "
                f"p = {self.p_value:.3g}, g = {self.effect_size:.2f}, n = {self.n_a}"
                + (f" vs {self.n_b}" if self.n_b else "")
                + (f"; differences below {self.min_detectable:.2g} would go undetected"
                   if math.isfinite(self.min_detectable) else ""))


def _clean(x) -> np.ndarray:
    v = np.asarray([float(t) for t in x], dtype=float)
    return v[np.isfinite(v)]


def _labelings(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Boolean masks (rows) choosing k of n items: all of them, or a seeded sample."""
    total = math.comb(n, k)
    if total <= EXACT_LIMIT:
        rows = np.zeros((total, n), dtype=bool)
        for r, idx in enumerate(itertools.combinations(range(n), k)):
            rows[r, list(idx)] = True
        return rows
    rows = np.zeros((MC_SAMPLES, n), dtype=bool)
    for r in range(MC_SAMPLES):
        rows[r, rng.choice(n, size=k, replace=False)] = True
    return rows


def _two_sample_p(a: np.ndarray, b: np.ndarray, masks: np.ndarray) -> float:
    pooled = np.concatenate([a, b])
    k = len(a)
    sums = masks @ pooled
    diffs = sums / k - (pooled.sum() - sums) / len(b)
    observed = a.mean() - b.mean()
    # a small tolerance so that float rounding never splits ties
    return float(np.mean(np.abs(diffs) >= abs(observed) - 1e-12 * max(1.0, abs(observed))))


def _invert(p_at, center: float, scale: float, alpha: float) -> tuple[float, float]:
    """Interval of shifts d with p_at(d) > alpha, found by bisection on each side of `center`."""
    def edge(direction: float) -> float:
        inside, step = center, max(scale, 1e-12)
        outside = center + direction * step
        for _ in range(60):  # widen until the test rejects
            if p_at(outside) <= alpha:
                break
            inside, outside = outside, center + direction * (step := step * 2)
        else:
            return direction * math.inf
        for _ in range(60):
            mid = 0.5 * (inside + outside)
            if p_at(mid) > alpha:
                inside = mid
            else:
                outside = mid
        return inside
    return edge(-1.0), edge(1.0)


def hedges_g(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = len(a), len(b)
    if na < 2 or nb < 2:
        return math.nan
    sp = math.sqrt(((na - 1) * a.var(ddof=1) + (nb - 1) * b.var(ddof=1)) / (na + nb - 2))
    if sp == 0:
        return math.copysign(math.inf, a.mean() - b.mean()) if a.mean() != b.mean() else 0.0
    return (a.mean() - b.mean()) / sp * (1 - 3 / (4 * (na + nb) - 9))


def min_detectable(sd: float, n_a: int, n_b: int | None = None, alpha: float = ALPHA, power: float = POWER) -> float:
    """Smallest true difference a two-sided level-alpha test finds with the given power."""
    if not math.isfinite(sd) or n_a < 2:
        return math.nan
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    se = sd * math.sqrt(1 / n_a + (1 / n_b if n_b else 0.0))
    return z * se


def _verdict(lo: float, hi: float, expect: str, n_min: int) -> str:
    if n_min < MIN_SEEDS:
        return INCONCLUSIVE
    if expect == "greater":
        return REPRODUCED if lo > 0 else CONTRADICTED if hi < 0 else INCONCLUSIVE
    if expect == "less":
        return REPRODUCED if hi < 0 else CONTRADICTED if lo > 0 else INCONCLUSIVE
    if expect == "equal":  # "hard to tell apart": reproduced when no difference is found
        return CONTRADICTED if lo > 0 or hi < 0 else REPRODUCED
    raise ValueError(f"expect: got {expect!r}; allowed: 'greater', 'less', 'equal'")


def compare(a, b, expect: str = "greater", alpha: float = ALPHA, seed: int = 0) -> Comparison:
    """Is mean(a) greater (less) than mean(b)? Permutation test and its inverted interval."""
    a, b = _clean(a), _clean(b)
    if len(a) == 0 or len(b) == 0:
        return Comparison(len(a), len(b), math.nan, math.nan, math.nan, math.nan, math.nan, math.nan,
                          INCONCLUSIVE, "no data")
    rng = np.random.default_rng(seed)
    masks = _labelings(len(a) + len(b), len(a), rng)
    est = float(a.mean() - b.mean())
    p = _two_sample_p(a, b, masks)
    spread = float(np.concatenate([a - a.mean(), b - b.mean()]).std()) or abs(est) or 1.0
    lo, hi = _invert(lambda d: _two_sample_p(a - d, b, masks), est, spread, alpha)
    sd = math.sqrt((a.var(ddof=1) * (len(a) - 1) + b.var(ddof=1) * (len(b) - 1)) / max(len(a) + len(b) - 2, 1)) \
        if len(a) > 1 and len(b) > 1 else math.nan
    return Comparison(len(a), len(b), est, lo, hi, p, hedges_g(a, b), min_detectable(sd, len(a), len(b), alpha),
                      _verdict(lo, hi, expect, min(len(a), len(b))),
                      "two-sided exact permutation test of the difference of means; CI by test inversion")


def compare_to(a, value: float, expect: str = "greater", alpha: float = ALPHA) -> Comparison:
    """Is mean(a) greater (less) than a fixed value? One-sample t-test and its interval.

    (A sign-flip permutation test cannot reject at level 0.05 two-sided with 5 seeds: its smallest
    p-value is 2/32. The t-interval is the standard choice for a mean of a few seeds.)"""
    from scipy.stats import t as student_t

    a = _clean(a)
    if len(a) < 2:
        return Comparison(len(a), 0, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, INCONCLUSIVE,
                          "one-sample t-test: needs at least 2 runs")
    est = float(a.mean() - value)
    sd = float(a.std(ddof=1))
    se = sd / math.sqrt(len(a))
    if se == 0:
        lo = hi = est
        p = 0.0 if est else 1.0
    else:
        q = float(student_t.ppf(1 - alpha / 2, len(a) - 1))
        lo, hi = est - q * se, est + q * se
        p = float(2 * student_t.sf(abs(est) / se, len(a) - 1))
    g = est / sd if sd else math.copysign(math.inf, est) if est else 0.0
    return Comparison(len(a), 0, est, lo, hi, p, g, min_detectable(sd, len(a), None, alpha),
                      _verdict(lo, hi, expect, len(a)), f"two-sided one-sample t-test of the mean against {value:g}")


def censor(collapse_steps, budget: float) -> np.ndarray:
    """min(collapse step, budget), a never-collapsed run (None/NaN) counting as the budget (RMST)."""
    return np.array([budget if s is None or not math.isfinite(float(s)) else min(float(s), budget)
                     for s in collapse_steps], dtype=float)


def _binom_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def _solve(f, target: float, increasing: bool) -> float:
    """p in [0, 1] with f(p) = target for f monotone in p (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if (f(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def proportion_ci(k: int, n: int, alpha: float = ALPHA) -> tuple[float, float]:
    """Clopper-Pearson (exact binomial) two-sided interval for k successes in n trials."""
    if n == 0:
        return math.nan, math.nan
    lo = 0.0 if k == 0 else _solve(lambda p: 1 - _binom_cdf(k - 1, n, p), alpha / 2, increasing=True)
    hi = 1.0 if k == n else _solve(lambda p: _binom_cdf(k, n, p), alpha / 2, increasing=False)
    return lo, hi
