"""The one-factor claims of the figure files beside what a design study says about them: agrees,
contradicts, or cannot say (with why).

A figure file tests a claim on variants that change one or two tricks from a fixed base. Here each
variant becomes a point of the design: its value of every choice (a group by the settings it matches,
a dependent choice not drawn where the variant's own values leave its `when` unmet). The claim's
variants differ in some choices; the configurations of the study that take the claimed side's values
of exactly those choices, whatever the others, are compared with those taking the other side's, by
the claim's own rule and the same tests as the one-factor verdicts (analysis.stats; one number per
configuration: the mean over its runs; a collapse rate over runs):
compare and trend (each neighbour pair): permutation test of the difference of means; similar: every
pair equivalent within the claim's margin (analysis.claims.equivalence: TOST; a share of a variant's mean
is of its mean over the matching configurations); threshold: one-sample t-test; collapses: exact binomial test against 1/2.
reproduced -> agrees, not reproduced -> contradicts, inconclusive -> cannot say. A claim cannot be
judged when its variants differ in a setting the study does not vary, take a value the design does
not draw, or name only the figure's base (no trick).
"""
from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.claims import RANK, Unjudged, equivalence
from analysis.stats import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    Comparison,
    censor,
    compare,
    compare_to,
    rate_vs_half,
)
from analysis.tricks_data import NOT_DRAWN, StudyData
from harness import design, tracking
from harness import keys as K
from harness.config import computed_fields
from harness.registry import REPO_ROOT, RegistryError, load_registry, registry_files
from harness.rules import Collapses, Compare, Similar, Threshold, Trend
from harness.summary import by_step, reduce_run

REFERENCE = REPO_ROOT / "reports" / "reference.json"
SAYS = {REPRODUCED: "agrees", NOT_REPRODUCED: "contradicts", INCONCLUSIVE: "cannot say"}
COLUMNS = ["figure_file", "figure", "claim", "source", "one_factor", "design", "test", "says", "reason"]
IGNORED = ("seed", "data.world_dir", "ppo.steps")  # where a figure's runs differ from the study's regardless


class CannotSay(Exception):
    """Why the design cannot judge a claim."""


def point(d: StudyData, flat: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """A config's labels in the design (NOT_DRAWN where a `when` is unmet), and the choices whose value the
    design never draws."""
    space, raw, labels, outside = d.attr["search_space"], {}, {}, []
    for key in design.order(space):
        dim = space[key]
        if not design.is_active(dim, raw):
            labels[key] = NOT_DRAWN
            continue
        if dim.get("group"):
            hit = [g for g, sets in dim["group"].items() if all(design.same(flat.get(k), v) for k, v in sets.items())]
        else:
            hit = [c for c in dim.get("choices") or [] if design.same(flat.get(key), c)]
        if not hit:
            shown = (", ".join(f"{k}={flat.get(k)!r}" for k in sorted({k for sets in dim["group"].values() for k in sets}))
                     if dim.get("group") else f"{key}={flat.get(key)!r}")
            outside.append(f"{key} ({shown})")
            labels[key] = f"(outside the design: {shown})"  # two values outside it stay two values
            continue
        raw[key], labels[key] = hit[0], design.label(hit[0])
    return labels, outside


def covered(d: StudyData) -> set[str]:
    """The config keys the study sets: its choices' keys and every key of a group's settings."""
    out = set()
    for key, dim in d.attr["search_space"].items():
        out |= {k for sets in dim["group"].values() for k in sets} if dim.get("group") else {key}
    return out


class ClaimJudge:
    """Per-configuration numbers of any metric and statistic (objectives from the study, the rest read
    from the runs in MLflow once per metric), and the configurations matching a variant."""

    def __init__(self, d: StudyData):
        self.d = d
        self.cache: dict[tuple[str, str], pd.Series] = {}
        self.by_objective = {(o.get("metric"), o["stat"]): o["name"] for o in d.objectives}

    def per_config(self, metric: str, stat: str) -> pd.Series:
        """number -> the mean over the configuration's runs of `stat` of `metric`."""
        if (metric, stat) in self.by_objective:
            name = self.by_objective[(metric, stat)]
            return self.d.configs.set_index("number")[name]
        if (metric, stat) not in self.cache:
            runs = self.d.runs
            if metric == K.COLLAPSE_STEP:  # censored at the step budget (RMST), as analysis.claims
                steps = self._histories(metric)
                budget = float(self.d.attr.get("steps") or np.nanmax([s[-1][0] for s in steps.values() if s] or [1]))
                values = censor([steps[r][-1][1] if steps.get(r) else None for r in runs["run_id"]], budget)
            else:
                hist = self._histories(metric)
                values = [reduce_run(by_step(hist.get(r, [])), stat) for r in runs["run_id"]]
            self.cache[(metric, stat)] = pd.Series(values, index=runs["number"]).groupby(level=0).mean()
        return self.cache[(metric, stat)]

    def _histories(self, metric: str) -> dict[str, list[tuple[int, float]]]:
        ids = list(self.d.runs["run_id"])
        with ThreadPoolExecutor(max_workers=8) as pool:  # the sqlite store costs a call per run and key
            found = pool.map(lambda r: tracking.metric_history(self.d.tracking_uri, r, metric), ids)
        return dict(zip(ids, found))

    def matching(self, labels: dict[str, str], choices: list[str]) -> np.ndarray:
        """Trial numbers of the configurations taking `labels` on every one of `choices`."""
        c = self.d.configs
        mask = np.ones(len(c), bool)
        for k in choices:
            mask &= (c[k] == labels[k]).to_numpy()
        return c["number"].to_numpy()[mask]


def _differ(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return [k for k in a if a[k] != b.get(k)]


def _describe(labels: dict[str, str], choices: list[str], n: int) -> str:
    return ", ".join(f"{k}={labels[k]}" for k in choices) + f" (n={n})"


def judge(claim: Any, reg: Any, flats: dict[str, dict[str, Any]], j: ClaimJudge) -> tuple[str, str, Comparison | None]:
    """(what the design compares, the deciding test in words, that test) for one claim; raises CannotSay."""
    d, rule = j.d, claim.rule
    if not isinstance(rule, (Compare, Similar, Trend, Threshold, Collapses)):
        raise CannotSay("not about a trick (a reward-model claim)")
    points, outside = {}, {}
    for v, flat in flats.items():
        points[v], outside[v] = point(d, flat)
    keys = covered(d)

    def groups(names: list[str], against: str | None = None) -> tuple[list[str], dict[str, np.ndarray]]:
        """The choices that tell `names` apart (or each from the base `against`), and each one's configurations."""
        ref = [against] if against else names
        labels = {n: points[n] for n in [*names, *ref]}
        diff = sorted({k for a in names for b in ref if a != b for k in _differ(labels[a], labels[b])},
                      key=list(d.attr["search_space"]).index)
        settings = {k for a in names for b in ref if a != b
                    for k in set(flats[a]) | set(flats[b]) if flats[a].get(k) != flats[b].get(k)}
        loose = sorted(k for k in settings - keys if not k.startswith(IGNORED))
        if loose:
            raise CannotSay(f"the variants also differ in {', '.join(loose)}, which the study does not vary")
        bad = [o for n in names for o in outside[n] if o.split(" ")[0] in diff]
        if bad:
            raise CannotSay(f"a value the design does not draw: {'; '.join(dict.fromkeys(bad))}")
        if not diff:
            raise CannotSay("no choice of the study tells them apart" if not against else
                            "not about a trick (the variant is the figure's base)")
        return diff, {n: j.matching(points[n], diff) for n in names}

    metric, stat = getattr(rule, "metric", None), getattr(rule, "stat", "final")
    if isinstance(rule, Collapses):
        diff, sel = groups([rule.variant], "(base)")
        runs = d.runs[d.runs["number"].isin(sel[rule.variant])]
        k, n = int(runs["collapsed"].astype(bool).sum()), len(runs)
        return (_describe(points[rule.variant], diff, len(sel[rule.variant])) + f": {k}/{n} runs collapsed",
                "collapse rate over runs",
                rate_vs_half(k, n, "greater" if rule.expected else "less", "collapse rate"))
    values = j.per_config(metric, stat)

    def pick(nums: np.ndarray) -> np.ndarray:
        x = values.reindex(nums).dropna().to_numpy()
        if len(nums) and not len(x):
            raise CannotSay(f"the study's runs log no {metric}")
        return x
    if isinstance(rule, Threshold):
        if rule.variant is None:
            raise CannotSay("a threshold for every variant: no trick singled out")
        diff, sel = groups([rule.variant], "(base)")
        x = pick(sel[rule.variant])
        return (_describe(points[rule.variant], diff, len(x)), f"{stat} {metric} {rule.op} {rule.value:g}",
                compare_to(x, rule.value, "greater" if rule.op == ">" else "less"))
    if isinstance(rule, Compare):
        diff, sel = groups([rule.lower, rule.higher])
        hi, lo = pick(sel[rule.higher]), pick(sel[rule.lower])
        return (f"{_describe(points[rule.higher], diff, len(hi))} > {_describe(points[rule.lower], diff, len(lo))}",
                f"{stat} {metric}", compare(hi, lo, "greater"))
    if isinstance(rule, Similar):
        diff, sel = groups(list(rule.variants))
        xs = {v: pick(sel[v]) for v in rule.variants}
        try:
            parts = [c for _, c in equivalence(rule, {v: [x] for v, x in xs.items()})]
        except Unjudged as e:
            raise CannotSay(str(e)) from None
        return (" ~ ".join(_describe(points[v], diff, len(xs[v])) for v in rule.variants),
                f"{stat} {metric} alike within {rule.margin}", min(parts, key=lambda c: (RANK[c.verdict], -np.nan_to_num(c.p_value))))
    # Trend: each neighbour pair along the axis, in the claimed direction
    named = [v.name for v in reg.variants if rule.axis in v.settings and v.name in flats]
    ordered = sorted(named, key=lambda n: float(flats[n][rule.axis]))
    if rule.direction == "decreasing":
        ordered.reverse()
    diff, sel = groups(ordered)
    parts = [compare(pick(sel[b]), pick(sel[a]), "greater") for a, b in zip(ordered, ordered[1:])]
    return (" < ".join(_describe(points[v], diff, len(pick(sel[v]))) for v in ordered),
            f"{stat} {metric} {rule.direction} in {rule.axis}",
            min(parts, key=lambda c: (RANK[c.verdict], -np.nan_to_num(c.p_value))))


def one_factor_verdicts(reference: Path = REFERENCE) -> dict[tuple[str, str], str]:
    """(figure file, claim statement) -> the committed one-factor verdict (reports/reference.json)."""
    try:
        ref = json.loads(Path(reference).read_text())
    except (OSError, ValueError):
        return {}
    return {(name, c.get("claim")): c.get("verdict", "–") for name, f in (ref.get("figures") or {}).items()
            for c in f.get("claims") or []}


def claims_table(d: StudyData, *, ablations_dir: str | Path | None = None,
                 reference: Path = REFERENCE) -> pd.DataFrame:
    """One row per claim of every train figure file (COLUMNS)."""
    judge_ = ClaimJudge(d)
    verdicts, rows = one_factor_verdicts(reference), []
    for path in registry_files(ablations_dir):
        try:
            reg = load_registry(path, seeds=[0])
        except RegistryError as e:
            d.notes.append(f"claims of {path.name} not read: {e.problems[0]}")
            continue
        if reg.kind != "train" or not reg.claims:
            continue
        flats = {r.variant: computed_fields(r.cfg) for r in reg.runs if r.world in (None, min(reg.worlds or [0]))}
        flats["(base)"] = computed_fields(reg.common)
        for claim in reg.claims:
            row = {"figure_file": reg.name, "figure": reg.figure, "claim": claim.statement, "source": claim.cited,
                   "one_factor": verdicts.get((reg.name, claim.statement), "–")}
            try:
                what, test, c = judge(claim, reg, flats, judge_)
                row |= {"design": what, "test": f"{test}: {c.describe()}", "says": SAYS[c.verdict],
                        "reason": "" if c.verdict != INCONCLUSIVE else "the interval holds both answers"
                        if math.isfinite(c.ci_low) else "too few configurations"}
            except CannotSay as e:
                row |= {"design": "", "test": "", "says": "cannot say", "reason": str(e)}
            rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS)
