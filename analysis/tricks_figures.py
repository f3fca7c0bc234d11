"""The figures of a design study's analysis (analysis.tricks): per choice the score's distribution per
value (violins, the conditional 95th percentile and its interval marked), the importances above chance
with their intervals, the strongest pairwise interactions as heat maps of the mean score per value
pair, and the per-value 95th percentiles of one world against another's.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import rc_context
from matplotlib.figure import Figure

from analysis.figures import FIG_WIDTH_IN, STYLE
from analysis.tricks_data import NOT_DRAWN, StudyData, on_world, pair_table

COLUMNS = 4
HEATMAPS = 4  # the strongest interactions drawn
LABEL_CHARS = 9


def _short(v: str, chars: int = LABEL_CHARS) -> str:
    return "n/d" if v == NOT_DRAWN else (v if len(v) <= chars else v[:chars - 1] + "…")


def violins(d: StudyData, values: pd.DataFrame, path: Path) -> Path:
    """One panel per choice: the score of the configurations drawn with each value."""
    n = len(d.choices)
    rows = math.ceil(n / COLUMNS)
    fig = Figure(figsize=(FIG_WIDTH_IN, 1.75 * rows + 0.5), layout="constrained")
    axes = fig.subplots(rows, COLUMNS, squeeze=False, sharey=True)
    for ax, choice in zip(axes.flat, d.choices):
        labels = d.values(choice)
        data = [d.configs.loc[d.configs[choice] == v, d.score].dropna().to_numpy() for v in labels]
        pos = [i for i, x in enumerate(data) if len(x) > 1]
        if pos:
            parts = ax.violinplot([data[i] for i in pos], positions=pos, showextrema=False, widths=0.8)
            for body, i in zip(parts["bodies"], pos):
                body.set_facecolor("0.75" if labels[i] == NOT_DRAWN else "tab:blue")
                body.set_alpha(0.45)
        for i, x in enumerate(data):
            ax.scatter(np.full(len(x), i), x, s=3, color="0.3", alpha=0.5, linewidths=0)
        rows_v = values[values["choice"] == choice].set_index("value")
        for i, v in enumerate(labels):
            if v in rows_v.index and math.isfinite(rows_v.at[v, "percentile"]):
                r = rows_v.loc[v]
                lo, hi = r["ci_low"], r["ci_high"]
                err = [[r["percentile"] - lo], [hi - r["percentile"]]] if math.isfinite(lo) else None
                ax.errorbar([i], [r["percentile"]], yerr=err, fmt="_", color="tab:red", ms=12, capsize=2, lw=1)
        crowded = len(labels) > 5  # six values in a quarter of the width: shorter names, or they run together
        ax.set_xticks(range(len(labels)), [f"{_short(v, 6 if crowded else LABEL_CHARS)}\n{len(x)}"
                                           for v, x in zip(labels, data)], fontsize=6 if crowded else 6.5)
        ax.set_title(choice, fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel(d.score, fontsize=8)
    fig.suptitle(f"{d.name}: {d.score} per choice value, over configurations\n(red: the 95th percentile and its 95% "
                 "bootstrap CI; n/d: not drawn; under each value: its configurations)", fontsize=9)
    fig.savefig(path, dpi=150)
    return path


def importance_bars(d: StudyData, imp: pd.DataFrame, path: Path, evaluator: str) -> Path:
    """Importance above chance per choice with its Bonferroni interval; 0 = no more than chance."""
    imp = imp.dropna(subset=["above_chance"]).iloc[::-1]
    fig = Figure(figsize=(FIG_WIDTH_IN, 0.22 * max(len(imp), 4) + 1.0), layout="constrained")
    ax = fig.add_subplot()
    y = np.arange(len(imp))
    lo = (imp["above_chance"] - imp["ci_low"]).clip(lower=0).fillna(0)
    hi = (imp["ci_high"] - imp["above_chance"]).clip(lower=0).fillna(0)
    colors = ["tab:green" if x > 0 else "0.6" for x in imp["ci_low"].fillna(-1)]
    ax.barh(y, imp["above_chance"], xerr=[lo, hi], color=colors, capsize=2)
    ax.axvline(0, color="black", lw=0.6)
    ax.set_yticks(y, imp["choice"], fontsize=7.5)
    what = "variance share" if evaluator == "anova" else f"{evaluator} share of the total"
    ax.set_xlabel(f"importance above chance ({what}; Bonferroni bootstrap CI; green: CI above 0)", fontsize=8)
    ax.set_title(f"{d.name}: which choices matter for {d.score}", fontsize=9)
    fig.savefig(path, dpi=150)
    return path


def heatmaps(d: StudyData, inter: pd.DataFrame, path: Path) -> Path | None:
    """The strongest interactions: mean score per value pair, n in each cell."""
    top = inter.head(HEATMAPS)
    if top.empty:
        return None
    fig = Figure(figsize=(FIG_WIDTH_IN, 2.4 * math.ceil(len(top) / 2) + 0.4), layout="constrained")
    axes = fig.subplots(math.ceil(len(top) / 2), 2, squeeze=False)
    for ax, r in zip(axes.flat, top.itertuples()):
        mean, count = pair_table(d, r.a, r.b)
        im = ax.imshow(mean.to_numpy(dtype=float), cmap="viridis" if d.maximize else "viridis_r", aspect="auto")
        for (i, j), m in np.ndenumerate(mean.to_numpy(dtype=float)):
            if math.isfinite(m):
                ax.text(j, i, f"{m:.2f}\nn={count.iat[i, j]}", ha="center", va="center", fontsize=6, color="white")
        ax.set_xticks(range(mean.shape[1]), [_short(str(c)) for c in mean.columns], fontsize=7)
        ax.set_yticks(range(mean.shape[0]), [_short(str(c)) for c in mean.index], fontsize=7)
        ax.set_xlabel(r.b, fontsize=7.5)
        ax.set_ylabel(r.a, fontsize=7.5)
        ax.set_title(f"F = {r.F:.2g}, p = {r.p:.2g}, share {r.share:.2f}", fontsize=7.5)
        fig.colorbar(im, ax=ax, shrink=0.8)
    for ax in list(axes.flat)[len(top):]:
        ax.set_visible(False)
    fig.suptitle(f"{d.name}: strongest interactions (mean {d.score} per value pair)", fontsize=9)
    fig.savefig(path, dpi=150)
    return path


def world_scatter(d: StudyData, agreement: pd.DataFrame, path: Path) -> Path | None:
    """Per-value 95th percentile on one world against another, one point per choice value."""
    from analysis.tricks_data import value_table

    if agreement.empty:
        return None
    r = agreement.iloc[0]
    a, b = (value_table(on_world(d, w), B=0) for w in (r["world_a"], r["world_b"]))
    a, b = (t[t["value"] != NOT_DRAWN].set_index(["choice", "value"])["percentile"] for t in (a, b))
    both = pd.concat([a, b], axis=1, keys=["a", "b"]).dropna()
    fig = Figure(figsize=(FIG_WIDTH_IN / 2, FIG_WIDTH_IN / 2), layout="constrained")
    ax = fig.add_subplot()
    ax.scatter(both["a"], both["b"], s=10)
    lim = [float(np.nanmin(both.to_numpy())), float(np.nanmax(both.to_numpy()))] if len(both) else [0, 1]
    ax.plot(lim, lim, color="0.6", lw=0.6)
    ax.set_xlabel(f"95th percentile of {d.score}, world {r['world_a']}", fontsize=8)
    ax.set_ylabel(f"world {r['world_b']}", fontsize=8)
    ax.set_title(f"Spearman ρ = {r['rho']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]", fontsize=8.5)
    fig.savefig(path, dpi=150)
    return path


def draw(d: StudyData, s: dict[str, Any], out: Path) -> list[str]:
    """Every figure that can be drawn; returns their paths."""
    paths = []
    with rc_context(STYLE):
        if len(d.configs):
            paths.append(violins(d, s["values"], out / "tricks_violins.png"))
        if s["importances"]["above_chance"].notna().any():
            paths.append(importance_bars(d, s["importances"], out / "tricks_importances.png", s["evaluator"]))
        paths.append(heatmaps(d, s["interactions"], out / "tricks_interactions.png"))
        paths.append(world_scatter(d, s["worlds_agreement"], out / "tricks_worlds.png"))
    return [str(p) for p in paths if p is not None]
