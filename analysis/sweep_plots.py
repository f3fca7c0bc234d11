"""The summary of an Optuna sweep (harness/sweep.py): trials table, best trial, importances, plots.

    python -m analysis.sweep_plots sweep_delta_eta        # also logs them to the sweep's parent run
    sweep_summary("ablations/sweep_delta_eta.yaml", "sqlite:///mlflow.db")
    -> {"figures": [PNG paths], "table": DataFrame, "best": {...}, "importances": {...}, ...}

`table` is the concise per-trial table for reports; `table_full` (and sweep_trials.csv) adds
seed scores, intermediate values, failure reasons and MLflow run ids.

Read from the Optuna storage (values, states, user attrs) and joined with the MLflow store
(child runs tagged harness.sweep / harness.trial). Figures go to reports/<sweep>/:

- sweep_history.png       objective per trial in order, best-so-far line; collapsed trials as red
                           X at their (penalized) value, pruned ones hollow at their last reported
                           running objective, failed ones as black x on the bottom edge
- sweep_pair.png          the two `plots.pair` keys (default: the first two numeric axes, e.g.
                           delta_r x eta) as a scatter colored by objective over an interpolated
                           contour (when >= 4 completed trials), same markers
- sweep_parallel.png      parallel coordinates of finished trials (log axes in log10), objective
                           as the last axis; collapsed trials dashed red
- sweep_intermediate.png  the running objective each trial reported to the pruner
- sweep_importances.png   parameter importances (Optuna's default evaluator), when computable

Also writes sweep_trials.csv and sweep_best.json next to the figures.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

MIN_TRIALS_FOR_IMPORTANCE = 3
STYLE = {
    "font.size": 8.5, "axes.titlesize": 9.5, "axes.labelsize": 8.5, "xtick.labelsize": 7.5,
    "ytick.labelsize": 7.5, "legend.fontsize": 7.5, "axes.spines.top": False, "axes.spines.right": False,
    "axes.grid": True, "grid.alpha": 0.3, "grid.linewidth": 0.5,
}
FIG_WIDTH_IN = 7.2
OUTCOME_STYLE = {  # marker, color, filled
    "complete": ("o", "tab:blue", True),
    "collapsed": ("X", "tab:red", True),
    "pruned": ("o", "0.45", False),
    "failed": ("x", "black", True),
    "error": ("x", "black", True),
    "interrupted": ("x", "0.6", True),
    "running": ("s", "0.7", False),
}


@dataclass
class SweepView:
    """What the plots need of a sweep, read back from its study (harness.sweep stores it as the
    study's `sweep` user attr), so a summary needs neither the sweep file nor its train config."""

    name: str
    direction: str
    metric: str
    last_steps: int
    seeds: list[int]
    steps: int
    pruner: str
    plot_pair: list[str]
    search_space: dict[str, dict[str, Any]]
    """key -> {type, low, high, log, step, choices, grid} as resolved by harness.sweep."""
    title: str = ""
    sweep_file: str = ""

    @classmethod
    def of(cls, study: Any) -> "SweepView":
        from harness.sweep import ATTR_SWEEP

        attr = study.user_attrs.get(ATTR_SWEEP)
        if not attr:
            raise ValueError(f"study {study.study_name!r} holds no `{ATTR_SWEEP}` attribute: it was not run by harness.sweep")
        return cls(**attr)

    @property
    def keys(self) -> list[str]:
        return list(self.search_space)

    def numeric(self, key: str) -> bool:
        return self.search_space[key]["type"] != "categorical"


def sweep_summary(sweep: str | Path, tracking_uri: str | None = None, storage_url: str | None = None,
                  *, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Summary of a stored sweep study: `sweep` is its name or its sweep YAML (whose `name` is used).

    Defaults: the train config's default tracking URI, the Optuna store next to it, figures under
    reports/<name>/. Keys: figures (PNG paths), table (one row per trial, concise; table_full has
    every column), best ({} when nothing completed: number, value, params, collapsed,
    mlflow_run_ids), importances ({key: share}; {} with a note when too few trials completed),
    notes, n_by_outcome, table_csv, best_json, parent_run_id.
    """
    import optuna

    from harness.config import from_dict
    from harness.schema import read_yaml
    from harness.sweep import default_storage_url
    from harness.tracking import redact

    name = str(read_yaml(sweep, "sweep file").get("name")) if Path(sweep).suffix in (".yaml", ".yml") else str(sweep)
    tracking_uri = tracking_uri or from_dict({}).logging.tracking_uri
    storage_url = storage_url or default_storage_url(tracking_uri)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=name, storage=storage_url)
    except KeyError:
        raise KeyError(f"no Optuna study named {name!r} in {redact(storage_url)}; run `python -m harness.sweep` on its sweep file first") from None
    view = SweepView.of(study)  # its name was checked by harness.sweep: one safe path component
    return summary_for_study(view, study, tracking_uri, Path(out_dir) if out_dir else Path("reports") / view.name)


# ----------------------------------------------------------------------------------------------
def summary_for_study(spec: SweepView, study: Any, tracking_uri: str | None, out_dir: Path) -> dict[str, Any]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    table = trials_table(spec, study, tracking_uri, notes)
    best = best_trial(spec, table)
    importances = param_importances(spec, study, notes)
    figures: list[str] = []
    from matplotlib import rc_context

    for draw in (plot_history, plot_pair, plot_parallel, plot_intermediate, plot_importances):
        try:
            with rc_context(STYLE):
                path = draw(spec, study, table, importances, out_dir)
        except Exception as e:  # one bad plot must not cost the others
            notes.append(f"{draw.__name__} failed: {type(e).__name__}: {e}")
            path = None
        if path:
            figures.append(str(path))
    table_csv = out_dir / "sweep_trials.csv"
    table.to_csv(table_csv, index=False)
    concise = concise_table(spec, table)
    best_json = out_dir / "sweep_best.json"
    best_json.write_text(json.dumps({"sweep": spec.name, "objective": spec.metric,
                                     "direction": spec.direction, "best": best,
                                     "importances": importances}, indent=1, default=str))
    n_by_outcome = table["outcome"].value_counts().to_dict() if len(table) else {}
    return {
        "figures": figures, "table": concise, "table_full": table, "best": best, "importances": importances,
        "notes": notes, "n_by_outcome": {str(k): int(v) for k, v in n_by_outcome.items()},
        "table_csv": str(table_csv), "best_json": str(best_json), "out_dir": str(out_dir),
        "study_name": spec.name, "tracking_uri": tracking_uri, "view": spec,
        "parent_run_id": _parent_run_id(study, tracking_uri),
    }


def _parent_run_id(study: Any, tracking_uri: str | None) -> str | None:
    from harness.sweep import ATTR_PARENT_RUNS
    from harness.tracking import redact

    return (study.user_attrs.get(ATTR_PARENT_RUNS) or {}).get(redact(tracking_uri or ""))


def _outcome(t: Any) -> str:
    from optuna.trial import TrialState

    if "outcome" in t.user_attrs:
        return str(t.user_attrs["outcome"])
    return {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.RUNNING: "running",
            TrialState.WAITING: "running", TrialState.FAIL: "interrupted"}[t.state]


def trials_table(spec: SweepView, study: Any, tracking_uri: str | None, notes: list[str] | None = None) -> pd.DataFrame:
    """One row per trial: number, state, outcome, value, one column per search-space key, collapse
    and prune details, seed scores, duration, and the trial's MLflow run ids (from MLflow when
    reachable, else from the trial's user attrs)."""
    runs_by_trial = _mlflow_runs_by_trial(spec.name, tracking_uri, notes)
    rows = []
    for t in study.get_trials(deepcopy=False):
        ua = t.user_attrs
        steps = [s for s in (ua.get("collapse_steps") or {}).values() if s is not None]
        last_inter = None
        if t.intermediate_values:
            last_inter = t.intermediate_values[max(t.intermediate_values)]
        row = {
            "number": t.number, "state": t.state.name, "outcome": _outcome(t), "value": t.value,
            **{k: t.params.get(k) for k in spec.keys},
            "collapsed": bool(ua.get("collapsed", False)),
            "collapse_step": min(steps) if steps else None,
            "pruned_at_step": ua.get("pruned_at_step"),
            "last_intermediate": last_inter,
            "seed_scores": ua.get("seed_scores"),
            "seed_raw_scores": ua.get("seed_raw_scores"),
            "failure_reason": ua.get("failure_reason"),
            "duration_s": ua.get("duration_s", round(t.duration.total_seconds(), 2) if t.duration else None),
            "mlflow_run_ids": runs_by_trial.get(t.number) or ua.get("mlflow_run_ids") or [],
            "datetime_start": t.datetime_start,
        }
        rows.append(row)
    cols = ["number", "state", "outcome", "value", *spec.keys, "collapsed", "collapse_step", "pruned_at_step",
            "last_intermediate", "seed_scores", "seed_raw_scores", "failure_reason", "duration_s",
            "mlflow_run_ids", "datetime_start"]
    return pd.DataFrame(rows, columns=cols)


def concise_table(spec: SweepView, table: pd.DataFrame) -> pd.DataFrame:
    """The columns a report shows: number, state, outcome, value, the searched keys, collapse /
    prune step, duration and a shortened failure reason (the CSV keeps everything)."""
    cols = ["number", "state", "outcome", "value", *spec.keys, "collapse_step", "pruned_at_step", "duration_s", "failure_reason"]
    out = table[cols].copy()
    out["failure_reason"] = out["failure_reason"].map(lambda r: "" if r is None or (isinstance(r, float) and math.isnan(r)) else str(r)[:60])
    out["collapse_step"] = out["collapse_step"].map(lambda v: "" if v is None or pd.isna(v) else int(v))
    out["pruned_at_step"] = out["pruned_at_step"].map(lambda v: "" if v is None or pd.isna(v) else int(v))
    return out


def _mlflow_runs_by_trial(sweep: str, tracking_uri: str | None, notes: list[str] | None) -> dict[int, list[str]]:
    """{trial number: its seed runs' ids} from the MLflow child runs tagged with the sweep."""
    from harness import tracking
    from harness.keys import TAG_SWEEP, TAG_TRIAL
    from harness.tracking import redact

    out: dict[int, list[str]] = {}
    try:
        exp = tracking.client(tracking_uri).get_experiment_by_name(sweep) if tracking_uri else None
        for r in tracking.client(tracking_uri).search_runs([exp.experiment_id], f"tags.`{TAG_SWEEP}` = '{sweep}'", max_results=50000) if exp else []:
            if r.data.tags.get(TAG_TRIAL, "").isdigit():
                out.setdefault(int(r.data.tags[TAG_TRIAL]), []).append(r.info.run_id)
    except Exception as e:
        if notes is not None:
            notes.append(f"MLflow runs not read from {redact(tracking_uri or '')}: {type(e).__name__}: {e}")
    return out


def best_trial(spec: SweepView, table: pd.DataFrame) -> dict[str, Any]:
    done = table[(table["state"] == "COMPLETE") & table["value"].notna()] if len(table) else table
    if not len(done):
        return {}
    row = done.loc[done["value"].idxmax() if spec.direction == "maximize" else done["value"].idxmin()]
    return {
        "number": int(row["number"]), "value": float(row["value"]),
        "params": {k: _plain(row[k]) for k in spec.keys if _plain(row[k]) is not None},
        "collapsed": bool(row["collapsed"]), "mlflow_run_ids": list(row["mlflow_run_ids"] or []),
    }


def _plain(v: Any) -> Any:
    """numpy scalar -> Python; NaN (a key this trial did not sample) -> None."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def param_importances(spec: SweepView, study: Any, notes: list[str]) -> dict[str, float]:
    """Optuna's parameter importances, or {} with a note when they cannot be computed yet."""
    import optuna
    from optuna.trial import TrialState

    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if len(spec.keys) < 2:
        notes.append("importances: only one searched parameter")
        return {spec.keys[0]: 1.0} if spec.keys and complete else {}
    if len(complete) < MIN_TRIALS_FOR_IMPORTANCE:
        notes.append(f"importances: need at least {MIN_TRIALS_FOR_IMPORTANCE} completed trials, have {len(complete)}")
        return {}
    if len({t.value for t in complete}) < 2:
        notes.append("importances: every completed trial has the same value")
        return {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            imp = optuna.importance.get_param_importances(study)
    except Exception as e:
        notes.append(f"importances not computable yet: {type(e).__name__}: {e}")
        return {}
    return {k: float(v) for k, v in imp.items()}


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------
def _figure(height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(FIG_WIDTH_IN, height), layout="constrained")


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=150)
    return path


def _y_for(row: pd.Series) -> float | None:
    """Where a trial sits on an objective axis: its value, else its last running objective."""
    if row["value"] is not None and not pd.isna(row["value"]):
        return float(row["value"])
    if row["last_intermediate"] is not None and not pd.isna(row["last_intermediate"]):
        return float(row["last_intermediate"])
    return None


def _bottom(table: pd.DataFrame) -> float:
    """Just below the lowest objective: where trials without one (failed) sit."""
    ys = [v for v in (_y_for(r) for _, r in table.iterrows()) if v is not None]
    return min(ys) - 0.08 * ((max(ys) - min(ys)) or 1.0) if ys else 0.0


def _scatter_by_outcome(ax, table: pd.DataFrame, x, y, bottom: float | None = None, c=None, cmap=None, norm=None):
    """Scatter rows with OUTCOME_STYLE markers; rows without a y sit at `bottom`. Returns the
    colored-by-value mappable (complete trials) for a colorbar, if any."""
    mappable = None
    for outcome, (marker, color, filled) in OUTCOME_STYLE.items():
        sel = table[table["outcome"] == outcome]
        if not len(sel):
            continue
        xs = [x(r) for _, r in sel.iterrows()]
        ys = [y(r) for _, r in sel.iterrows()]
        ys = [bottom if v is None else v for v in ys]
        keep = [(a, b) for a, b in zip(xs, ys) if a is not None and b is not None]
        if not keep:
            continue
        xs, ys = zip(*keep)
        label = f"{outcome} ({len(sel)})"
        if outcome == "complete" and c is not None:
            vals = [c(r) for _, r in sel.iterrows()]
            vals = [v for v, (a, b) in zip(vals, keep)]
            mappable = ax.scatter(xs, ys, c=vals, cmap=cmap, norm=norm, marker=marker, s=36,
                                  edgecolors="black", linewidths=0.4, label=label, zorder=3)
        elif filled:
            ax.scatter(xs, ys, marker=marker, color=color, s=48 if marker == "X" else 36, label=label, zorder=4,
                       edgecolors="white" if marker == "X" else None, linewidths=0.5 if marker == "X" else None)
        else:
            ax.scatter(xs, ys, marker=marker, facecolors="none", edgecolors=color, s=36, label=label, zorder=3)
    return mappable


def plot_history(spec: SweepView, study: Any, table: pd.DataFrame, importances: dict, out_dir: Path) -> Path | None:
    if not len(table):
        return None
    fig = _figure(2.8)
    ax = fig.add_subplot()
    _scatter_by_outcome(ax, table, x=lambda r: r["number"], y=_y_for, bottom=_bottom(table))
    done = table[(table["state"] == "COMPLETE") & table["value"].notna()].sort_values("number")
    if len(done):
        best = done["value"].cummax() if spec.direction == "maximize" else done["value"].cummin()
        ax.step(done["number"], best, where="post", color="tab:green", lw=1.2, label="best so far", zorder=2)
    ax.set_xlabel("trial")
    ax.set_ylabel(spec.metric)
    ax.set_title(f"Sweep {spec.name}: optimization history ({spec.direction})")
    ax.legend(loc="best", frameon=False)
    return _save(fig, out_dir / "sweep_history.png")


def _axis_values(spec: SweepView, key: str, table: pd.DataFrame) -> tuple[list[Any], bool, list[Any] | None]:
    """(values as plotted, log scale?, categories or None) for one search-space key."""
    dim = spec.search_space[key]
    if spec.numeric(key):
        return list(table[key]), bool(dim.get("log")), None
    cats = list(dim.get("choices") or [])
    return [cats.index(v) if v in cats else None for v in table[key]], False, cats


def plot_pair(spec: SweepView, study: Any, table: pd.DataFrame, importances: dict, out_dir: Path) -> Path | None:
    """The two plot keys (e.g. reward.clip x ppo.kl_coef), colored by objective; collapsed marked."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    keys = list(spec.plot_pair)
    if not len(table) or not keys:
        return None
    fig = _figure(3.6)
    ax = fig.add_subplot()
    done = table[(table["state"] == "COMPLETE") & table["value"].notna()]
    vmin, vmax = (done["value"].min(), done["value"].max()) if len(done) else (0.0, 1.0)
    norm = Normalize(vmin=vmin, vmax=vmax if vmax > vmin else vmin + 1e-9)
    cmap = colormaps["viridis"] if spec.direction == "maximize" else colormaps["viridis_r"]
    if len(keys) == 1:  # one numeric axis: objective against it
        key = keys[0]
        dim = spec.search_space[key]
        _scatter_by_outcome(ax, table, x=lambda r: r[key], y=_y_for, bottom=_bottom(table))
        ax.set_xscale("log" if dim.get("log") else "linear")
        ax.set_xlabel(key)
        ax.set_ylabel(spec.metric)
        ax.set_title(f"Sweep {spec.name}: objective vs {key}")
    else:
        kx, ky = keys
        dx = spec.search_space[kx]
        dy = spec.search_space[ky]
        if len(done) >= 4:
            tx = np.log10(done[kx].astype(float)) if dx.get("log") else done[kx].astype(float)
            ty = np.log10(done[ky].astype(float)) if dy.get("log") else done[ky].astype(float)
            try:
                import matplotlib.tri as mtri

                tri = mtri.Triangulation(tx.to_numpy(), ty.to_numpy())
                # plot in data coordinates: transform triangulation back
                tri.x = 10 ** tri.x if dx.get("log") else tri.x
                tri.y = 10 ** tri.y if dy.get("log") else tri.y
                ax.tricontourf(tri, done["value"].astype(float).to_numpy(), levels=12, cmap=cmap, norm=norm, alpha=0.35, zorder=1)
            except Exception:
                pass  # collinear or too few distinct points: scatter only
        mappable = _scatter_by_outcome(ax, table, x=lambda r: r[kx], y=lambda r: r[ky],
                                       c=lambda r: r["value"], cmap=cmap, norm=norm)
        for _, r in table.iterrows():
            if r["outcome"] in ("complete", "collapsed") and r[kx] is not None:
                ax.annotate(str(r["number"]), (r[kx], r[ky]), textcoords="offset points", xytext=(4, 3), fontsize=6, color="0.3")
        ax.set_xscale("log" if dx.get("log") else "linear")
        ax.set_yscale("log" if dy.get("log") else "linear")
        ax.set_xlim(*_limits(dx))
        ax.set_ylim(*_limits(dy))
        ax.set_xlabel(kx)
        ax.set_ylabel(ky)
        ax.set_title(f"Sweep {spec.name}: {kx} × {ky}")
        if mappable is not None:
            fig.colorbar(mappable, ax=ax, label=spec.metric)
    ax.legend(loc="best", frameon=True, framealpha=0.8)
    return _save(fig, out_dir / "sweep_pair.png")


def _limits(dim: dict[str, Any]) -> tuple[float, float]:
    """An axis a little wider than [low, high] on its scale."""
    lo, hi = dim["low"], dim["high"]
    return (lo / 1.15, hi * 1.15) if dim.get("log") else (lo - 0.03 * (hi - lo), hi + 0.03 * (hi - lo))


def plot_parallel(spec: SweepView, study: Any, table: pd.DataFrame, importances: dict, out_dir: Path) -> Path | None:
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    done = table[table["state"] == "COMPLETE"]
    if not len(done) or not spec.keys:
        return None
    axes_keys = list(spec.keys)
    cols: list[np.ndarray] = []
    ticks: list[tuple[list[float], list[str]]] = []
    for key in axes_keys:
        vals, log, cats = _axis_values(spec, key, done)
        dim = spec.search_space[key]
        if cats is not None:
            lo, hi = 0.0, float(max(1, len(cats) - 1))
            arr = np.array([np.nan if v is None else float(v) for v in vals])
            ticks.append(([(i - lo) / (hi - lo) for i in range(len(cats))], [str(c) for c in cats]))
        else:
            f = (lambda v: math.log10(v)) if log else float
            lo, hi = f(dim.get("low")), f(dim.get("high"))
            arr = np.array([f(float(v)) for v in vals])
            tv = np.linspace(lo, hi, 4)
            ticks.append(([(t - lo) / (hi - lo) for t in tv], [f"{(10 ** t if log else t):.3g}" for t in tv]))
        cols.append((arr - lo) / ((hi - lo) or 1.0))
    values = done["value"].astype(float).to_numpy()
    vlo, vhi = float(np.nanmin(values)), float(np.nanmax(values))
    cols.append((values - vlo) / ((vhi - vlo) or 1.0))
    tv = np.linspace(vlo, vhi, 4)
    ticks.append(([(t - vlo) / ((vhi - vlo) or 1.0) for t in tv], [f"{t:.3g}" for t in tv]))
    labels = axes_keys + [spec.metric]
    fig = _figure(3.2)
    ax = fig.add_subplot()
    cmap = colormaps["viridis"] if spec.direction == "maximize" else colormaps["viridis_r"]
    norm = Normalize(vmin=vlo, vmax=vhi if vhi > vlo else vlo + 1e-9)
    xs = np.arange(len(labels))
    collapsed = done["collapsed"].to_numpy()
    for i in np.argsort(values if spec.direction == "maximize" else -values):  # best drawn last
        ys = [c[i] for c in cols]
        if collapsed[i]:
            ax.plot(xs, ys, color="tab:red", lw=1.0, ls="--", alpha=0.8, zorder=2)
        else:
            ax.plot(xs, ys, color=cmap(norm(values[i])), lw=1.4, alpha=0.9, zorder=3)
    for j, (pos, lab) in enumerate(ticks):
        ax.axvline(j, color="0.3", lw=0.8, zorder=1)
        for p, l in zip(pos, lab):
            ax.text(j + 0.03, p, l, fontsize=6.5, va="center", color="0.25")
    ax.set_xticks(xs, labels, rotation=0)
    ax.set_yticks([])
    ax.set_ylim(-0.05, 1.05)
    ax.grid(False)
    ax.set_title(f"Sweep {spec.name}: {len(done)} completed trials" + (" (dashed red = collapsed)" if collapsed.any() else ""))
    from matplotlib.cm import ScalarMappable

    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=spec.metric)
    return _save(fig, out_dir / "sweep_parallel.png")


def plot_intermediate(spec: SweepView, study: Any, table: pd.DataFrame, importances: dict, out_dir: Path) -> Path | None:
    trials = [t for t in study.get_trials(deepcopy=False) if t.intermediate_values]
    if not trials:
        return None
    outcomes = dict(zip(table["number"], table["outcome"]))
    fig = _figure(2.8)
    ax = fig.add_subplot()
    seen: set[str] = set()
    for t in trials:
        steps = sorted(t.intermediate_values)
        out = outcomes.get(t.number, "complete")
        color = {"complete": "tab:blue", "collapsed": "tab:red", "pruned": "0.55"}.get(out, "black")
        ax.plot(steps, [t.intermediate_values[s] for s in steps], color=color, lw=0.9,
                alpha=0.8, label=out if out not in seen else None)
        seen.add(out)
        if out == "pruned":
            ax.plot(steps[-1], t.intermediate_values[steps[-1]], marker="o", mfc="none", color=color, ms=4)
    if len(spec.seeds) > 1:
        for k in range(1, len(spec.seeds)):
            ax.axvline(k * spec.steps + 0.5, color="0.7", lw=0.6, ls=":")
    ax.set_xlabel("step" + (" (seed k runs steps k·steps+1 ...)" if len(spec.seeds) > 1 else ""))
    ax.set_ylabel(f"running {spec.metric}")
    ax.set_title(f"Sweep {spec.name}: running objective seen by the pruner ({spec.pruner})")
    ax.legend(loc="best", frameon=False)
    return _save(fig, out_dir / "sweep_intermediate.png")


def plot_importances(spec: SweepView, study: Any, table: pd.DataFrame, importances: dict, out_dir: Path) -> Path | None:
    if not importances:
        return None
    fig = _figure(0.6 + 0.35 * len(importances))
    ax = fig.add_subplot()
    items = sorted(importances.items(), key=lambda kv: kv[1])
    ax.barh([k for k, _ in items], [v for _, v in items], color="tab:blue")
    for i, (_, v) in enumerate(items):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=7)
    ax.set_xlabel("importance (share)")
    ax.set_title(f"Sweep {spec.name}: parameter importances for {spec.metric}")
    return _save(fig, out_dir / "sweep_importances.png")


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def print_summary(spec: SweepView, s: dict[str, Any]) -> None:
    print(f"== sweep {spec.name}: {spec.metric} ({spec.direction}) ==")
    if len(s["table"]):
        with pd.option_context("display.width", 200, "display.max_columns", 30, "display.max_rows", 200):
            print(s["table"].to_string(index=False))
    best = s["best"]
    print(f"\nbest trial {best['number']}: {spec.metric} = {best['value']:.6g}" + (" (collapsed)" if best["collapsed"] else "")
          if best else "\nno completed trial yet")
    for k, v in (best.get("params") or {}).items():
        print(f"  {k} = {v:.4g}" if isinstance(v, float) else f"  {k} = {v}")
    if s["importances"]:
        print("parameter importances: " + ", ".join(f"{k} {v:.2f}" for k, v in s["importances"].items()))
    for note in s["notes"]:
        print(f"note: {note}")
    print("\nfigures and tables:\n  " + "\n  ".join([*s["figures"], s["table_csv"], s["best_json"]]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.sweep_plots",
                                description="Draw a stored sweep's figures and tables and log them to its MLflow parent run.")
    p.add_argument("sweep", help="the sweep's name (its Optuna study) or its sweep YAML")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the train config's default)")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: optuna.db next to the MLflow sqlite store)")
    p.add_argument("--out-dir", default=None, help="where figures and tables go (default: reports/<name>/)")
    args = p.parse_args(argv)
    try:
        s = sweep_summary(args.sweep, args.tracking_uri, args.storage, out_dir=args.out_dir)
    except (KeyError, ValueError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print_summary(s["view"], s)
    if s["parent_run_id"]:
        from harness import tracking

        files = [*s["figures"], s["table_csv"], s["best_json"]]
        tracking.log_file_artifacts(s["tracking_uri"], s["parent_run_id"], files, artifact_path="sweep")
        print(f"logged to MLflow parent run {s['parent_run_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
