"""The paper-style figure of one ablation, drawn from the MLflow store alone (`python -m analysis.figures`).

One panel per metric (the YAML's panels, see `figure_panels`), one line per variant = mean over
seeds, a min-max band over seeds, an X at a run's collapse (the gold onset on the world) and a
triangle where the detector warned (harness.detector, from the indicators alone); special panels for
Figs. 2, 3 and 13. Writes OUT/<ablation>/figure.png and .pdf, sized for a printed A4/Letter page
at full text width, and logs both to the ablation's newest parent run (artifact folder figures/).
"""
from __future__ import annotations

import argparse
import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps, rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, LogFormatter, MaxNLocator

from analysis.store import STORE_OPTIONS, AblationData, load_ablation, smoothing
from harness import keys as K
from harness import tracking
from harness.registry import (
    EVAL_RM_SCORE_HIST,
    RM_ACCURACY,
    RM_SCORE_DIFF_HIST,
    SPECIAL_PANELS,
    RegistryError,
    UnknownAblation,
)
from harness.tracking import redact

PANEL_LABELS = {
    K.RM_SCORE: "Reward", K.GOLD_SCORE: "Gold reward", K.LENGTH: "Response length", K.KL: "KL-divergence",
    K.PPL: "Perplexity", K.PPL_TOKENS: "Perplexity (token-pooled)", K.PPL_REF: "Perplexity (reference)",
    K.PG_LOSS: "PG loss", K.VF_LOSS: "VF loss", K.VALUES: "Values", K.RETURNS: "Returns", K.ADV_MEAN: "Advantages",
    K.ADV_RAW_MEAN: "Advantages (raw)", K.ENTROPY: "Entropy", K.APPROX_KL: "Approx. KL (vs rollout policy)",
    K.FRAC_AT_CAP: "Fraction at length cap", K.EVAL_WIN_RATE: "Win rate vs SFT", K.EVAL_GOLD: "Eval gold reward",
    K.EVAL_RM: "Eval reward", RM_SCORE_DIFF_HIST: "RM score difference (chosen − rejected)",
    RM_ACCURACY: "Reward-model accuracy", EVAL_RM_SCORE_HIST: "RM score distribution on held-out prompts",
}
"""Panel titles in the paper's wording."""
UNITS = {K.KL: "nats/token", K.KL_K3: "nats/token", K.APPROX_KL: "nats/token", K.ENTROPY: "nats/token",
         K.LENGTH: "tokens", K.LENGTH_MAX: "tokens", K.EVAL_LENGTH: "tokens"}
"""y-axis label of the metrics that have a unit (keys.py: KL per response token, lengths in tokens)."""
FIG_WIDTH_IN = 7.2  # full text width of an A4/Letter page with ~2 cm margins
LEGEND_CHAR_IN = 0.062  # width of one legend character at legend.fontsize 8.5 (measured on Fig. 14's labels)
LEGEND_HANDLE_IN = 0.55  # line handle plus column gap
PANEL_HEIGHT_IN = 2.1
MAX_RIDGES = 10
X_TICKS = 5  # x tick labels per panel ("0 50 100 150 200"): 9 labels of 3 digits run together at a third of a page
LOG_SCALE_PANELS = {K.PPL, K.PPL_TOKENS, K.PPL_REF}
STYLE = {"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "xtick.labelsize": 8, "ytick.labelsize": 8,
         "legend.fontsize": 8.5, "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
         "grid.alpha": 0.3, "grid.linewidth": 0.5}
WIN_RATE_AXIS = f"{K.EVAL_WIN_RATE} (right axis)"
X_LABELS = {"step": "Step", "sampled_tokens": "Sampled response tokens (cumulative)"}
"""The metric panels' x axis label, by the figure file's `x`."""


def seed_band(metrics: pd.DataFrame, metric: str, smooth_k: int = 1) -> pd.DataFrame:
    """Per (variant, step): mean, std, min, max, n over seeds, each run first smoothed (trailing mean
    over smooth_k steps); a step some seed did not reach averages the seeds that did."""
    m = metrics[metrics["metric"] == metric].sort_values(["run_id", "step"])
    if m.empty:
        return pd.DataFrame(columns=["variant", "step", "mean", "std", "min", "max", "n"])
    k = max(int(smooth_k or 1), 1)
    m = m.assign(value=m.groupby("run_id")["value"].transform(lambda s: s.rolling(k, min_periods=1).mean()))
    out = m.groupby(["variant", "step"])["value"].agg(["mean", "std", "min", "max", "count"])
    return out.rename(columns={"count": "n"}).reset_index()


def sampled_tokens(data: AblationData) -> pd.DataFrame | None:
    """Per (variant, step), mean over seeds: the response tokens a run had sampled by the end of `step`
    (the trainer's response/sampled_tokens: every rollout but eval, so reward-stat seeding, critic
    pretraining and ReMax's greedy baselines count). None when the figure's x axis is the step."""
    if data.spec.x != "sampled_tokens":
        return None
    m = data.metrics(K.SAMPLED_TOKENS)
    return m.groupby(["variant", "step"])["value"].mean().rename("x").reset_index()


def at_x(xs: pd.DataFrame | None, variant: str, steps) -> np.ndarray:
    """Where steps of a variant lie on the x axis (sampled tokens between logged steps interpolated)."""
    steps = np.asarray(steps, dtype=float)
    if xs is None:
        return steps
    v = xs[xs["variant"] == variant]
    return np.interp(steps, v["step"].astype(float), v["x"].astype(float))


def grid_shape(n: int) -> tuple[int, int]:
    """Rows, columns: 2 columns for 2, 4, 8 panels (the paper's 1x4 row as 2x2 at page width, its 2x4
    as 4x2), else 3: at print width a panel narrower than a third of the page is unreadable."""
    cols = 1 if n <= 1 else 2 if n in (2, 4, 8) else 3
    return math.ceil(n / cols), cols


def figure_panels(data: AblationData) -> list[str]:
    """The registry's panels, plus gold reward after reward when runs log it, and one
    eval_rm_score_hist panel per variant; a win-rate panel beside a reward panel moves onto it."""
    panels = list(data.spec.panels)
    if K.RM_SCORE in panels and K.EVAL_WIN_RATE in panels:
        panels.remove(K.EVAL_WIN_RATE)  # drawn on the reward panel's right axis, as in the paper
    gold = any(K.GOLD_SCORE in k for k in data.runs["metric_keys"])
    if K.RM_SCORE in panels and K.GOLD_SCORE not in panels and gold:
        panels.insert(panels.index(K.RM_SCORE) + 1, K.GOLD_SCORE)
    if K.PPL in panels and K.PPL_TOKENS not in panels:
        panels[panels.index(K.PPL)] = data.shown_metric(K.PPL)
    out = []
    for p in panels:
        if p == EVAL_RM_SCORE_HIST:
            out += [f"{p}:{v}" for v in data.variants] or [p]
        else:
            out.append(p)
    return out


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no data\n({what} not logged)", ha="center", va="center", transform=ax.transAxes,
            color="0.4", fontsize=8)


def _band(ax: Axes, b, color, x=None, **line) -> None:
    """The mean over seeds as a line (at x, default the steps), and the min-max band when there are several seeds."""
    x = b["step"].astype(float) if x is None else x
    ax.plot(x, b["mean"], color=color, lw=1.3, **line)
    if b["n"].max() > 1:
        ax.fill_between(x, b["min"].astype(float), b["max"].astype(float), color=color, alpha=0.18, lw=0)


def draw_metric_panel(ax: Axes, data: AblationData, metric: str, colors: dict, smooth_k: int,
                      xs: pd.DataFrame | None = None) -> None:
    """One line per variant (label = variant name), min-max band, on the mean curve an X at each
    collapsed run's gold onset (else its collapse step; tag only: where its curve ends) and a triangle
    at each warning; x: steps, or `xs` (sampled_tokens)."""
    rows = data.metrics(metric)
    band = seed_band(rows, metric, smooth_k)
    if band.empty:
        return _no_data(ax, metric)
    ends = rows.groupby("run_id")["step"].max()
    for v in data.variants:
        b = band[band["variant"] == v]
        if b.empty:
            continue
        _band(ax, b, colors[v], at_x(xs, v, b["step"]), label=v)
        runs = data.runs[data.runs["variant"] == v]
        collapsed = runs[runs["collapsed"]]  # X: the run's collapse (the gold onset on the world); ^: the warning
        marks = [("X", collapsed["gold_onset"].fillna(collapsed["collapse_step"]).fillna(collapsed["run_id"].map(ends))),
                 ("^", runs["warning_step"])]
        for marker, steps in marks:
            for step in steps.dropna():
                y = np.interp(step, b["step"].astype(float), b["mean"].astype(float))
                ax.plot(at_x(xs, v, [step]), [y], ls="none", marker=marker, ms=7, color=colors[v], mec="black",
                        mew=0.6, label="_collapse", zorder=5)
    if metric in LOG_SCALE_PANELS and (band["max"].astype(float) > 0).all():
        ax.set_yscale("log")  # collapse drives perplexity toward 1 while outliers reach the thousands
        for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):  # 3, 4, 6; not 3x10^0
            axis_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_xlabel(X_LABELS["step" if xs is None else "sampled_tokens"])
    ax.set_ylabel(UNITS.get(metric, ""))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=X_TICKS, integer=True))  # more run together at a third of a page
    if xs is not None:
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 20k, 1.5M


def draw_win_rate(ax: Axes, data: AblationData, colors: dict, smooth_k: int, xs: pd.DataFrame | None) -> Axes | None:
    """Win rate vs SFT on the reward panel's right axis (Fig. 4), dashed, same colors."""
    band = seed_band(data.metrics(K.EVAL_WIN_RATE), K.EVAL_WIN_RATE, smooth_k)
    if band.empty:
        return None
    right = ax.twinx()
    right.grid(False)
    right.spines["right"].set_visible(True)
    for v, b in band.groupby("variant"):
        right.plot(at_x(xs, v, b["step"]), b["mean"], color=colors[v], lw=1.1, ls="--", marker=".", ms=3,
                   label=f"{v}: win rate vs SFT")
    right.set_ylim(0, 1)
    right.set_ylabel("Win rate vs SFT (dashed)")
    return right


def draw_rm_score_diff_hist(ax: Axes, data: AblationData, colors: dict) -> None:
    """Fig. 2: one histogram per RM (variant), chosen-minus-rejected on held-out pairs."""
    diffs = {v: d for v in data.variants if (d := data.rm_score_diffs(v)).size}
    if not diffs:
        return _no_data(ax, K.RM_SCORE_DIFF)
    pooled = np.concatenate(list(diffs.values()))
    edges = np.histogram_bin_edges(pooled, bins=min(40, max(10, len(pooled) // 20)))
    for v, d in diffs.items():
        ax.hist(d, bins=edges, histtype="stepfilled", alpha=0.35, color=colors[v], edgecolor=colors[v], lw=1.2, label=v)
    ax.axvline(0, color="0.3", lw=0.8, ls=":")
    ax.text(0.98, 0.97, "\n".join(f"{v}: {np.mean(d > 0):.0%} > 0" for v, d in diffs.items()), transform=ax.transAxes,
            ha="right", va="top", fontsize=7.5, bbox={"boxstyle": "round", "fc": "white", "ec": "0.8", "alpha": 0.9})
    ax.set_xlabel("RM score(chosen) − RM score(rejected)")
    ax.set_ylabel("held-out pairs")


def draw_rm_accuracy(ax: Axes, data: AblationData, colors: dict, smooth_k: int) -> None:
    """Fig. 3: train (solid) and eval (dashed) accuracy over RM steps, per variant."""
    rows = data.metrics([K.RM_TRAIN_ACC, K.RM_EVAL_ACC])
    if rows.empty:
        return _no_data(ax, f"{K.RM_TRAIN_ACC}, {K.RM_EVAL_ACC}")
    for key, ls, part in ((K.RM_TRAIN_ACC, "-", "train"), (K.RM_EVAL_ACC, "--", "eval")):
        for v, b in seed_band(rows, key, smooth_k).groupby("variant"):
            _band(ax, b, colors[v], ls=ls, marker="." if len(b) < 30 else None,
                  label=f"{part} accuracy" if len(data.variants) == 1 else f"{v} ({part})")
    ax.axhline(0.5, color="0.4", lw=0.8, ls=":", label="_chance")
    ax.set_ylim(min(0.45, ax.get_ylim()[0]), max(1.0, ax.get_ylim()[1]))
    ax.text(0.99, 0.5, "chance ", transform=ax.get_yaxis_transform(), ha="right", va="bottom", fontsize=7.5,
            color="0.4")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("RM training step")
    ax.set_ylabel("accuracy")


def draw_eval_rm_score_hist(ax: Axes, data: AblationData, variant: str | None) -> None:
    """Fig. 13: one ridge (histogram scaled to its own peak) per eval step, seeds pooled, at most
    MAX_RIDGES steps evenly spread (first and last included), first step at the bottom."""
    by_step = data.eval_rm_scores(variant or (data.variants or [None])[0])
    if not by_step:
        return _no_data(ax, f"{K.EVAL_SCORES_DIR}/rm_scores_step_*.json")
    steps = sorted(by_step)
    stride = -(-(len(steps) - 1) // (MAX_RIDGES - 1)) or 1  # every k-th step: evenly spaced, at most MAX_RIDGES
    steps = sorted({*steps[::stride], steps[-1]})  # the first and the last always
    edges = np.histogram_bin_edges(np.concatenate([by_step[s] for s in steps]), bins=50)
    centers = (edges[:-1] + edges[1:]) / 2
    for i, s in enumerate(steps):
        counts, _ = np.histogram(by_step[s], bins=edges)
        h = 0.9 * counts / max(counts.max(), 1)
        c = colormaps["viridis"](i / max(len(steps) - 1, 1))
        ax.fill_between(centers, i, i + h, step="mid", color=c, alpha=0.6, lw=0, zorder=len(steps) - i)
        ax.plot(centers, i + h, drawstyle="steps-mid", color=c, lw=1.0, label=f"step {s}", zorder=len(steps) - i)
    ax.set_yticks(range(len(steps)), [f"step {s}" for s in steps])
    ax.grid(axis="y", visible=False)
    ax.set_xlabel("RM score of held-out responses")


@dataclass
class DrawnFigure:
    fig: Figure
    axes: dict[str, Axes]
    """Panel key -> Axes (metric key, special panel name, `eval_rm_score_hist:<variant>`; the
    Fig. 4 win-rate axis is WIN_RATE_AXIS)."""


def draw_ablation(data: AblationData, smooth_k: int = 1) -> DrawnFigure:
    """Every panel in one Figure; the Axes by panel let callers (and tests) inspect lines per variant."""
    panels = figure_panels(data)
    xs = sampled_tokens(data)
    rows, cols = grid_shape(len(panels))
    colors = {v: colormaps["tab10"](i % 10) for i, v in enumerate(data.variants)}
    height = 4.2 if len(panels) == 1 and panels[0].startswith(EVAL_RM_SCORE_HIST) else PANEL_HEIGHT_IN * rows + 0.2
    with rc_context(STYLE):
        fig = Figure(figsize=(FIG_WIDTH_IN, height + 0.9), layout="constrained")
        grid = fig.subplots(rows, cols, squeeze=False).ravel()
        axes: dict[str, Axes] = dict(zip(panels, grid))
        for panel, ax in list(axes.items()):
            base, _, which = panel.partition(":")
            ax.set_title(textwrap.fill(PANEL_LABELS.get(base, base) + (f" — {which}" if which else ""), 120 // cols))
            if base == RM_SCORE_DIFF_HIST:
                draw_rm_score_diff_hist(ax, data, colors)
            elif base == RM_ACCURACY:
                draw_rm_accuracy(ax, data, colors, smooth_k)
            elif base == EVAL_RM_SCORE_HIST:
                draw_eval_rm_score_hist(ax, data, which or None)
            else:
                draw_metric_panel(ax, data, panel, colors, smooth_k, xs)
                if panel == K.RM_SCORE and K.EVAL_WIN_RATE in data.spec.panels:
                    if (right := draw_win_rate(ax, data, colors, smooth_k, xs)) is not None:
                        axes[WIN_RATE_AXIS] = right
        for ax in grid[len(panels):]:
            ax.set_visible(False)
        fig.suptitle(textwrap.fill(data.spec.title, 80), fontsize=10, fontweight="bold")
        _legend(fig, data, colors, axes, smooth_k)
    return DrawnFigure(fig, axes)


def _legend(fig: Figure, data: AblationData, colors: dict, axes: dict[str, Axes], smooth_k: int) -> None:
    """One legend under the panels: variant names as in the paper's, then what band and markers mean."""
    metric_panels = [p for p in axes if p.split(":")[0] not in SPECIAL_PANELS]
    handles = [Line2D([], [], color=colors[v], lw=2, label=v) for v in data.variants]
    if RM_ACCURACY in axes and not metric_panels and RM_SCORE_DIFF_HIST not in axes:
        parts = [Line2D([], [], color="0.2", ls=ls, label=part) for ls, part in (("-", "train"), ("--", "eval"))]
        handles = parts + (handles if len(handles) > 1 else [])
    elif not (metric_panels or RM_SCORE_DIFF_HIST in axes):
        handles = []
    n_seeds = int(data.runs.groupby("variant").size().max()) if not data.runs.empty else 0
    if metric_panels and n_seeds > 1:
        handles.append(Patch(color="0.5", alpha=0.3, label=f"min–max over seeds ({n_seeds}); line: mean"))
    if metric_panels and data.runs["collapsed"].any():
        gold = data.runs["gold_onset"].notna().any()
        handles.append(Line2D([], [], ls="none", marker="X", ms=7, color="0.5", mec="black", mew=0.6,
                              label="collapse: gold onset" if gold else "collapse"))
    if metric_panels and data.runs["warning_step"].notna().any():
        handles.append(Line2D([], [], ls="none", marker="^", ms=7, color="0.5", mec="black", mew=0.6,
                              label="early warning (no gold used)"))
    if WIN_RATE_AXIS in axes:
        handles.append(Line2D([], [], color="0.3", ls="--", marker=".", label="win rate vs SFT (right axis)"))
    if smooth_k and smooth_k > 1 and metric_panels:
        handles.append(Line2D([], [], color="none", label=f"smoothed: rolling mean over {smooth_k} steps"))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=legend_columns(handles), frameon=False)


def legend_columns(handles: list) -> int:
    """Up to 3 columns, fewer when the longest label (Fig. 14's: ~60 characters) would overflow."""
    col_in = LEGEND_CHAR_IN * max(len(h.get_label()) for h in handles) + LEGEND_HANDLE_IN
    return max(1, min(3, len(handles), int(FIG_WIDTH_IN // col_in)))


@dataclass
class FigureOutput:
    data: AblationData
    drawn: DrawnFigure
    paths: list[Path]
    """figure.png (200 dpi, for the report) and figure.pdf (vector)."""
    logged_to: str | None
    """Parent run id the files were logged to (None: no parent run, or logging off)."""


def make_figures(ablation, tracking_uri: str | None = None, smooth_k: int = 1, out: str | Path = "results",
                 log_to_parent: bool = True, ablations_dir: str | Path | None = None,
                 data: AblationData | None = None) -> FigureOutput:
    """Load, draw, save under out/<ablation>/ and log to the newest parent run. An ablation without
    runs is not drawn (LookupError): empty panels would read as a result."""
    data = data or load_ablation(ablation, tracking_uri, ablations_dir)
    if data.runs.empty:
        raise LookupError(f"{data.name}: no runs in {redact(data.tracking_uri)}; nothing drawn "
                          f"(run `python -m harness.ablate {data.name}` first)")
    drawn = draw_ablation(data, smooth_k)
    out_dir = Path(out) / data.name
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "figure.png", out_dir / "figure.pdf"]
    drawn.fig.savefig(paths[0], dpi=200)
    drawn.fig.savefig(paths[1])
    logged = data.parent_run_id if log_to_parent else None
    if logged:
        tracking.log_file_artifacts(data.tracking_uri, logged, paths, artifact_path="figures")
    return FigureOutput(data, drawn, paths, logged)


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    ap = argparse.ArgumentParser(prog="python -m analysis.figures", parents=[STORE_OPTIONS], description=__doc__)
    ap.add_argument("ablation", help="registry name (e.g. score_reparam) or path to an ablations/*.yaml file")
    ap.add_argument("--smooth", type=smoothing, default=1, metavar="K",
                    help="rolling mean over K logged steps per run (default 1 = raw)")
    ap.add_argument("--out", default="results", help="output root; files go to OUT/<ablation>/ (default results/)")
    ap.add_argument("--no-log", action="store_true", help="do not log the files to the parent run")
    args = ap.parse_args(argv)
    try:
        data = load_ablation(args.ablation, args.tracking_uri, args.ablations_dir)
    except (UnknownAblation, RegistryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        res = make_figures(data.name, None, args.smooth, args.out, not args.no_log, data=data)
    except LookupError as e:  # no runs
        print(e)
        return 1
    print(f"{data.name}: {len(data.runs)} runs, variants: {', '.join(data.variants) or '(none)'}")
    if data.missing_variants:
        print(f"  registry variants without runs: {', '.join(data.missing_variants)}")
    print("\n".join(f"  wrote {p}" for p in res.paths))
    print(f"  logged to parent run {res.logged_to}" if res.logged_to else "  not logged (no parent run or --no-log)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
