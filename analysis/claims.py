"""The claims of an ablation's YAML (`claims:`) as verdicts (reproduced / not reproduced / inconclusive)
of stated tests (analysis.stats), each printed with its test and numbers.

Every run becomes one number (harness.summary.reduce_run), then per rule (harness.registry.RULES):
compare and each neighbour pair of a trend: permutation test of mean(higher) - mean(lower) > 0 (on
metric collapse/step: RMST, a run that never collapsed censored at the longest run's last step);
threshold: one-sample t-test against `value`; similar: each pair's permutation CI holds 0 and its
half-width is below SIMILAR_MARGIN x the larger |mean|; collapses: exact binomial test of the
collapse rate against 1/2; pairs_above_chance (n = held-out pairs of one run): the same test on
the share of pairs ordered right; eval_scores_shift (n = held-out scores, seeds pooled):
permutation test of the last eval step against the first, on the scores (mean) or on |score -
median| (sd: the Brown-Forsythe test). A claim of several tests is reproduced when every test is
(intersection-union: no multiplicity correction needed), not reproduced when any is.
"""
from __future__ import annotations

import argparse
import sys
from itertools import combinations
from typing import Any, Callable

import numpy as np
import pandas as pd

from analysis.stats import (
    INCONCLUSIVE, MIN_SEEDS, NOT_REPRODUCED, REPRODUCED, Comparison, censor, compare, compare_to, rate_vs_half,
)
from analysis.store import STORE_OPTIONS, AblationData, load_ablation
from harness import keys as K
from harness import tracking
from harness.registry import (
    Claim, Collapses, Compare, EvalScoresShift, PairsAboveChance, Similar, Threshold, Trend, UnknownAblation,
)
from harness.summary import describe, fmt, fmt_mean_sd

SIMILAR_MARGIN = 0.1  # 'similar': each difference's CI half-width must be below this fraction of the larger |mean|
STAT_WORDS = {"rise": "rise (final − initial) of", "volatility": "step-to-step volatility of", "min": "lowest"}
METRIC_WORDS = {
    K.RM_SCORE: "RM score", K.GOLD_SCORE: "gold score", K.KL: "KL", K.PPL: "perplexity", K.LENGTH: "length",
    K.VALUES: "values", K.ADV_RAW_STD: "raw advantage std", K.RM_EVAL_ACC: "RM eval accuracy",
    K.RM_TRAIN_ACC: "RM train accuracy", K.EVAL_WIN_RATE: "win rate vs SFT",
    K.COLLAPSE_STEP: "collapse step (RMST: a run that never collapsed counts as the step budget)",
}
Part = tuple[str, Comparison]  # one test of a claim: its label (the groups, their mean ± sd) and its outcome


class Unjudged(Exception):
    """Why a claim cannot be judged (a variant or metric the runs lack)."""


def _words(rule: Any) -> str:
    stat = "" if rule.metric == K.COLLAPSE_STEP else f"{STAT_WORDS.get(rule.stat, rule.stat)} "
    return stat + METRIC_WORDS.get(rule.metric, rule.metric)


def _runs(data: AblationData, variant: str) -> pd.DataFrame:
    if variant not in data.variants:
        raise Unjudged(f"variant {variant!r} has no runs (variants with runs: {', '.join(data.variants) or 'none'})")
    return data.runs[data.runs["variant"] == variant]


def _values(data: AblationData, rule: Any, variant: str) -> np.ndarray:
    """One number per run of `variant`: `rule.stat` of `rule.metric`, or the censored collapse step."""
    runs = _runs(data, variant)
    if rule.metric == K.COLLAPSE_STEP:
        last = data.metrics(K.RM_SCORE).groupby("run_id")["step"].max()  # a tag-only collapse: the run's end
        steps = [r.collapse_step if r.collapse_step == r.collapse_step else last.get(r.run_id) if r.collapsed else None
                 for r in runs.itertuples()]
        return censor(steps, float(last.max()))
    per_run = data.per_run(rule.metric, rule.stat)  # the perplexity the figure shows
    values = per_run.loc[per_run["variant"] == variant, "value"].to_numpy()
    if not len(values):
        raise Unjudged(f"{data.shown_metric(rule.metric)} not logged by {variant!r}")
    return values


def _ms(name: str, values: np.ndarray) -> str:
    return f"{name} {fmt_mean_sd(describe(values))}"


def _pair(rule: Any, data: AblationData, lower: str, higher: str) -> Part:
    hi, lo = _values(data, rule, higher), _values(data, rule, lower)
    return f"{_ms(higher, hi)} vs {_ms(lower, lo)}", compare(hi, lo, "greater")


def _trend(rule: Trend, data: AblationData) -> list[Part]:
    found = [n for _, n in sorted((float(v.settings[rule.axis]), v.name) for v in data.spec.variants
                                  if rule.axis in v.settings and v.name in data.variants)]
    if len(found) < 2:
        raise Unjudged(f"fewer than two variants with runs set {rule.axis} "
                       f"(variants with runs: {', '.join(data.variants) or 'none'})")
    if rule.direction == "decreasing":
        found.reverse()
    return [_pair(rule, data, lo, hi) for lo, hi in zip(found, found[1:])]


def _threshold(rule: Threshold, data: AblationData) -> list[Part]:
    parts = []
    for v in [rule.variant] if rule.variant is not None else data.variants:
        values = _values(data, rule, v)
        parts.append((_ms(v, values), compare_to(values, rule.value, "greater" if rule.op == ">" else "less")))
    return parts


def _similar(rule: Similar, data: AblationData) -> list[Part]:
    values = {v: _values(data, rule, v) for v in rule.variants}
    margin = SIMILAR_MARGIN * max(abs(x.mean()) for x in values.values())
    return [(f"{_ms(a, values[a])} vs {_ms(b, values[b])}", compare(values[a], values[b], "equal", margin=margin))
            for a, b in combinations(rule.variants, 2)]


def _collapses(rule: Collapses, data: AblationData) -> list[Part]:
    runs = _runs(data, rule.variant)
    k, n = int(runs["collapsed"].sum()), len(runs)
    steps = ", ".join(fmt(s) for s in sorted(runs["collapse_step"].dropna()))
    failed = int(runs["status"].eq("FAILED").sum())
    label = f"{rule.variant}: {k}/{n} seeds collapsed" + (f" (steps {steps})" if steps else "") + (
        f"; {failed} run(s) FAILED" if failed else "")
    return [(label, rate_vs_half(k, n, "greater" if rule.expected else "less", "collapse rate"))]


def _pairs_above_chance(rule: PairsAboveChance, data: AblationData) -> list[Part]:
    parts = []
    for v in data.variants:
        d = data.rm_score_diffs(v)
        if not d.size:
            raise Unjudged(f"{v!r} has no {K.RM_SCORE_DIFF} artifact")
        k = int((d > 0).sum())
        parts.append((f"{v}: {k}/{d.size} pairs > 0, mean diff {fmt(d.mean())}",
                      rate_vs_half(k, d.size, "greater", "share of pairs ordered right")))
    return parts


def _eval_scores_shift(rule: EvalScoresShift, data: AblationData) -> list[Part]:
    parts = []
    for v in data.variants:
        by_step = {s: x for s, x in data.eval_rm_scores(v).items() if len(x) > 1}
        if len(by_step) < 2:
            raise Unjudged(f"{v!r}: fewer than two eval steps with RM scores")
        (s0, first), (s1, last) = min(by_step.items()), max(by_step.items())
        moment = np.mean if rule.what == "mean" else lambda x: np.std(x, ddof=1)
        label = f"{v}: {rule.what} step {s0} {fmt(moment(first))} -> step {s1} {fmt(moment(last))}"
        if rule.what == "sd":  # Brown-Forsythe: spread as absolute deviations from the median
            first, last = (np.abs(x - np.median(x)) for x in (first, last))
            label += " (tested on |score − median|)"
        parts.append((label, compare(last, first, "greater")))
    return parts


RULE_CHECKS: dict[type, tuple[Callable[[Any], str], Callable[[Any, AblationData], list[Part]]]] = {
    Compare: (lambda r: f"{_words(r)}: '{r.lower}' < '{r.higher}'", lambda r, d: [_pair(r, d, r.lower, r.higher)]),
    Similar: (lambda r: f"{_words(r)}: {', '.join(map(repr, r.variants))} alike within {SIMILAR_MARGIN:.0%}", _similar),
    Trend: (lambda r: f"{_words(r)} {r.direction} in {r.axis} (every neighbour pair)", _trend),
    Threshold: (lambda r: f"{_words(r)} {r.op} {r.value:g} for {repr(r.variant) if r.variant else 'every variant'}",
                _threshold),
    Collapses: (lambda r: f"'{r.variant}' {'collapses' if r.expected else 'does not collapse'} (tag "
                f"{K.TAG_COLLAPSED} or metric {K.COLLAPSE_STEP}) in most seeds", _collapses),
    PairsAboveChance: (lambda r: "share of held-out pairs with chosen − rejected > 0 above 1/2, for every RM",
                       _pairs_above_chance),
    EvalScoresShift: (lambda r: f"{r.what} of held-out RM scores: last eval step > first", _eval_scores_shift),
}
"""Each rule kind (harness.registry.RULES): the rule in words, and its tests."""
RANK = {NOT_REPRODUCED: 0, INCONCLUSIVE: 1, REPRODUCED: 2}
CLAIM_COLUMNS = ["ablation", "figure", "claim", "source", "rule", "verdict", "test", "n", "statistic", "estimate",
                 "ci_low", "ci_high", "level", "p_value", "effect_size", "min_detectable", "numbers", "reason"]


def check_claims(data: AblationData, claims: list[Claim] | None = None) -> pd.DataFrame:
    """One row per claim (CLAIM_COLUMNS); the test columns are the deciding test's (the first not
    reproduced, else inconclusive, else the weakest), `numbers` has every test's."""
    rows = []
    for claim in data.spec.claims if claims is None else claims:
        words, evaluate = RULE_CHECKS[type(claim.rule)]
        try:
            if data.runs.empty:
                raise Unjudged("no runs in the store")
            parts, reason = evaluate(claim.rule, data), ""
        except Unjudged as e:
            parts, reason = [], str(e)
        c = min((c for _, c in parts), key=lambda c: (RANK[c.verdict], -np.nan_to_num(c.p_value)), default=None)
        if c is not None and c.verdict == INCONCLUSIVE and 0 < min(c.n_a, c.n_b or c.n_a) < MIN_SEEDS:
            reason = f"fewer than {MIN_SEEDS} runs per variant: no verdict"
        row = {"ablation": data.name, "figure": data.spec.figure, "claim": claim.statement, "source": claim.cited,
               "rule": words(claim.rule), "verdict": c.verdict if c else INCONCLUSIVE,
               "numbers": "; ".join(f"{label}: {p.describe()}" for label, p in parts), "reason": reason}
        if c is not None:
            row |= {k: getattr(c, k) for k in CLAIM_COLUMNS if hasattr(c, k)}
            row["n"] = f"{c.n_a}" + (f" vs {c.n_b}" if c.n_b else "")
        rows.append(row)
    return pd.DataFrame(rows, columns=CLAIM_COLUMNS)


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    ap = argparse.ArgumentParser(prog="python -m analysis.claims", parents=[STORE_OPTIONS], description=__doc__)
    ap.add_argument("ablation", help="registry name or YAML path (its `claims:` are checked)")
    args = ap.parse_args(argv)
    try:
        data = load_ablation(args.ablation, args.tracking_uri, args.ablations_dir)
    except UnknownAblation as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if data.spec.claims and data.runs.empty:  # every verdict would be "no data": say so and fail
        print(f"error: {data.name}: the store {tracking.redact(data.tracking_uri)} holds no runs of it; run "
              f"`python -m harness.ablate {data.name}` first", file=sys.stderr)
        return 1
    table = check_claims(data)
    if table.empty:
        print(f"{data.name}: no claims in its YAML")
    for r in table.itertuples():
        print(f"[{r.verdict}] {r.claim} ({r.source})\n    rule: {r.rule}\n    test: {r.test}\n    numbers: "
              f"{r.numbers or '–'}" + (f"\n    note: {r.reason}" if r.reason else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
