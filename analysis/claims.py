"""The papers' claims as rules over an ablation's stored metrics, each with a verdict and its numbers.

    python -m analysis.claims ABLATION [--tracking-uri URI] [--out reports/]

Every claim lives in the CLAIMS table below, keyed by registry name; a claim names variants as
the registry does (aliases allowed, matched up to case/spacing/Greek spelling, never fuzzily).

Verdicts: "reproduced", "not reproduced", "inconclusive". The rules:
- comparison of two variants (Compare, and each neighbour pair of a Trend): per run one number
  (final = mean of the last 10% of steps, see analysis.summary), then per variant mean and sample
  sd over seeds. gap = difference of means in the claimed direction; spread = pooled sd
  sqrt((sd_a^2 + sd_b^2) / 2). gap > MARGIN * spread: reproduced; gap < -MARGIN * spread: not
  reproduced; otherwise inconclusive (the seeds disagree more than the variants do). With one
  seed per variant there is no spread: the sign decides and the reason says so.
- threshold (Threshold): the same with the variant's mean against a fixed value and its own sd.
- collapse (Collapses): share of seeds whose run was marked collapsed (tag or collapse/step);
  >= 2/3 counts as "collapses", <= 1/3 as "does not", between is inconclusive.
- within-run distributions (Fig. 2 pairs, Fig. 13 eval scores) have one run, so their spread is
  the sampling standard error of the statistic; |z| >= Z_SAMPLE decides.
A variant or metric the runs lack makes the claim inconclusive, with the reason.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.spec import UnknownAblation, match_variant
from analysis.store import AblationData, default_tracking_uri, load_ablation
from analysis.summary import describe, fmt, run_stat
from harness import keys as K

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
MARGIN = 1.0  # gap must beat this many pooled seed sds
Z_SAMPLE = 2.0  # within-run statistics: |difference| / standard error needed

STAT_WORDS = {
    "final": "final", "initial": "initial", "rise": "rise (final − initial) of", "peak": "peak",
    "mean": "mean", "volatility": "step-to-step volatility of", "min": "lowest",
}
METRIC_WORDS = {
    K.RM_SCORE: "RM score", K.GOLD_SCORE: "gold score", K.KL: "KL", K.PPL: "perplexity", K.PPL_TOKENS: "perplexity (token-pooled)", K.LENGTH: "length",
    K.VALUES: "values", K.ADV_RAW_STD: "raw advantage std", K.RM_EVAL_ACC: "RM eval accuracy",
    K.RM_TRAIN_ACC: "RM train accuracy",
}


def _m(metric: str) -> str:
    return METRIC_WORDS.get(metric, metric)


@dataclass
class Outcome:
    verdict: str
    numbers: str
    reason: str = ""


def _alias_text(sel) -> str:
    return sel if isinstance(sel, str) else sel[0]


def _pick(data: AblationData, sel) -> tuple[str | None, str]:
    """The run's spelling of a registry variant (or alias list); else (None, reason)."""
    name = match_variant(sel, data.variants)
    if name is None:
        return None, f"variant {_alias_text(sel)!r} has no runs (variants with runs: {', '.join(data.variants) or 'none'})"
    return name, ""


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


class Rule:
    def describe(self) -> str:
        raise NotImplementedError

    def evaluate(self, data: AblationData) -> Outcome:
        raise NotImplementedError


@dataclass
class Compare(Rule):
    """`stat` of `metric` is lower for variant `lower` than for variant `higher`."""

    metric: str
    lower: str | tuple[str, ...]
    higher: str | tuple[str, ...]
    stat: str = "final"

    def describe(self) -> str:
        return (f"{STAT_WORDS.get(self.stat, self.stat)} {_m(self.metric)}: '{_alias_text(self.lower)}' < "
                f"'{_alias_text(self.higher)}' by > {MARGIN:g} pooled seed sd")

    def compare(self, data: AblationData, lo: str, hi: str) -> Outcome:
        a, b = (_variant_values(data, self.metric, self.stat, v) for v in (lo, hi))
        if a["n"] == 0 or b["n"] == 0:
            return Outcome(INCONCLUSIVE, "", f"{self.metric} not logged by {lo if a['n'] == 0 else hi!r}")
        gap = b["mean"] - a["mean"]
        spread = _pooled(a, b)
        verdict, note = _judge_gap(gap, spread)
        numbers = f"{_desc(lo, a)}; {_desc(hi, b)}; gap {fmt(gap)}"
        numbers += f", pooled sd {fmt(spread, 2)}" if spread is not None else ""
        return Outcome(verdict, numbers, note)

    def evaluate(self, data: AblationData) -> Outcome:
        lo, why_lo = _pick(data, self.lower)
        hi, why_hi = _pick(data, self.higher)
        if lo is None or hi is None:
            return Outcome(INCONCLUSIVE, "", why_lo or why_hi)
        return self.compare(data, lo, hi)


@dataclass
class Trend(Rule):
    """`stat` of `metric` moves in `direction` as the number in the variant names grows.

    `number` is a regex with one group that reads the knob from a variant name, e.g. r"η=([\\d.]+)"."""

    metric: str
    number: str
    direction: str  # "decreasing" | "increasing"
    stat: str = "final"
    knob: str = ""

    def describe(self) -> str:
        return (f"{STAT_WORDS.get(self.stat, self.stat)} {_m(self.metric)} {self.direction} in {self.knob or self.number}: "
                f"every neighbour pair by > {MARGIN:g} pooled seed sd")

    def evaluate(self, data: AblationData) -> Outcome:
        found = []
        for v in data.variants:
            m = re.search(self.number, v)
            if m:
                try:
                    found.append((float(m.group(1)), v))
                except ValueError:
                    continue
        if len(found) < 2:
            return Outcome(INCONCLUSIVE, "", f"fewer than two variants name {self.knob or self.number} "
                                             f"(variants with runs: {', '.join(data.variants) or 'none'})")
        found.sort()
        outcomes = []
        for (_, a), (_, b) in zip(found, found[1:]):
            lo, hi = (b, a) if self.direction == "decreasing" else (a, b)
            outcomes.append(Compare(self.metric, lo, hi, self.stat).compare(data, lo, hi))
        verdicts = [o.verdict for o in outcomes]
        if all(v == REPRODUCED for v in verdicts):
            verdict = REPRODUCED
        elif NOT_REPRODUCED in verdicts:
            verdict = NOT_REPRODUCED
        else:
            verdict = INCONCLUSIVE
        descs = [_desc(v, _variant_values(data, self.metric, self.stat, v)) for _, v in found]
        reasons = sorted({o.reason for o in outcomes if o.reason})
        return Outcome(verdict, "; ".join(descs), "; ".join(reasons))


@dataclass
class Threshold(Rule):
    """`stat` of `metric` is above (op ">") or below ("<") `value`, for `variant` (None: every
    variant with runs)."""

    metric: str
    op: str
    value: float
    stat: str = "final"
    variant: str | tuple[str, ...] | None = None

    def describe(self) -> str:
        who = f"'{_alias_text(self.variant)}'" if self.variant else "every variant"
        return f"{STAT_WORDS.get(self.stat, self.stat)} {_m(self.metric)} {self.op} {self.value:g} for {who}, by > {MARGIN:g} seed sd"

    def evaluate(self, data: AblationData) -> Outcome:
        if self.variant is not None:
            name, why = _pick(data, self.variant)
            if name is None:
                return Outcome(INCONCLUSIVE, "", why)
            names = [name]
        else:
            names = data.variants
        if not names:
            return Outcome(INCONCLUSIVE, "", "no runs")
        verdicts, numbers, notes = [], [], set()
        for v in names:
            d = _variant_values(data, self.metric, self.stat, v)
            if d["n"] == 0:
                return Outcome(INCONCLUSIVE, "; ".join(numbers), f"{self.metric} not logged by {v!r}")
            gap = (d["mean"] - self.value) * (1 if self.op == ">" else -1)
            verdict, note = _judge_gap(gap, d["sd"] if d["n"] > 1 else None)
            verdicts.append(verdict)
            numbers.append(_desc(v, d))
            if note:
                notes.add(note)
        if all(v == REPRODUCED for v in verdicts):
            verdict = REPRODUCED
        elif NOT_REPRODUCED in verdicts:
            verdict = NOT_REPRODUCED
        else:
            verdict = INCONCLUSIVE
        return Outcome(verdict, "; ".join(numbers), "; ".join(sorted(notes)))


@dataclass
class Collapses(Rule):
    """Runs of `variant` are marked collapsed (expected=True) or not (expected=False)."""

    variant: str | tuple[str, ...]
    expected: bool = True

    def describe(self) -> str:
        return (f"'{_alias_text(self.variant)}': {'≥ 2/3' if self.expected else '≤ 1/3'} of seeds marked collapsed "
                f"(tag {K.TAG_COLLAPSED} or metric {K.COLLAPSE_STEP})")

    def evaluate(self, data: AblationData) -> Outcome:
        name, why = _pick(data, self.variant)
        if name is None:
            return Outcome(INCONCLUSIVE, "", why)
        runs = data.runs[data.runs["variant"] == name]
        k, n = int(runs["collapsed"].sum()), len(runs)
        steps = runs.loc[runs["collapsed"], "collapse_step"].dropna()
        failed = int(runs["status"].eq("FAILED").sum())
        numbers = f"{name}: {k}/{n} seeds collapsed"
        numbers += f" (steps {', '.join(fmt(s) for s in sorted(steps))})" if len(steps) else ""
        numbers += f"; {failed} run(s) FAILED" if failed else ""
        share = k / n
        if share >= 2 / 3:
            verdict = REPRODUCED if self.expected else NOT_REPRODUCED
        elif share <= 1 / 3:
            verdict = NOT_REPRODUCED if self.expected else REPRODUCED
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
    verdict = REPRODUCED if all(x == REPRODUCED for x in verdicts) else NOT_REPRODUCED if NOT_REPRODUCED in verdicts else INCONCLUSIVE
    return Outcome(verdict, "; ".join(numbers))


@dataclass
class PairsAboveChance(Rule):
    """Fig. 2: each RM scores chosen above rejected on more than half of the held-out pairs."""

    def describe(self) -> str:
        return f"share of held-out pairs with chosen − rejected > 0 above 0.5 for every RM, z ≥ {Z_SAMPLE:g} (binomial s.e.)"

    def evaluate(self, data: AblationData) -> Outcome:
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


@dataclass
class EvalScoresShift(Rule):
    """Fig. 13: from the first to the last eval step the held-out RM score distribution's
    `what` ("mean" or "sd") grows; seeds pooled, within-run standard errors."""

    what: str = "mean"

    def describe(self) -> str:
        return f"{self.what} of held-out RM scores: last eval step > first, z ≥ {Z_SAMPLE:g} (sampling s.e.)"

    def evaluate(self, data: AblationData) -> Outcome:
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
            if self.what == "mean":
                va, vb = a.mean(), b.mean()
                se = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
            else:
                va, vb = a.std(ddof=1), b.std(ddof=1)
                se = math.sqrt(va ** 2 / (2 * (len(a) - 1)) + vb ** 2 / (2 * (len(b) - 1)))
            z = (vb - va) / se if se > 0 else (math.inf if vb > va else -math.inf if vb < va else 0.0)
            verdicts.append(_z_verdict(z))
            numbers.append(f"{v}: {self.what} step {steps[0]} {fmt(float(va))} -> step {steps[-1]} {fmt(float(vb))}, z={z:.1f}")
        return _per_run_outcome(verdicts, numbers, "no runs")


@dataclass
class Claim:
    text: str
    rule: Rule


# --------------------------------------------------------------------------------------------
# The claims, per registry name. Variant names are the registry's (ablations/*.yaml).
# --------------------------------------------------------------------------------------------
FIGURE_OF = {
    "rm_scores": "2", "rm_accuracy": "3", "vanilla": "4", "score_reparam": "6", "policy_constraints": "7",
    "ppo_max": "8", "ppo_max_long": "9", "rm_score_dist": "13", "adv_value_clip": "14", "kl_eta": "15",
    "entropy": "16", "value_clip": "17", "grad_clip": "18", "gae_lambda": "19", "apa": "apa",
}
_ETA = r"η\s*=\s*([0-9.]+)"
_LAMBDA = r"λ\s*=\s*([0-9.]+)"
_GRAD_CLIP = r"grad(?:ient)? clip\s*([0-9.]+)"
_RN_VC = "reward norm δ_r=0.8, value clip δ_vf=0.2"

CLAIMS: dict[str, list[Claim]] = {
    "rm_scores": [
        Claim("The reward model scores the chosen response above the rejected one on most held-out pairs.",
              PairsAboveChance()),
    ],
    "rm_accuracy": [
        Claim("The RM's held-out accuracy beats chance.", Threshold(K.RM_EVAL_ACC, ">", 0.5)),
        Claim("The RM's training accuracy beats chance.", Threshold(K.RM_TRAIN_ACC, ">", 0.5)),
    ],
    "vanilla": [
        Claim("Vanilla PPO collapses.", Collapses("vanilla PPO")),
        Claim("The RM score keeps rising under vanilla PPO.", Threshold(K.RM_SCORE, ">", 0.0, "rise", "vanilla PPO")),
        Claim("Perplexity falls (toward 1) under vanilla PPO.", Threshold(K.PPL, "<", 0.0, "rise", "vanilla PPO")),
    ],
    "score_reparam": [
        Claim("Reward normalization with δ=0.8 keeps KL below reward scaling alone.",
              Compare(K.KL, "reward normalize, δ=0.8", "reward scale")),
        Claim("Reward scaling alone still collapses.", Collapses("reward scale")),
        Claim("Reward normalization with δ=0.8 keeps training stable (no collapse).",
              Collapses("reward normalize, δ=0.8", expected=False)),
    ],
    "policy_constraints": [
        Claim("The KL penalty keeps training stable (no collapse).", Collapses("KL penalty", expected=False)),
        Claim("The KL penalty keeps KL below importance sampling alone.", Compare(K.KL, "KL penalty", "importance sample")),
    ],
    "ppo_max": [
        Claim("PPO-max trains without collapse.", Collapses("PPO-max", expected=False)),
        Claim("Initializing the policy from the pretrained (non-SFT) model reaches a lower RM score than PPO-max.",
              Compare(K.RM_SCORE, "policy init from pretrained", "PPO-max")),
    ],
    "ppo_max_long": [
        Claim("PPO-max stays stable over a long run (no collapse).", Collapses("PPO-max", expected=False)),
        Claim("PPO-max's RM score rises over the long run.", Threshold(K.RM_SCORE, ">", 0.0, "rise", "PPO-max")),
    ],
    "rm_score_dist": [
        Claim("The held-out RM score distribution moves up as training proceeds.", EvalScoresShift("mean")),
        Claim("The held-out RM score distribution widens (a long tail grows) as training proceeds.", EvalScoresShift("sd")),
    ],
    "adv_value_clip": [
        Claim("Reward normalization + clipping with value clipping trains without collapse.",
              Collapses((_RN_VC, "reward norm δ_r=0.8 + δ_vf=0.2"), expected=False)),
        Claim("With advantage normalization and value clipping, reward normalization keeps KL below reward scaling.",
              Compare(K.KL, "reward norm δ_r=0.8, adv norm δ_a=0.8, value clip δ_vf=0.2",
                      "reward scale, adv norm δ_a=0.8, value clip δ_vf=0.2")),
    ],
    "kl_eta": [
        Claim("A larger KL penalty η keeps KL lower.", Trend(K.KL, _ETA, "decreasing", knob="η")),
        Claim("A larger KL penalty η costs RM score.", Trend(K.RM_SCORE, _ETA, "decreasing", knob="η")),
    ],
    "entropy": [
        Claim("The clipped entropy bonus trains without collapse.", Collapses("entropy bonus, clip δ=30", expected=False)),
        Claim("Clipping the entropy bonus keeps KL below the unclipped bonus.",
              Compare(K.KL, "entropy bonus, clip δ=30", "entropy bonus")),
    ],
    "value_clip": [
        Claim("Value-loss clipping keeps the critic's values steadier than no clipping.",
              Compare(K.VALUES, "KL penalty", "no clip", stat="volatility")),
    ],
    "grad_clip": [
        Claim("Global gradient clipping (1.0) keeps the critic's values steadier than no clipping.",
              Compare(K.VALUES, "grad clip 1.0", "grad clip 0", stat="volatility")),
    ],
    "gae_lambda": [
        Claim("Larger GAE λ gives higher-variance advantages (λ=1: Monte-Carlo returns).",
              Trend(K.ADV_RAW_STD, _LAMBDA, "increasing", knob="λ")),
        Claim("λ=0.9 reaches a higher RM score than one-step TD (λ=0).", Compare(K.RM_SCORE, "λ=0.0", "λ=0.9")),
    ],
    "apa": [
        Claim("APA stays closer to the initial policy (lower KL) than PPO at equal samples.", Compare(K.KL, "APA", "PPO")),
        Claim("APA keeps KL steadier than PPO.", Compare(K.KL, "APA", "PPO", stat="volatility")),
        Claim("APA reaches a higher RM score than PPO at equal samples.", Compare(K.RM_SCORE, "PPO", "APA")),
        Claim("APA reaches a higher RM score than AWR at equal samples.", Compare(K.RM_SCORE, "AWR", "APA")),
    ],
}

CLAIM_COLUMNS = ["ablation", "figure", "claim", "rule", "verdict", "numbers", "reason"]


def check_claims(data: AblationData, claims: dict[str, list[Claim]] | None = None) -> pd.DataFrame:
    """One row per claim of the ablation (CLAIM_COLUMNS); empty when the table holds none."""
    table = CLAIMS if claims is None else claims
    rows = []
    for claim in table.get(data.name, []):
        if data.runs.empty:
            outcome = Outcome(INCONCLUSIVE, "", "no runs in the store")
        else:
            outcome = claim.rule.evaluate(data)
        rows.append({
            "ablation": data.name, "figure": data.spec.figure or FIGURE_OF.get(data.name, ""), "claim": claim.text,
            "rule": claim.rule.describe(), "verdict": outcome.verdict, "numbers": outcome.numbers, "reason": outcome.reason,
        })
    return pd.DataFrame(rows, columns=CLAIM_COLUMNS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m analysis.claims",
        description="Check the paper's claims for an ablation against its runs in the MLflow store; prints one "
                    "verdict per claim (reproduced / not reproduced / inconclusive) with the numbers.",
    )
    ap.add_argument("ablation", help=f"registry name or YAML path; claims exist for: {', '.join(CLAIMS)}")
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
        print(f"{data.name}: no claims defined (claims exist for: {', '.join(CLAIMS)})")
        return 0
    for _, r in table.iterrows():
        print(f"[{r.verdict}] {r.claim}\n    rule: {r.rule}\n    numbers: {r.numbers or '–'}"
              + (f"\n    note: {r.reason}" if r.reason else ""))
    if args.out:
        path = Path(args.out) / data.name / "claims.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(path, index=False)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
