"""The claims of an ablation's YAML (`claims:`) as verdicts (reproduced / not reproduced / inconclusive)
of stated tests (analysis.stats), each printed with its test and numbers.

Every run becomes one number (harness.summary.reduce_run), then per rule (harness.rules.RULES):
compare and each neighbour pair of a trend: permutation test of mean(higher) - mean(lower) > 0 (on
metric collapse/step: RMST, a run that never collapsed censored at the longest run's last step);
threshold: one-sample t-test against `value`; similar: each pair equivalent within the claim's `margin`
(its smallest difference that matters, harness.rules.Margin, resolved on the runs judged: a share of a
variant's mean is of that mean there): two one-sided permutation tests (TOST), reproduced when the
90% interval lies within ±margin, not reproduced when wholly outside it; collapses: exact binomial test of the
collapse rate against 1/2; pairs_above_chance (n = held-out pairs of one run): the same test on
the share of pairs ordered right; eval_scores_shift (n = held-out scores, seeds pooled):
permutation test of the last eval step against the first, on the scores (mean) or on |score -
median| (sd: the Brown-Forsythe test). A claim of several tests is reproduced when every test is
(intersection-union: no multiplicity correction needed), not reproduced when any is.

Runs on several worlds (analysis.store: tag provenance.world.hash): each claim is judged on each
world alone (the tests above on that world's runs) and once pooled over every run with the same
tests stratified by world (analysis.stats: compare_strata, compare_to_strata, rate_strata; seeds
nested in worlds, a world's offset never counts as a difference). The row's test numbers are the
pooled test's, beside "reproduced on k of K worlds"; its verdict is the pooled one, except that a
claim reproduced on one world and not reproduced on another is "world-dependent" (WORLD_DEPENDENT):
named, not averaged away. One world: exactly the one-world tests, and no world columns.
"""
from __future__ import annotations

import argparse
import sys
from itertools import combinations
from typing import Any, Callable

import numpy as np
import pandas as pd

from analysis.stats import (
    INCONCLUSIVE,
    MIN_SEEDS,
    NOT_REPRODUCED,
    REPRODUCED,
    WORLD_DEPENDENT,
    Comparison,
    censor,
    compare_strata,
    compare_to_strata,
    rate_strata,
)
from analysis.store import STORE_OPTIONS, AblationData, load_ablation
from harness import keys as K
from harness import tracking
from harness.registry import UnknownAblation
from harness.rules import Claim, Collapses, Compare, EvalScoresShift, PairsAboveChance, Similar, Threshold, Trend
from harness.summary import describe, fmt, fmt_mean_sd

STAT_WORDS = {"rise": "rise (final − initial) of", "volatility": "step-to-step volatility of", "min": "lowest"}
METRIC_WORDS = {
    K.RM_SCORE: "RM score", K.GOLD_SCORE: "gold score", K.KL: "KL", K.PPL: "perplexity", K.LENGTH: "length",
    K.VALUES: "values", K.ADV_RAW_STD: "raw advantage std", K.RM_EVAL_ACC: "RM eval accuracy",
    K.RM_TRAIN_ACC: "RM train accuracy", K.EVAL_WIN_RATE: "win rate vs SFT",
    K.COLLAPSE_STEP: "collapse step (RMST: a run that never collapsed counts as the step budget)",
}
Part = tuple[str, Comparison]  # one test of a claim: its label (the groups, their mean ± sd) and its outcome
Strata = list[np.ndarray]  # one number per run, one array per world of the data (AblationData.worlds)


class Unjudged(Exception):
    """Why a claim cannot be judged (a variant or metric the runs lack)."""


def _words(rule: Any) -> str:
    stat = "" if rule.metric == K.COLLAPSE_STEP else f"{STAT_WORDS.get(rule.stat, rule.stat)} "
    return stat + METRIC_WORDS.get(rule.metric, rule.metric)


def _runs(data: AblationData, variant: str) -> pd.DataFrame:
    if variant not in data.variants:
        raise Unjudged(f"variant {variant!r} has no runs (variants with runs: {', '.join(data.variants) or 'none'})")
    return data.runs[data.runs["variant"] == variant]


def _strata(data: AblationData, one: Callable[[AblationData], Any], empty: Any = np.array([])) -> list:
    """`one` (what a single world gives: its numbers) on each world's runs; a world where `one` finds
    nothing gives `empty`, unless no world has anything (then the first world's reason stands)."""
    if len(data.worlds) <= 1:
        return [one(data)]
    out, why = [], []
    for world in data.worlds:
        try:
            out.append(one(data.in_world(world)))
        except Unjudged as e:
            out.append(empty)
            why.append(e)
    if len(why) == len(out):
        raise why[0]
    return out


def _values(data: AblationData, rule: Any, variant: str) -> Strata:
    """One number per run of `variant` (per world): `rule.stat` of `rule.metric`, or the censored collapse step."""
    return _strata(data, lambda d: _world_values(d, rule, variant))


def _world_values(data: AblationData, rule: Any, variant: str) -> np.ndarray:
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


def _ms(name: str, values: Strata) -> str:
    return f"{name} {fmt_mean_sd(describe(np.concatenate(values)))}"


def _pair(rule: Any, data: AblationData, lower: str, higher: str) -> Part:
    hi, lo = _values(data, rule, higher), _values(data, rule, lower)
    return f"{_ms(higher, hi)} vs {_ms(lower, lo)}", compare_strata(hi, lo, "greater")


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
        parts.append((_ms(v, values), compare_to_strata(values, rule.value, "greater" if rule.op == ">" else "less")))
    return parts


def _similar(rule: Similar, data: AblationData) -> list[Part]:
    return equivalence(rule, {v: _values(data, rule, v) for v in rule.variants})


def equivalence(rule: Similar, values: dict[str, Strata]) -> list[Part]:
    """Each pair of the rule's variants (`values`: each one's numbers per world) tested for equivalence
    within the rule's margin, resolved on these numbers (a share of a variant's mean: of its mean here)."""
    means = {v: float(np.concatenate(x).mean()) for v, x in values.items() if sum(map(len, x))}
    try:
        margin = rule.margin.resolve(means)
    except ValueError as e:
        raise Unjudged(str(e)) from None
    return [(f"{_ms(a, values[a])} vs {_ms(b, values[b])}",
             compare_strata(values[a], values[b], "equal", margin=margin))
            for a, b in combinations(rule.variants, 2)]


def _collapses(rule: Collapses, data: AblationData) -> list[Part]:
    runs = _runs(data, rule.variant)
    k, n = int(runs["collapsed"].sum()), len(runs)
    steps = ", ".join(fmt(s) for s in sorted(runs["collapse_step"].dropna()))
    failed = int(runs["status"].eq("FAILED").sum())
    label = f"{rule.variant}: {k}/{n} seeds collapsed" + (f" (steps {steps})" if steps else "") + (
        f"; {failed} run(s) FAILED" if failed else "")
    counts = [(int(g["collapsed"].sum()), len(g)) for g in (runs[runs["world"] == w] for w in data.worlds) if len(g)]
    return [(label, rate_strata(counts, "greater" if rule.expected else "less", "collapse rate"))]


def _pairs_above_chance(rule: PairsAboveChance, data: AblationData) -> list[Part]:
    parts = []
    for v in data.variants:
        per_world = _strata(data, lambda one: _diffs_of(one, v))
        d = np.concatenate(per_world)
        k = int((d > 0).sum())
        parts.append((f"{v}: {k}/{d.size} pairs > 0, mean diff {fmt(d.mean())}",
                      rate_strata([(int((x > 0).sum()), x.size) for x in per_world if x.size], "greater",
                                  "share of pairs ordered right")))
    return parts


def _diffs_of(data: AblationData, variant: str) -> np.ndarray:
    d = data.rm_score_diffs(variant)
    if not d.size:
        raise Unjudged(f"{variant!r} has no {K.RM_SCORE_DIFF} artifact")
    return d


def _eval_scores_shift(rule: EvalScoresShift, data: AblationData) -> list[Part]:
    parts = []
    moment = np.mean if rule.what == "mean" else lambda x: np.std(x, ddof=1)
    for v in data.variants:
        ends = [e for e in _strata(data, lambda one: _first_last(one, v), None) if e is not None]
        steps = ["/".join(sorted({str(e[i]) for e in ends}, key=int)) for i in (0, 2)]
        label = (f"{v}: {rule.what} step {steps[0]} {fmt(moment(np.concatenate([e[1] for e in ends])))} -> step "
                 f"{steps[1]} {fmt(moment(np.concatenate([e[3] for e in ends])))}")
        firsts, lasts = [e[1] for e in ends], [e[3] for e in ends]
        if rule.what == "sd":  # Brown-Forsythe: spread as absolute deviations from the median (each world's)
            firsts, lasts = ([np.abs(x - np.median(x)) for x in xs] for xs in (firsts, lasts))
            label += " (tested on |score − median|)"
        parts.append((label, compare_strata(lasts, firsts, "greater")))
    return parts


def _first_last(data: AblationData, variant: str) -> tuple[int, np.ndarray, int, np.ndarray]:
    """The first and the last eval step with RM scores, and their scores (seeds pooled)."""
    by_step = {s: x for s, x in data.eval_rm_scores(variant).items() if len(x) > 1}
    if len(by_step) < 2:
        raise Unjudged(f"{variant!r}: fewer than two eval steps with RM scores")
    (s0, first), (s1, last) = min(by_step.items()), max(by_step.items())
    return s0, first, s1, last


RULE_CHECKS: dict[type, tuple[Callable[[Any], str], Callable[[Any, AblationData], list[Part]]]] = {
    Compare: (lambda r: f"{_words(r)}: '{r.lower}' < '{r.higher}'", lambda r, d: [_pair(r, d, r.lower, r.higher)]),
    Similar: (lambda r: f"{_words(r)}: {', '.join(map(repr, r.variants))} alike within {r.margin} ({r.margin_reason})",
              _similar),
    Trend: (lambda r: f"{_words(r)} {r.direction} in {r.axis} (every neighbour pair)", _trend),
    Threshold: (lambda r: f"{_words(r)} {r.op} {r.value:g} for {repr(r.variant) if r.variant else 'every variant'}",
                _threshold),
    Collapses: (lambda r: f"'{r.variant}' {'collapses' if r.expected else 'does not collapse'} (tag "
                f"{K.TAG_COLLAPSED} or metric {K.COLLAPSE_STEP}) in most seeds", _collapses),
    PairsAboveChance: (lambda r: "share of held-out pairs with chosen − rejected > 0 above 1/2, for every RM",
                       _pairs_above_chance),
    EvalScoresShift: (lambda r: f"{r.what} of held-out RM scores: last eval step > first", _eval_scores_shift),
}
"""Each rule kind (harness.rules.RULES): the rule in words, and its tests."""
RANK = {NOT_REPRODUCED: 0, INCONCLUSIVE: 1, REPRODUCED: 2}
CLAIM_COLUMNS = ["ablation", "figure", "claim", "source", "rule", "verdict", "test", "n", "statistic", "estimate",
                 "ci_low", "ci_high", "level", "margin", "p_value", "effect_size", "min_detectable", "numbers", "reason",
                 "worlds", "world_verdicts", "pooled_verdict"]


def _judge(rule: Any, data: AblationData) -> tuple[list[Part], Comparison | None, str]:
    """The rule's tests on `data`, the deciding one (the first not reproduced, else inconclusive,
    else the weakest; None when none ran) and why there is no verdict ('' when there is one)."""
    try:
        if data.runs.empty:
            raise Unjudged("no runs in the store")
        parts, reason = RULE_CHECKS[type(rule)][1](rule, data), ""
    except Unjudged as e:
        parts, reason = [], str(e)
    c = min((c for _, c in parts), key=lambda c: (RANK[c.verdict], -np.nan_to_num(c.p_value)), default=None)
    if c is not None and c.verdict == INCONCLUSIVE and 0 < min(c.n_a, c.n_b or c.n_a) < MIN_SEEDS:
        reason = f"fewer than {MIN_SEEDS} runs per variant: no verdict"
    return parts, c, reason


def on_worlds(verdicts: list[str]) -> str:
    """'reproduced on k of K worlds' (and on how many not), from the per-world verdicts."""
    k, m = verdicts.count(REPRODUCED), verdicts.count(NOT_REPRODUCED)
    return f"reproduced on {k} of {len(verdicts)} worlds" + (f" (not reproduced on {m})" if m else "")


def across_worlds(pooled: str, verdicts: list[str]) -> str:
    """The claim's verdict over several worlds: WORLD_DEPENDENT when one world reproduces it and
    another does not, else the pooled test's."""
    return WORLD_DEPENDENT if REPRODUCED in verdicts and NOT_REPRODUCED in verdicts else pooled


def _brief(c: Comparison | None) -> str:
    margin = f" (margin ±{fmt(c.margin)})" if c is not None and c.margin == c.margin else ""
    return "" if c is None else f", {c.statistic} {fmt(c.estimate)} [{fmt(c.ci_low)}, {fmt(c.ci_high)}]{margin}"


def check_claims(data: AblationData, claims: list[Claim] | None = None) -> pd.DataFrame:
    """One row per claim (CLAIM_COLUMNS); the test columns are the deciding test's, `numbers` has
    every test's. Runs on several worlds: the tests pooled over worlds (module docstring), and
    `world_verdicts` (each world's verdict, in data.worlds order), `worlds` (on_worlds),
    `pooled_verdict`; the verdict is across_worlds'. One world: those three empty."""
    rows = []
    worlds = data.worlds if len(data.worlds) > 1 else []
    for claim in data.spec.claims if claims is None else claims:
        parts, c, reason = _judge(claim.rule, data)
        row = {"ablation": data.name, "figure": data.spec.figure, "claim": claim.statement, "source": claim.cited,
               "rule": RULE_CHECKS[type(claim.rule)][0](claim.rule), "verdict": c.verdict if c else INCONCLUSIVE,
               "numbers": "; ".join(f"{label}: {p.describe()}" for label, p in parts), "reason": reason,
               "worlds": "", "world_verdicts": None, "pooled_verdict": ""}
        if c is not None:
            row |= {k: getattr(c, k) for k in CLAIM_COLUMNS if hasattr(c, k)}
            row["n"] = f"{c.n_a}" + (f" vs {c.n_b}" if c.n_b else "")
        if worlds:
            judged = [_judge(claim.rule, data.in_world(w))[1] for w in worlds]
            per = [j.verdict if j else INCONCLUSIVE for j in judged]
            row |= {"worlds": on_worlds(per), "world_verdicts": per, "pooled_verdict": row["verdict"],
                    "verdict": across_worlds(row["verdict"], per)}
            row["numbers"] += "; per world: " + "; ".join(
                f"{data.world_label(w)}: {v}{_brief(j)}" for w, v, j in zip(worlds, per, judged))
        rows.append(row)
    return pd.DataFrame(rows, columns=CLAIM_COLUMNS)


CLAIMS_TABLE = "claims.json"
"""The claims table on a grid's parent run, in MLflow's table format (mlflow.load_table reads it)."""
TABLE_COLUMNS = ["claim", "source", "verdict", "worlds", "test", "statistic", "estimate", "interval", "ci_low",
                 "ci_high", "level", "margin", "n", "p_value", "reason"]
CLAIM_TAG = "harness.claim."
"""Per-claim tags on the parent run: `harness.claim.<k>` = the k-th claim's verdict (k from 1, two
digits), `harness.claim.<k>.text` = the claim."""


def log_claims(table: pd.DataFrame, tracking_uri: str, run_id: str) -> None:
    """A grid's claims on its parent run, where MLflow's UI shows them: the table artifact
    CLAIMS_TABLE (TABLE_COLUMNS; the interval at its level as text too), a verdict tag per claim
    (CLAIM_TAG; those of an older build's extra claims removed) and the metrics `claims/<verdict>`,
    how many claims have it, so runs filter (`tags."harness.claim.01" = 'reproduced'`) and sort by them."""
    t = table.assign(interval=[f"[{fmt(lo)}, {fmt(hi)}]" if pd.notna(lo) else "" for lo, hi in
                               zip(table["ci_low"], table["ci_high"])])[TABLE_COLUMNS]
    tracking.log_table(tracking_uri, run_id, t.astype(object).where(t.notna(), None), CLAIMS_TABLE)
    tags = {}
    for k, r in enumerate(table.itertuples(), 1):
        tags |= {f"{CLAIM_TAG}{k:02d}": r.verdict, f"{CLAIM_TAG}{k:02d}.text": r.claim}
    stale = [k for k in tracking.client(tracking_uri).get_run(run_id).data.tags if k.startswith(CLAIM_TAG) and k not in tags]
    tracking.delete_tags(tracking_uri, run_id, stale)
    tracking.set_tags(tracking_uri, run_id, tags)
    counts = table["verdict"].value_counts()
    names = {v: f"claims/{v.replace(' ', '_').replace('-', '_')}" for v in (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE,
                                                                          WORLD_DEPENDENT)}
    tracking.MetricLogger(tracking_uri, run_id).log({m: float(counts.get(v, 0)) for v, m in names.items()},
                                                    step=tracking.next_step(tracking_uri, run_id, names[REPRODUCED]))


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
        worlds = f"\n    worlds: {r.worlds}; pooled over them: {r.pooled_verdict}" if r.worlds else ""
        print(f"[{r.verdict}] {r.claim} ({r.source})\n    rule: {r.rule}\n    test: {r.test}\n    numbers: "
              f"{r.numbers or '–'}" + (f"\n    note: {r.reason}" if r.reason else "") + worlds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
