"""The report pages of a design study ("which tricks matter", analysis.tricks): what matters with its
intervals, the per-value table, the figures, the interactions, the agreement between worlds, the claims
of the one-factor figure files beside the design's answer, and the best configuration.

reports.build calls `design_summary` for a sweep (None unless its study records `objectives`: a design)
and renders the summary with `flowables(summary, st, kit)`, where kit is the module whose paragraph,
table and image helpers the pages use (reports.build itself: passed in, so the two modules do not import
each other).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
from reportlab.lib import colors

from analysis.tricks import analyse
from analysis.tricks_data import NOT_DRAWN, load_study
from harness.summary import fmt

SAYS_COLORS = {"agrees": "#d9f2d9", "contradicts": "#f8d7d7", "cannot say": "#fdf0c8"}


def _ci(est: Any, lo: Any, hi: Any) -> str:
    return f"{fmt(est)} [{fmt(lo)}, {fmt(hi)}]" if isinstance(lo, float) and math.isfinite(lo) else fmt(est)


def design_summary(study: str | Path, tracking_uri: str, out_dir: str | Path) -> dict[str, Any] | None:
    """analysis.tricks.analyse of design study `study` (a name or its sweep YAML), written to out_dir; None
    when its study records no `objectives` (a plain sweep: reports.build's sweep page covers it)."""
    try:
        d = load_study(study, tracking_uri)
    except (KeyError, ValueError):
        return None
    return analyse(d, out_dir=out_dir)


def flowables(s: dict[str, Any], st: dict, kit: Any) -> list:
    """The pages of a design summary; `kit`: reports.build (P, table, FitImage, FRAME_H)."""
    P, table, FitImage, FRAME_H = kit.P, kit.table, kit.FitImage, kit.FRAME_H

    figs = {Path(f).stem: Path(f) for f in s.get("figures") or []}
    t = s.get("throughput") or {}
    out: list = [P(f"Which tricks matter ({s['name']})", st["h1"]), P(
        f"{s['configs']} configurations, {s['runs']} runs, worlds {s['worlds'] or '–'}; a configuration's score is "
        f"the mean of {s['score']} over its runs. Importance: {s['evaluator']} (analysis/tricks.py), above chance with "
        "a Bonferroni bootstrap interval over the choices; a choice matters when that interval lies above 0."
        + (f" Throughput: {t['runs']} runs in {t['hours']:.2f} h, {t['runs_per_hour']:.0f} runs/h."
           if isinstance(t.get("runs_per_hour"), float) and math.isfinite(t["runs_per_hour"]) else ""), st["body"])]
    out += [P(n, st["note"]) for n in s.get("notes") or []]
    imp = s["importances"]
    rows = [["choice", "importance", "above chance [CI]", "n", "verdict"]]
    extra = []
    for i, r in enumerate(imp.itertuples(), start=1):
        matters = isinstance(r.ci_low, float) and r.ci_low > 0
        rows.append([r.choice, fmt(r.importance), _ci(r.above_chance, r.ci_low, r.ci_high), str(r.n),
                     "matters" if matters else "no effect found"])
        extra.append(("BACKGROUND", (4, i), (4, i), colors.HexColor("#d9f2d9" if matters else "#eeeeee")))
    out += [P("What matters", st["h2"]), table(rows, [0.3, 0.14, 0.3, 0.08, 0.18], st, extra=extra)]
    for key in ("tricks_importances", "tricks_violins"):
        if key in figs:
            out.append(FitImage(figs[key], FRAME_H * 0.8))
    vals = s["values"]
    rows = [["choice", "value", "n", "95th pct. [CI]", "collapse rate [CI]", "top 5% share [CI]", "share of all"]]
    for r in vals.itertuples():
        rows.append([r.choice, r.value, str(r.n), _ci(r.percentile, r.ci_low, r.ci_high),
                     _ci(r.collapse_rate, r.collapse_low, r.collapse_high) + f" ({r.collapsed}/{r.runs})",
                     _ci(r.top_share, r.top_low, r.top_high), fmt(r.share)])
    out += [P("Per choice value", st["h2"]), table(rows, [0.2, 0.13, 0.06, 0.18, 0.2, 0.14, 0.09], st),
            P(f"n: configurations drawn with the value ({NOT_DRAWN}: where the choice's `when` did not hold); 95th "
              "percentile of the score over them, percentile bootstrap 95% CI; collapse rate over their runs, "
              "Clopper-Pearson 95% CI; share of the top 5% of configurations (by score) that have the value, "
              "bootstrap 95% CI, beside its share of all configurations.", st["note"])]
    inter = s["interactions"].head(8)
    if not inter.empty:
        rows = [["pair", "n", "F (df)", "p", "variance share", "Bonferroni"]]
        rows += [[f"{r.a} × {r.b}", str(r.n), f"{fmt(r.F)} ({r.df_int}, {r.df_res})", fmt(r.p), fmt(r.share),
                  "yes" if r.bonferroni else "no"] for r in inter.itertuples()]
        out += [P("Strongest interactions", st["h2"]), table(rows, [0.42, 0.07, 0.16, 0.1, 0.13, 0.12], st),
                P("Two-way ANOVA interaction F test per pair of choices, over the configurations where both were "
                  "drawn; Bonferroni: p below 0.05 / the number of pairs.", st["note"])]
        if "tricks_interactions" in figs:
            out.append(FitImage(figs["tricks_interactions"], FRAME_H * 0.6))
    worlds = s["worlds_agreement"]
    if not worlds.empty:
        rows = [["worlds", "ρ of per-value 95th pct. [CI]", "p", "values", "ρ of importances (p)"]]
        rows += [[f"{r.world_a} vs {r.world_b}", _ci(r.rho, r.ci_low, r.ci_high), fmt(r.p), str(r.values),
                  f"{fmt(r.importance_rho)} ({fmt(r.importance_p)})"] for r in worlds.itertuples()]
        out += [P("Does the ranking hold across worlds?", st["h2"]), table(rows, [0.15, 0.35, 0.1, 0.1, 0.3], st)]
        if "tricks_worlds" in figs:
            out.append(FitImage(figs["tricks_worlds"], FRAME_H * 0.4))
    claims = s.get("claims")
    if isinstance(claims, pd.DataFrame) and not claims.empty:
        rows, extra = [["figure file", "claim", "one-factor verdict", "the design says", "compared / why not"]], []
        for i, r in enumerate(claims.itertuples(), start=1):
            rows.append([r.figure_file, f"{r.claim} ({r.source})", r.one_factor, r.says,
                         f"{r.design}; {r.test}" if r.design else r.reason])
            extra.append(("BACKGROUND", (3, i), (3, i), colors.HexColor(SAYS_COLORS.get(r.says, "#ffffff"))))
        counts = claims["says"].value_counts()
        out += [P("The one-factor claims against the design", st["h2"]),
                P(", ".join(f"{counts.get(k, 0)} {k}" for k in SAYS_COLORS) + " (analysis/tricks_claims.py: the "
                  "configurations taking each variant's values of the choices that tell the variants apart, whatever "
                  "the other choices, by the claim's own test).", st["note"]),
                table(rows, [0.12, 0.3, 0.1, 0.1, 0.38], st, extra=extra)]
    best = s.get("best") or {}
    if best:
        rows = [["trial", str(best["number"])], ["score", fmt(best["score"], 4)]]
        rows += [[k, str(v)] for k, v in best["values"].items()]
        out += [P("The best configuration (selected here: rerun it elsewhere, analysis.tricks best)", st["h2"]),
                table(rows, [0.35, 0.65], st, header=False)]
    return out
