"""The claims of an ablation's YAML (`claims:`) as verdicts over its stored metrics, with numbers.

    python -m analysis.claims ABLATION [--tracking-uri URI] [--out results/]

Each claim is the paper's (with its section) or ours; its rule is one of the parameter sections
of harness.registry.RULES (the loader has checked that every variant it names is in the grid).

Verdicts: "reproduced", "not reproduced", "inconclusive". The rules:
- comparison of two variants (compare, and each neighbour pair of a trend): per run one number
  (final = mean of the last 10% of steps, see analysis.summary), then per variant mean and sample
  sd over seeds. gap = difference of means in the claimed direction; spread = pooled sd
  sqrt((sd_a^2 + sd_b^2) / 2). gap > MARGIN * spread: reproduced; gap < -MARGIN * spread: not
  reproduced; otherwise inconclusive (the seeds disagree more than the variants do). With one
  seed per variant there is no spread: the sign decides and the reason says so.
- similar: every pair of the variants within MARGIN pooled sds: reproduced; any pair beyond it:
  not reproduced; one seed: inconclusive (no spread to compare with).
- threshold: the same with the variant's mean against a fixed value and its own sd.
- collapses: share of seeds whose run was marked collapsed (tag or collapse/step);
  >= 2/3 counts as "collapses", <= 1/3 as "does not", between is inconclusive.
- within-run distributions (Fig. 2 pairs, Fig. 13 eval scores) have one run, so their spread is
  the sampling standard error of the statistic; |z| >= Z_SAMPLE decides.
A variant or metric the runs lack makes the claim inconclusive, with the reason.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from analysis.store import AblationData, default_tracking_uri, load_ablation
from analysis.summary import describe, fmt, run_stat
from harness import keys as K
from harness.registry import (
    Claim, Collapses, Compare, EvalScoresShift, PairsAboveChance, Similar, Threshold, Trend, UnknownAblation,
)

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
MARGIN = 1.0  # gap must beat this many pooled seed sds
Z_SAMPLE = 2.0  # within-run statistics: |difference| / standard error needed

STAT_WORDS = {
    "final": "final", "initial": "initial", "rise": "rise (final − initial) of", "peak": "peak",
    "mean": "mean", "volatility": "step-to-step volatility of", "min": "lowest",
}
METRIC_WORDS = {
    K.RM_SCORE: "RM score", K.GOLD_SCORE: "gold score", K.KL: "KL", K.PPL: "perplexity",
    K.PPL_TOKENS: "perplexity (token-pooled)", K.LENGTH: "length", K.VALUES: "values", K.ADV_RAW_STD: "raw advantage std",
    K.RM_EVAL_ACC: "RM eval accuracy", K.RM_TRAIN_ACC: "RM train accuracy", K.EVAL_WIN_RATE: "win rate vs SFT",
}


def _m(metric: str) -> str:
    return METRIC_WORDS.get(metric, metric)


@dataclass
class Outcome:
    verdict: str
    numbers: str
    reason: str = ""


def _no_runs(data: AblationData, variant: str) -> str | None:
    """Why a claim about `variant` cannot be judged (it has no runs), or None."""
    if variant in data.variants:
        return None
    return f"variant {variant!r} has no runs (variants with runs: {', '.join(data.variants) or 'none'})"


def _variant_values(data: AblationData, metric: str, stat: str, variant: str) -> dict[str, float]:
    metric = data.shown_metric(metric)  # the perplexity the figure shows
    per_run = run_stat(data.metrics(metric), metric, stat)
    return describe(per_run.loc[per_run["variant"] == variant, "value"])


def _desc(name: str, d: dict[str, float]) -> str:
    sd = f" ± {fmt(d['sd'], 2)}" if d["n"] > 1 else ""
    return f"{name}: {fmt(d['mean'])}{sd} (n={d['n']})"


def _judge_gap(gap: float, spread: float | None) -> tuple[str, str]:
    """Verdict for a gap in the claimed direction against a seed spread (None: one seed)."""
    if spread is None or not math.isfinite(spread):
        if gap == 0:
            return INCONCLUSIVE, "no difference"
        return (REPRODUCED if gap > 0 else NOT_REPRODUCED), "one seed: no spread, the sign decides"
    if spread == 0:
        return (INCONCLUSIVE, "no difference") if gap == 0 else (REPRODUCED if gap > 0 else NOT_REPRODUCED, "")
    z = gap / spread
    if z > MARGIN:
        return REPRODUCED, ""
    if z < -MARGIN:
        return NOT_REPRODUCED, ""
    return INCONCLUSIVE, f"gap within {MARGIN:g} pooled seed sd: seed spread too wide to tell"


def _pooled(a: dict[str, float], b: dict[str, float]) -> float | None:
    if a["n"] < 2 or b["n"] < 2:
        return None
    return math.sqrt((a["sd"] ** 2 + b["sd"] ** 2) / 2)


def _all_of(outcomes: list[Outcome]) -> str:
    """Reproduced when every part is; not reproduced when any part is not."""
    verdicts = [o.verdict for o in outcomes]
    return REPRODUCED if all(v == REPRODUCED for v in verdicts) else NOT_REPRODUCED if NOT_REPRODUCED in verdicts else INCONCLUSIVE


def _words(rule: Any) -> str:
    return f"{STAT_WORDS.get(rule.stat, rule.stat)} {_m(rule.metric)}"


def _compare_pair(rule: Any, data: AblationData, lo: str, hi: str) -> Outcome:
    """Is `stat` of `metric` lower for `lo` than for `hi`, by more than the pooled seed sd?"""
    a, b = (_variant_values(data, rule.metric, rule.stat, v) for v in (lo, hi))
    if a["n"] == 0 or b["n"] == 0:
        return Outcome(INCONCLUSIVE, "", f"{rule.metric} not logged by {lo if a['n'] == 0 else hi!r}")
    gap = b["mean"] - a["mean"]
    spread = _pooled(a, b)
    verdict, note = _judge_gap(gap, spread)
    numbers = f"{_desc(lo, a)}; {_desc(hi, b)}; gap {fmt(gap)}"
    numbers += f", pooled sd {fmt(spread, 2)}" if spread is not None else ""
    return Outcome(verdict, numbers, note)


def _compare(rule: Compare, data: AblationData) -> Outcome:
    why = _no_runs(data, rule.lower) or _no_runs(data, rule.higher)
    return Outcome(INCONCLUSIVE, "", why) if why else _compare_pair(rule, data, rule.lower, rule.higher)


def _similar(rule: Similar, data: AblationData) -> Outcome:
    why = next(filter(None, (_no_runs(data, v) for v in rule.variants)), None)
    if why:
        return Outcome(INCONCLUSIVE, "", why)
    stats = {v: _variant_values(data, rule.metric, rule.stat, v) for v in rule.variants}
    if any(d["n"] == 0 for d in stats.values()):
        return Outcome(INCONCLUSIVE, "", f"{rule.metric} not logged by every variant")
    numbers = "; ".join(_desc(v, d) for v, d in stats.items())
    spreads = [(abs(stats[a]["mean"] - stats[b]["mean"]), _pooled(stats[a], stats[b]))
               for i, a in enumerate(rule.variants) for b in rule.variants[i + 1:]]
    if any(sp is None or not math.isfinite(sp) for _, sp in spreads):
        return Outcome(INCONCLUSIVE, numbers, "one seed: no spread to tell alike from different")
    apart = any(gap > MARGIN * sp for gap, sp in spreads)
    return Outcome(NOT_REPRODUCED if apart else REPRODUCED, numbers, "")


def _trend(rule: Trend, data: AblationData) -> Outcome:
    found = sorted((float(v.settings[rule.axis]), v.name) for v in data.spec.variants
                   if rule.axis in v.settings and v.name in data.variants)
    if len(found) < 2:
        return Outcome(INCONCLUSIVE, "", f"fewer than two variants with runs set {rule.axis} "
                                         f"(variants with runs: {', '.join(data.variants) or 'none'})")
    pairs = [(b, a) if rule.direction == "decreasing" else (a, b) for (_, a), (_, b) in zip(found, found[1:])]
    outcomes = [_compare_pair(rule, data, lo, hi) for lo, hi in pairs]
    descs = [_desc(v, _variant_values(data, rule.metric, rule.stat, v)) for _, v in found]
    return Outcome(_all_of(outcomes), "; ".join(descs), "; ".join(sorted({o.reason for o in outcomes if o.reason})))


def _threshold(rule: Threshold, data: AblationData) -> Outcome:
    why = _no_runs(data, rule.variant) if rule.variant is not None else None
    if why:
        return Outcome(INCONCLUSIVE, "", why)
    names = [rule.variant] if rule.variant is not None else data.variants
    if not names:
        return Outcome(INCONCLUSIVE, "", "no runs")
    outcomes = []
    for v in names:
        d = _variant_values(data, rule.metric, rule.stat, v)
        if d["n"] == 0:
            return Outcome(INCONCLUSIVE, "; ".join(o.numbers for o in outcomes), f"{rule.metric} not logged by {v!r}")
        verdict, note = _judge_gap((d["mean"] - rule.value) * (1 if rule.op == ">" else -1), d["sd"] if d["n"] > 1 else None)
        outcomes.append(Outcome(verdict, _desc(v, d), note))
    return Outcome(_all_of(outcomes), "; ".join(o.numbers for o in outcomes),
                   "; ".join(sorted({o.reason for o in outcomes if o.reason})))


def _collapses(rule: Collapses, data: AblationData) -> Outcome:
    why = _no_runs(data, rule.variant)
    if why:
        return Outcome(INCONCLUSIVE, "", why)
    runs = data.runs[data.runs["variant"] == rule.variant]
    k, n = int(runs["collapsed"].sum()), len(runs)
    steps = runs.loc[runs["collapsed"], "collapse_step"].dropna()
    failed = int(runs["status"].eq("FAILED").sum())
    numbers = f"{rule.variant}: {k}/{n} seeds collapsed"
    numbers += f" (steps {', '.join(fmt(s) for s in sorted(steps))})" if len(steps) else ""
    numbers += f"; {failed} run(s) FAILED" if failed else ""
    share = k / n
    if share >= 2 / 3:
        verdict = REPRODUCED if rule.expected else NOT_REPRODUCED
    elif share <= 1 / 3:
        verdict = NOT_REPRODUCED if rule.expected else REPRODUCED
    else:
        verdict = INCONCLUSIVE
    return Outcome(verdict, numbers, "seeds split" if verdict == INCONCLUSIVE else "")


def _z_verdict(z: float) -> str:
    """A sampling z-score against Z_SAMPLE, either way."""
    return REPRODUCED if z >= Z_SAMPLE else NOT_REPRODUCED if z <= -Z_SAMPLE else INCONCLUSIVE


def _per_run_outcome(verdicts: list[str], numbers: list[str], none_reason: str) -> Outcome:
    """Reproduced only when every run's verdict is; not reproduced when any run's is."""
    if not verdicts:
        return Outcome(INCONCLUSIVE, "", none_reason)
    return Outcome(_all_of([Outcome(v, "") for v in verdicts]), "; ".join(numbers))


def _pairs_above_chance(rule: PairsAboveChance, data: AblationData) -> Outcome:
    verdicts, numbers = [], []
    for v in data.variants:
        diffs = []
        for rid in data.runs.loc[data.runs["variant"] == v, "run_id"]:
            diffs += data.rm_score_diff(rid)
        if not diffs:
            return Outcome(INCONCLUSIVE, "; ".join(numbers), f"{v!r} has no {K.RM_SCORE_DIFF} artifact")
        d = np.asarray(diffs, dtype=float)
        p, n = float(np.mean(d > 0)), len(d)
        z = (p - 0.5) / math.sqrt(0.25 / n)
        verdicts.append(_z_verdict(z))
        numbers.append(f"{v}: {p:.1%} of {n} pairs > 0, mean diff {fmt(float(d.mean()))}, z={z:.1f}")
    return _per_run_outcome(verdicts, numbers, "no reward-model runs")


def _eval_scores_shift(rule: EvalScoresShift, data: AblationData) -> Outcome:
    """Seeds pooled; first vs last eval step with within-run standard errors."""
    verdicts, numbers = [], []
    for v in data.variants:
        by_step: dict[int, list[float]] = {}
        for rid in data.runs.loc[data.runs["variant"] == v, "run_id"]:
            for step, s in data.eval_scores(rid).items():
                by_step.setdefault(step, []).extend(s["rm"])
        steps = sorted(s for s, x in by_step.items() if len(x) > 1)
        if len(steps) < 2:
            return Outcome(INCONCLUSIVE, "; ".join(numbers), f"{v!r}: fewer than two eval steps with RM scores")
        a, b = (np.asarray(by_step[s], dtype=float) for s in (steps[0], steps[-1]))
        if rule.what == "mean":
            va, vb = a.mean(), b.mean()
            se = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
        else:
            va, vb = a.std(ddof=1), b.std(ddof=1)
            se = math.sqrt(va ** 2 / (2 * (len(a) - 1)) + vb ** 2 / (2 * (len(b) - 1)))
        z = (vb - va) / se if se > 0 else (math.inf if vb > va else -math.inf if vb < va else 0.0)
        verdicts.append(_z_verdict(z))
        numbers.append(f"{v}: {rule.what} step {steps[0]} {fmt(float(va))} -> step {steps[-1]} {fmt(float(vb))}, z={z:.1f}")
    return _per_run_outcome(verdicts, numbers, "no runs")


SD = f"by > {MARGIN:g} pooled seed sd"
RULE_TEXT: dict[type, Callable[[Any], str]] = {
    Compare: lambda r: f"{_words(r)}: '{r.lower}' < '{r.higher}' {SD}",
    Similar: lambda r: f"{_words(r)}: every pair of {', '.join(repr(v) for v in r.variants)} within {MARGIN:g} pooled seed sd",
    Trend: lambda r: f"{_words(r)} {r.direction} in {r.axis}: every neighbour pair {SD}",
    Threshold: lambda r: (f"{_words(r)} {r.op} {r.value:g} for {repr(r.variant) if r.variant else 'every variant'}, "
                          f"by > {MARGIN:g} seed sd"),
    Collapses: lambda r: (f"'{r.variant}': {'≥ 2/3' if r.expected else '≤ 1/3'} of seeds marked collapsed "
                          f"(tag {K.TAG_COLLAPSED} or metric {K.COLLAPSE_STEP})"),
    PairsAboveChance: lambda r: (f"share of held-out pairs with chosen − rejected > 0 above 0.5 for every RM, "
                                 f"z ≥ {Z_SAMPLE:g} (binomial s.e.)"),
    EvalScoresShift: lambda r: f"{r.what} of held-out RM scores: last eval step > first, z ≥ {Z_SAMPLE:g} (sampling s.e.)",
}
"""Each rule kind (harness.registry.RULES) in words."""
EVALUATE: dict[type, Callable[[Any, AblationData], Outcome]] = {
    Compare: _compare, Similar: _similar, Trend: _trend, Threshold: _threshold, Collapses: _collapses,
    PairsAboveChance: _pairs_above_chance, EvalScoresShift: _eval_scores_shift,
}
"""Each rule kind's verdict."""


def describe_rule(rule: Any) -> str:
    return RULE_TEXT[type(rule)](rule)


CLAIM_COLUMNS = ["ablation", "figure", "claim", "source", "rule", "verdict", "numbers", "reason"]


def check_claims(data: AblationData, claims: list[Claim] | None = None) -> pd.DataFrame:
    """One row per claim of the ablation's YAML (or `claims`), CLAIM_COLUMNS; source is
    'paper <section>' or 'ours'."""
    rows = []
    for claim in data.spec.claims if claims is None else claims:
        if data.runs.empty:
            outcome = Outcome(INCONCLUSIVE, "", "no runs in the store")
        else:
            outcome = EVALUATE[type(claim.rule)](claim.rule, data)
        rows.append({
            "ablation": data.name, "figure": data.spec.figure, "claim": claim.statement, "source": claim.cited,
            "rule": describe_rule(claim.rule), "verdict": outcome.verdict, "numbers": outcome.numbers, "reason": outcome.reason,
        })
    return pd.DataFrame(rows, columns=CLAIM_COLUMNS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m analysis.claims",
        description="Check the paper's claims for an ablation against its runs in the MLflow store; prints one "
                    "verdict per claim (reproduced / not reproduced / inconclusive) with the numbers.",
    )
    ap.add_argument("ablation", help="registry name or YAML path (its `claims:` are checked)")
    ap.add_argument("--tracking-uri", default=None, help="MLflow store (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    ap.add_argument("--ablations-dir", default=None, help="registry folder (default: the repo's ablations/)")
    ap.add_argument("--out", default=None, help="also write OUT/<ablation>/claims.csv")
    args = ap.parse_args(argv)
    try:
        data = load_ablation(args.ablation, args.tracking_uri or default_tracking_uri(), args.ablations_dir)
    except UnknownAblation as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = check_claims(data)
    if table.empty:
        print(f"{data.name}: no claims in its YAML")
        return 0
    for _, r in table.iterrows():
        print(f"[{r.verdict}] {r.claim} ({r.source})\n    rule: {r.rule}\n    numbers: {r.numbers or '–'}"
              + (f"\n    note: {r.reason}" if r.reason else ""))
    if args.out:
        path = Path(args.out) / data.name / "claims.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(path, index=False)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
