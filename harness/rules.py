"""The claims of a figure file (`claims:`) and the rules that decide them: each rule's `kind` picks
its section (RULES); analysis.claims holds the tests behind each one (docs/CONTRACTS.md).

    claims:
      - statement: "Global gradient clipping at 0, 0.5 and 1.0 is hard to tell apart."
        source: paper
        section: "App. C.2"
        rule:
          kind: similar
          metric: objective/rm_score
          variants: ["grad clip 0", "grad clip 0.5", "grad clip 1.0"]
          margin: {share: 0.1, of: "grad clip 1.0"}
          margin_reason: "..."
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Annotated, Any, Literal, Mapping

from pydantic import AfterValidator, Field

from . import keys as K
from .schema import Bool, ConfigError, Float, Pos, Str, closest, did_you_mean, one_of, section, validate

MetricKey = Annotated[str, one_of(tuple(K.KNOWN_METRICS), "a metric key of harness/keys.py")]
Stat = Literal["final", "initial", "rise", "peak", "mean", "volatility", "min"]
"""How one run's curve becomes one number (harness.summary.reduce_run)."""


def _one_line(text: str) -> str:
    if not text.strip() or "\n" in text.strip() or "\x00" in text:
        raise ValueError("allowed: one line of text (no line breaks or NUL bytes), e.g. why this is the smallest "
                         "difference that matters")
    return text.strip()


OneLine = Annotated[Str, AfterValidator(_one_line)]


@section
class OnMetric:
    """A rule about `stat` of `metric` (the rules' `kind` picks the class, see RULES)."""

    metric: MetricKey
    """What is compared."""
    _: dataclasses.KW_ONLY
    stat: Stat = "final"
    """How each run's curve becomes one number."""


@section
class Compare(OnMetric):
    """`stat` of `metric` is lower for variant `lower` than for variant `higher`."""

    lower: str
    """The variant claimed lower."""
    higher: str
    """The variant claimed higher."""


@section
class Margin:
    """The smallest difference that matters, for a `similar` claim: `abs` in the metric's own units, or
    `share` of the mean of the variant `of` (one of the claim's variants, e.g. the paper's setting)."""

    abs: Pos | None = None
    """The margin in the metric's units, e.g. 0.1 (an RM-score difference of 0.1)."""
    share: Annotated[Float, Field(gt=0, le=1)] | None = None
    """The margin as a share of the mean of `of` on the runs judged, e.g. 0.1 (a tenth of it): for a
    metric whose zero means something (KL, length; an RM score near 0 at the SFT model) and where that
    mean is positive (else the claim gets no verdict, and says why)."""
    of: str | None = None
    """The variant whose mean `share` is taken of (with `share` only)."""

    def __post_init__(self) -> None:
        if (self.abs is None) == (self.share is None) or (self.share is None) != (self.of is None):
            raise ValueError("allowed: {abs: NUMBER} (in the metric's units) or {share: NUMBER, of: VARIANT} "
                             "(a share of that variant's mean)")

    def resolve(self, means: Mapping[str, float]) -> float:
        """The margin in the metric's units; `means`: each variant's mean on the runs judged. ValueError
        when `of` has no positive mean there (a share of it would mean nothing)."""
        if self.abs is not None:
            return self.abs
        mean = means.get(self.of, math.nan)
        if not mean > 0:  # NaN too
            raise ValueError(f"margin: {self.share:g} of the mean of {self.of!r} needs that mean positive, got "
                             f"{mean:.4g}; give the margin in the metric's units instead (margin: {{abs: NUMBER}})")
        return self.share * mean

    def __str__(self) -> str:
        return f"±{self.abs:g}" if self.abs is not None else f"±{self.share * 100:g}% of the mean of {self.of!r}"


@section
class Similar(OnMetric):
    """`stat` of `metric` is equivalent for the `variants`: every pair's difference within ±`margin`
    (analysis.stats: two one-sided tests, TOST)."""

    variants: Annotated[list[str], Field(min_length=2)]
    """The variants claimed alike."""
    margin: Margin
    """The smallest difference that matters: {abs: NUMBER} in the metric's units, or {share: NUMBER, of:
    VARIANT}, a share of that variant's mean."""
    margin_reason: OneLine
    """Why that margin, in one line (what the claim means, and the smallest difference that would matter)."""


@section
class Trend(OnMetric):
    """`stat` of `metric` moves in `direction` as the config key `axis` grows across variants."""

    axis: str
    """A config key the variants set to numbers (e.g. ppo.kl_coef)."""
    direction: Literal["increasing", "decreasing"]
    """The claimed direction."""


@section
class Threshold(OnMetric):
    """`stat` of `metric` is above (op ">") or below ("<") `value`, for `variant` (null: every variant)."""

    op: Literal[">", "<"]
    """Above or below."""
    value: Float
    """The threshold."""
    variant: str | None = None
    """The variant (null: every variant with runs)."""


@section
class Collapses:
    """Runs of `variant` are marked collapsed (expected true) or not (expected false)."""

    variant: str
    """The variant."""
    expected: Bool = True
    """Whether the claim is that it collapses."""


@section
class PairsAboveChance:
    """Each reward model orders more than half of the held-out pairs as the labeler did (Fig. 2)."""


@section
class EvalScoresShift:
    """The held-out RM-score distribution's `what` grows from the first to the last eval step (Fig. 13)."""

    what: Literal["mean", "sd"] = "mean"
    """Which moment grows."""


RULES: dict[str, type] = {
    re.sub(r"(?<!^)(?=[A-Z])", "_", c.__name__).lower(): c  # PairsAboveChance -> pairs_above_chance
    for c in (Compare, Similar, Trend, Threshold, Collapses, PairsAboveChance, EvalScoresShift)
}
"""Rule `kind` -> its section."""


@section
class Claim:
    statement: Annotated[str, Field(min_length=1)]
    """The claim in words (the paper's, paraphrased, for `source: paper`)."""
    source: Literal["paper", "literature", "ours"]
    """paper: the Secrets-of-RLHF / APA paper states it (give its `section`); literature: another
    paper states it (give it in `section`, e.g. "Dr. GRPO, Liu et al. 2025, Sec. 3"); ours: our own
    check or an open question."""
    rule: Any
    """How the verdict is reached: in the file a mapping of `kind` (one of RULES) and that rule's
    parameters; once loaded, that RULES section."""
    section: str | None = None
    """The paper's section, e.g. "5.3.1" (required for source: paper), or the citation (literature)."""

    @property
    def cited(self) -> str:
        """'paper 5.3.1' or 'ours'."""
        return {"paper": f"paper {self.section}", "literature": f"{self.section}"}.get(self.source, "ours")



MARGIN_MISSING = ("{}; a `similar` claim states the smallest difference that matters, e.g. margin: {{abs: 0.1}} "
                  "(in the metric's units) or margin: {{share: 0.1, of: \"PPO-max\"}} (a share of that variant's mean), "
                  "and margin_reason: one line saying why")


def check_claims(entries: list[Claim], variants: list[Any], source: str, problems: list[str]) -> list[Claim]:
    """Validate each claim's rule (by kind) into its RULES section; every variant a rule names must be one
    of `variants` (the grid's, with .name and .settings), a margin's `of` one of the claim's. Each problem
    found is appended to `problems`."""
    names = [v.name for v in variants]
    out = []
    for i, entry in enumerate(entries):
        where = f"{source}: claims.{i}"
        if entry.source in ("paper", "literature") and not entry.section:
            problems.append(f"{where}.section: missing; a paper claim names the paper's section, e.g. \"5.3.1\"")
        params = dict(entry.rule) if isinstance(entry.rule, dict) else {}
        kind = params.pop("kind", None)
        if kind not in RULES:
            hit, typo = closest(kind, RULES), kind is None and closest("kind", map(str, params))
            got = f"missing ({typo!r} is not a key; did you mean kind?)" if typo else f"got {kind!r}"
            problems.append(f"{where}.rule.kind: {got}; allowed: {', '.join(RULES)}"
                            + (f" (did you mean {hit!r}?)" if hit else ""))
            continue
        try:
            rule = validate(RULES[kind], params, source, prefix=f"claims.{i}.rule.")
        except ConfigError as e:
            if RULES[kind] is Similar and "margin" not in params:  # the one place a missing margin is explained
                missing = f"{source}: claims.{i}.rule.margin: missing"
                e.problems = [MARGIN_MISSING.format(missing)] + [p for p in e.problems if not p.startswith(missing)]
            problems += e.problems
            continue
        named = [(f"variants.{j}", v) for j, v in enumerate(getattr(rule, "variants", []))]
        named += [(a, getattr(rule, a)) for a in ("lower", "higher", "variant") if getattr(rule, a, None) is not None]
        problems += [f"{where}.rule.{field}: got {v!r}; not a variant of this grid" + did_you_mean(v, names)
                     for field, v in named if v not in names]
        if isinstance(rule, Similar) and rule.margin.of is not None and rule.margin.of not in rule.variants:
            problems.append(f"{where}.rule.margin.of: got {rule.margin.of!r}; allowed: one of the claim's variants ("
                            + ", ".join(map(repr, rule.variants)) + ")")
        if isinstance(rule, Trend) and sum(rule.axis in v.settings for v in variants) < 2:
            varied = sorted({k for v in variants for k in v.settings})
            problems.append(f"{where}.rule.axis: got {rule.axis!r}; fewer than two variants set it"
                            + did_you_mean(rule.axis, varied))
        out.append(dataclasses.replace(entry, rule=rule))
    return out
