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

"Alike" (expect "equal", a claim's `margin` m > 0, the smallest difference that matters): equivalence
by two one-sided tests (TOST, Schuirmann 1987): the permutation test of H0 "difference <= -m" against
"> -m" and that of H0 ">= m" against "< m", each at level alpha (the permutation distribution's upper
and lower tail); its interval is the (1 - 2 alpha) one (90% at alpha 0.05) made of the two one-sided
bounds, each the inverted one-sided test. Reproduced (equivalent) when the interval lies within
(-m, m), i.e. both tests reject (the TOST p-value, the larger of the two, is <= alpha); not
reproduced when it lies wholly outside (the difference beyond m, one-sided at alpha); else
inconclusive. So more data never turn a difference inside the margin into a refutation: they
narrow the interval, and a difference within the margin becomes equivalent.

Across worlds (strata: runs of a grid over several worlds, seeds nested in worlds) the pooled
tests condition on the worlds run (a fixed-effect analysis): a world moves every run of it alike,
so each test compares runs within a world only, and a world's offset is neither noise nor signal.
A random-effects combination would speak for worlds not run, but it estimates the world-to-world
variance from K = 2 or 3 worlds (a t with K - 1 degrees of freedom: 12.7 x se at K = 2): it could
almost never decide. Whether a claim depends on the world is told apart instead by its verdict on
each world (analysis.claims: "reproduced on k of K worlds", "world-dependent").

- two groups (`compare_strata`): permutation test stratified by world, labels permuted within each
  world (every joint relabelling up to EXACT_LIMIT, else MC_SAMPLES); the estimate is the weighted
  mean of the per-world differences, sum_w h_w d_w / H, h_w = n_aw n_bw / (n_aw + n_bw), H = sum_w h_w
  (inverse-variance weights when the seed sd is the same in every world: the plain mean over
  worlds when every world has the same seeds; fixed weights, so the permutation stays exact); CI
  by inverting the test for a shift d common to every world; effect size and power from the
  within-world pooled sd s_w (sum of squares within each group of each world / sum_w (n_w - 2)):
  g = estimate / s_w * J, min_detectable = (z_{1-alpha/2} + z_power) s_w / sqrt(H);
- one group vs a value (`compare_to_strata`): the t-test of the mean over all runs (the n-weighted
  mean of the world means) with the within-world sd, N - K degrees of freedom (one-way ANOVA's
  error term);
- a rate vs 1/2 (`rate_strata`): the binomial test on the counts summed over worlds; the sum of
  per-world binomials has a tail no heavier than the binomial's at the mean rate (Hoeffding 1956),
  so the test keeps its level whatever the per-world rates.
MIN_SEEDS counts a group's runs over all worlds for the pooled verdict (each world's own verdict
counts its own). One stratum: exactly the one-world test above (the same numbers).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
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
WORLD_DEPENDENT = "world-dependent"
"""A claim reproduced on one world and not reproduced on another (analysis.claims): named, not averaged away."""


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
    margin: float = math.nan
    """The equivalence margin (a similar claim: alike when the interval lies within ±margin); NaN otherwise."""

    @classmethod
    def undecided(cls, n_a: int, statistic: str, test: str, n_b: int = 0) -> "Comparison":
        """No test possible (no data, or too little): every number NaN, inconclusive."""
        return cls(n_a, n_b, statistic, *[math.nan] * 6, INCONCLUSIVE, test)

    def describe(self) -> str:
        n = f"{self.n_a}" + (f" vs {self.n_b}" if self.n_b else "")
        power = f"; below {self.min_detectable:.2g} undetectable" if math.isfinite(self.min_detectable) else ""
        sign = "+" if "mean" in self.statistic else ""  # a difference is signed, a rate is not
        margin = f", margin ±{self.margin:.3g}" if math.isfinite(self.margin) else ""
        p = "TOST p" if math.isfinite(self.margin) else "p"
        return (f"{self.statistic} {self.estimate:{sign}.3g}, {self.level:.0%} CI [{self.ci_low:.3g}, "
                f"{self.ci_high:.3g}]{margin}, {p} = {self.p_value:.2g}, effect {self.effect_size:.2f}, n = {n}{power}")


def _labelings(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Boolean masks (rows) choosing k of n items: all of them, or a seeded sample."""
    if math.comb(n, k) > EXACT_LIMIT:
        return _sampled(n, k, rng)
    idx = np.array(list(itertools.combinations(range(n), k)), dtype=int).reshape(-1, k)
    rows = np.zeros((len(idx), n), dtype=bool)
    rows[np.arange(len(idx))[:, None], idx] = True
    return rows


def _sampled(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """MC_SAMPLES seeded random masks choosing k of n, after the observed one (the first k: a's own
    members of a ++ b): a Monte-Carlo p-value is then (b + 1) / (m + 1), never 0 (Phipson & Smyth
    2010, "Permutation p-values should never be zero"), and the test keeps its level."""
    observed = np.arange(n) < k
    return np.vstack([observed, rng.permuted(np.tile(observed, (MC_SAMPLES, 1)), axis=1)])


def _strata_labelings(sizes: list[tuple[int, int]], rng: np.random.Generator) -> list[np.ndarray]:
    """Per stratum (n, k), the masks of the joint relabellings, row i of each stratum's array
    together making relabelling i: every combination of the strata's own relabellings (their
    product) up to EXACT_LIMIT, else MC_SAMPLES joint ones, each stratum permuted on its own."""
    if math.prod(math.comb(n, k) for n, k in sizes) > EXACT_LIMIT:
        return [_sampled(n, k, rng) for n, k in sizes]
    own = [_labelings(n, k, rng) for n, k in sizes]  # each exact: none has more than the product
    picks = np.meshgrid(*[np.arange(len(m)) for m in own], indexing="ij")
    return [m[i.ravel()] for m, i in zip(own, picks)]


def _shift_test(pairs: list[tuple[np.ndarray, np.ndarray]], masks: list[np.ndarray], h: np.ndarray):
    """p(d, side): the permutation p-value of the weighted mean difference sum_w h_w (mean(a_w - d)
    - mean(b_w)) / sum_w h_w, over the joint relabellings (row i of each stratum's masks picks a's
    members from a ++ b): two-sided, or one-sided against "greater" (the true difference above d: the
    upper tail) or "less". Shifting a by d moves a relabelling's sum of picked values by -d x the
    members of a it keeps: one product per stratum serves every d of the interval's search."""
    w = h / h.sum()  # one stratum: exactly 1, the plain difference
    sums = [m @ np.concatenate([a, b]) for (a, b), m in zip(pairs, masks)]
    kept = [m[:, :len(a)].sum(axis=1) for (a, _), m in zip(pairs, masks)]
    totals = [np.concatenate([a, b]).sum() for a, b in pairs]

    def p(d: float, side: str = "two-sided") -> float:
        picked = [s - d * k if d else s for s, k in zip(sums, kept)]
        diffs = [x / len(a) - (t - d * len(a) - x) / len(b) for x, (a, b), t in zip(picked, pairs, totals)]
        dist = diffs[0] if len(diffs) == 1 else sum(wi * x for wi, x in zip(w, diffs))
        observed = float(w @ [(a - d).mean() - b.mean() for a, b in pairs])
        tol = 1e-12 * max(1.0, abs(observed))  # so that float rounding never splits ties
        if side == "greater":
            return float(np.mean(dist >= observed - tol))
        if side == "less":
            return float(np.mean(dist <= observed + tol))
        return float(np.mean(np.abs(dist) >= abs(observed) - tol))
    return p


def _invert(p_at, center: float, scale: float, alpha: float, tost: bool = False) -> tuple[float, float]:
    """Interval of shifts d with p_at(d) > alpha (two-sided test: the 1 - alpha interval), or with tost
    the lower bound of the one-sided test against "greater" and the upper of that against "less" (each
    at alpha: the 1 - 2 alpha interval): on each side of `center`, double the step until the test
    rejects, then bisect for the edge (+1 inside, -1 outside)."""
    def edge(direction: float) -> float:
        side = ("greater" if direction < 0 else "less") if tost else "two-sided"
        step = max(scale, 1e-12)
        for _ in range(60):
            if p_at(center + direction * step, side) <= alpha:
                inside = lambda d: 1.0 if p_at(center + direction * d, side) > alpha else -1.0  # noqa: E731
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
    return _g(a.mean() - b.mean(), _pooled_sd(a, b), len(a) + len(b) - 2)


def _g(diff: float, sd: float, df: int) -> float:
    """Hedges' g: diff / sd * J, J = 1 - 3 / (4 df - 1) (df: the degrees of freedom of sd)."""
    if sd == 0:
        return math.copysign(math.inf, diff) if diff else 0.0
    return diff / sd * (1 - 3 / (4 * df - 1))


def min_detectable(sd: float, n_a: int, n_b: int | None = None, alpha: float = ALPHA, power: float = POWER) -> float:
    """Smallest true difference a two-sided level-alpha test finds with the given power."""
    if not math.isfinite(sd) or n_a < 2:
        return math.nan
    return _z(alpha, power) * sd * math.sqrt(1 / n_a + (1 / n_b if n_b else 0.0))


def _z(alpha: float, power: float) -> float:
    """z_{1-alpha/2} + z_power: the detectable difference in standard errors."""
    return NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)


def _verdict(lo: float, hi: float, expect: str, n_min: int, margin: float = math.nan) -> str:
    if n_min < MIN_SEEDS:
        return INCONCLUSIVE
    if expect == "greater":
        return REPRODUCED if lo > 0 else NOT_REPRODUCED if hi < 0 else INCONCLUSIVE
    if expect == "less":
        return REPRODUCED if hi < 0 else NOT_REPRODUCED if lo > 0 else INCONCLUSIVE
    if expect == "equal":  # equivalence (TOST): the 1 - 2 alpha interval within ±margin, or wholly outside it
        return REPRODUCED if -margin < lo and hi < margin else NOT_REPRODUCED if lo >= margin or hi <= -margin \
            else INCONCLUSIVE
    raise ValueError(f"expect: got {expect!r}; allowed: 'greater', 'less', 'equal'")


def _clean(x) -> np.ndarray:
    v = np.asarray([float(t) for t in x], dtype=float)
    return v[np.isfinite(v)]


def compare(a, b, expect: str = "greater", alpha: float = ALPHA, seed: int = 0, margin: float = math.nan) -> Comparison:
    """Is mean(a) greater (less) than mean(b), or (expect "equal") within ±`margin` of it (TOST)?
    Permutation test and its inverted interval."""
    a, b = _clean(a), _clean(b)
    test = "exact permutation test of the difference of means, CI by test inversion"
    if len(a) == 0 or len(b) == 0:
        return _tested(Comparison.undecided(len(a), "mean difference", test + ": no data", len(b)), expect, alpha, margin)
    p_at = _shift_test([(a, b)], [_labelings(len(a) + len(b), len(a), np.random.default_rng(seed))], np.ones(1))
    est = float(a.mean() - b.mean())
    spread = float(np.concatenate([a - a.mean(), b - b.mean()]).std()) or abs(est) or 1.0
    return _tested(Comparison(len(a), len(b), "mean difference", est, math.nan, math.nan, p_at(0.0), hedges_g(a, b),
                              min_detectable(_pooled_sd(a, b), len(a), len(b), alpha), INCONCLUSIVE, test),
                   expect, alpha, margin, p_at, spread)


def _tested(c: Comparison, expect: str, alpha: float, margin: float, p_at=None, spread: float = 1.0) -> Comparison:
    """`c` (a permutation test's numbers, `p_at` its p(d, side)) with its interval, verdict and, for expect
    "equal", the equivalence test (TOST at `margin`: the 1 - 2 alpha interval, the TOST p-value and level)."""
    equal = expect == "equal"
    if equal and not margin > 0:
        raise ValueError(f"expect 'equal' needs a margin > 0 (the smallest difference that matters); got {margin!r}")
    c = replace(c, level=1 - alpha)
    if equal:
        c = replace(c, test=c.test.replace(", CI by test inversion", "") + f": two one-sided tests (TOST) at α = "
                    f"{alpha:g} each against ±{margin:.3g}, {1 - 2 * alpha:.0%} CI by their inversion; equivalent when "
                    "it lies within ±margin, different when wholly outside", level=1 - 2 * alpha, margin=margin)
    if p_at is None:
        return c
    lo, hi = _invert(p_at, c.estimate, spread, alpha, tost=equal)
    p = max(p_at(-margin, "greater"), p_at(margin, "less")) if equal else c.p_value
    return replace(c, ci_low=lo, ci_high=hi, p_value=p, verdict=_verdict(lo, hi, expect, min(c.n_a, c.n_b), margin))


def compare_to(a, value: float, expect: str = "greater", alpha: float = ALPHA) -> Comparison:
    """Is mean(a) greater (less) than a fixed value? One-sample t-test and its interval."""
    a = _clean(a)
    test = f"one-sample t-test of the mean against {value:g}"
    if len(a) < 2:
        return Comparison.undecided(len(a), f"mean − {value:g}", test + ": needs at least 2 runs")
    return _t_test(float(a.mean() - value), float(a.std(ddof=1)), len(a), len(a) - 1, value, expect, alpha, test)


def _t_test(est: float, sd: float, n: int, df: int, value: float, expect: str, alpha: float, test: str) -> Comparison:
    """The t-interval est ± t_{1-alpha/2, df} sd / sqrt(n), its two-sided p-value and verdict."""
    se = sd / math.sqrt(n)
    q = float(student_t.ppf(1 - alpha / 2, df))
    lo, hi = est - q * se, est + q * se
    p = float(2 * student_t.sf(abs(est) / se if se else math.inf if est else 0.0, df))
    g = est / sd if sd else math.copysign(math.inf, est) if est else 0.0
    return Comparison(n, 0, f"mean − {value:g}", est, lo, hi, p, g, min_detectable(sd, n, None, alpha),
                      _verdict(lo, hi, expect, n), test)


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


def compare_strata(a_strata, b_strata, expect: str = "greater", alpha: float = ALPHA, seed: int = 0,
                   margin: float = math.nan) -> Comparison:
    """`compare` pooled over strata (worlds; a_strata[w], b_strata[w]: world w's runs): the permutation
    test stratified by world of the weighted mean within-world difference (module docstring).
    One stratum: `compare` itself; a world lacking a group is left out."""
    if len(a_strata) == 1 and len(b_strata) == 1:
        return compare(a_strata[0], b_strata[0], expect, alpha, seed, margin)
    cleaned = [(_clean(a), _clean(b)) for a, b in zip(a_strata, b_strata, strict=True)]
    pairs = [(a, b) for a, b in cleaned if len(a) and len(b)]
    lacking = len(cleaned) - len(pairs)
    worlds = f"{len(pairs)} worlds" + (f" of {len(cleaned)}: {lacking} lack a group" if lacking else "")
    if len(pairs) == 1:
        c = compare(*pairs[0], expect, alpha, seed, margin)
        return replace(c, test=c.test + f" (one world of {len(cleaned)} has both groups)")
    test = (f"permutation test stratified by world ({worlds}; labels permuted within each world) of the weighted mean "
            "within-world difference, CI by test inversion")
    n_a, n_b = sum(len(a) for a, _ in cleaned), sum(len(b) for _, b in cleaned)
    if not pairs:
        return _tested(Comparison.undecided(n_a, "mean within-world difference", test + ": no world has both groups", n_b),
                       expect, alpha, margin)
    h = np.array([len(a) * len(b) / (len(a) + len(b)) for a, b in pairs])  # 1 / var(d_w) per unit sd^2
    p_at = _shift_test(pairs, _strata_labelings([(len(a) + len(b), len(a)) for a, b in pairs],
                                                np.random.default_rng(seed)), h)

    est = float(h @ [a.mean() - b.mean() for a, b in pairs] / h.sum())
    centered = np.concatenate([x - x.mean() for pair in pairs for x in pair])
    df = sum(len(a) + len(b) - 2 for a, b in pairs)
    sd = math.sqrt(float(centered @ centered) / df) if df > 0 else math.nan  # within-world pooled sd
    power = _z(alpha, POWER) * sd / math.sqrt(h.sum())  # NaN with no within-world spread estimate
    return _tested(Comparison(n_a, n_b, "mean within-world difference", est, math.nan, math.nan, p_at(0.0),
                              _g(est, sd, df), power, INCONCLUSIVE, test),
                   expect, alpha, margin, p_at, float(centered.std()) or abs(est) or 1.0)


def compare_to_strata(strata, value: float, expect: str = "greater", alpha: float = ALPHA) -> Comparison:
    """`compare_to` pooled over strata (worlds): the t-test of the mean of all runs with the
    within-world sd and N - K degrees of freedom. One stratum: `compare_to` itself."""
    if len(strata) == 1:
        return compare_to(strata[0], value, expect, alpha)
    xs = [x for x in map(_clean, strata) if len(x)]
    n, df = sum(len(x) for x in xs), sum(len(x) - 1 for x in xs)
    test = f"one-sample t-test of the mean against {value:g} stratified by world ({len(xs)} worlds: within-world sd)"
    if df < 1:
        return Comparison.undecided(n, f"mean − {value:g}", test + ": needs a world with at least 2 runs")
    sd = math.sqrt(sum(float(((x - x.mean()) ** 2).sum()) for x in xs) / df)
    return _t_test(float(np.concatenate(xs).mean() - value), sd, n, df, value, expect, alpha, test + f", {df} df")


def rate_strata(counts: list[tuple[int, int]], expect: str = "greater", what: str = "rate",
                alpha: float = ALPHA) -> Comparison:
    """`rate_vs_half` on (k, n) counts summed over strata (worlds); one stratum: `rate_vs_half` itself."""
    c = rate_vs_half(sum(k for k, _ in counts), sum(n for _, n in counts), expect, what, alpha)
    return c if len(counts) == 1 else replace(c, test=c.test + f", counts summed over {len(counts)} worlds")


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
