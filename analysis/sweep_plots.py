"""The summary of an Optuna sweep (harness/sweep.py), drawn by `python -m analysis.sweep_plots NAME`
into results/<sweep>/ and logged to the sweep's MLflow parent run: Optuna's plots, the `plots.pair`
keys as a scatter (sweep_pair.png), sweep_trials.csv (every trial with its MLflow child runs) and
sweep_best.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import optuna
import pandas as pd
from matplotlib.figure import Figure
from optuna.trial import TrialState
from optuna.visualization import matplotlib as vis

from analysis.figures import FIG_WIDTH_IN
from analysis.store import STUDY_OPTIONS
from harness import tracking
from harness.keys import TAG_SWEEP, TAG_TRIAL
from harness.sweepstore import ATTR_PARENT_RUNS, stored_study

MIN_TRIALS_FOR_IMPORTANCE = 3
# outcome -> (marker, color) where a plot marks a trial that is not a plain completed one
MARKERS = {"collapsed": ("X", "tab:red"), "pruned": ("v", "0.45"), "failed": ("x", "black"), "error": ("x", "black"),
           "interrupted": ("x", "0.6")}
STATE_OUTCOME = {"COMPLETE": "complete", "PRUNED": "pruned", "RUNNING": "running", "WAITING": "running",
                 "FAIL": "interrupted"}
CONCISE = ["number", "outcome", "value", "stopped_at_step", "duration_s", "failure_reason"]
"""The trials table of the report: one table of at most 7 columns for a 2-D sweep (state is in outcome,
the collapse and pruning steps in stopped_at_step; columns empty for every trial are left out)."""


def sweep_summary(sweep: str | Path, tracking_uri: str | None = None, storage_url: str | None = None,
                  *, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Summary of a stored sweep study, by name or sweep YAML; defaults: harness.tracking.resolve_uri's store,
    the Optuna store next to it, files in results/<name>/. Keys: figures (PNG paths), table (concise, one row
    per trial), table_full, best ({} before a trial completed), importances ({} and a note when not
    computable), notes, table_csv, best_json, parent_run_id, tracking_uri, sweep (what harness.sweep stored)."""
    study, attr, tracking_uri, storage_url = stored_study(sweep, tracking_uri, storage_url)
    name = study.study_name
    out = Path(out_dir or Path("results") / name)  # the name was checked by harness.sweep: a safe path component
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    table = trials_table(attr, study, tracking_uri, notes)
    best = next(iter(study.best_trials), None)  # the best COMPLETE trial
    best = {"number": best.number, "value": best.value, "params": best.params,
            "collapsed": bool(best.user_attrs.get("collapsed")),
            "mlflow_run_ids": table.set_index("number").at[best.number, "mlflow_run_ids"]} if best else {}
    importances = param_importances(study, notes)
    figures = draw_figures(attr, study, table, importances, out, notes)
    table.to_csv(out / "sweep_trials.csv", index=False)
    (out / "sweep_best.json").write_text(json.dumps({
        "sweep": name, "objective": attr["metric"], "direction": attr["direction"], "best": best,
        "importances": importances}, indent=1, default=str))
    concise = table[[*CONCISE[:3], *attr["search_space"], *CONCISE[3:]]].dropna(axis="columns", how="all").copy()
    for col, show in (("stopped_at_step", int), ("failure_reason", lambda r: str(r)[:60])):
        if col in concise:
            concise[col] = concise[col].map(lambda v, show=show: "" if pd.isna(v) else show(v))
    return {"figures": figures, "table": concise, "table_full": table, "best": best, "importances": importances,
            "notes": notes, "table_csv": str(out / "sweep_trials.csv"), "best_json": str(out / "sweep_best.json"),
            "parent_run_id": (study.user_attrs.get(ATTR_PARENT_RUNS) or {}).get(tracking.redact(tracking_uri)),
            "tracking_uri": tracking_uri, "sweep": attr}


def trials_table(attr: dict[str, Any], study: Any, tracking_uri: str, notes: list[str]) -> pd.DataFrame:
    """Optuna's trials_dataframe (prefixes dropped) with outcome, first collapse step, last running objective
    and MLflow run ids (from MLflow when reachable: an interrupted trial has no `mlflow_run_ids` attr)."""
    attrs = ("number", "state", "value", "params", "user_attrs", "duration", "datetime_start")
    df = study.trials_dataframe(attrs=attrs)
    df.columns = [c.removeprefix("params_").removeprefix("user_attrs_") for c in df.columns]
    more = ["collapse_steps", "mlflow_run_ids"]
    df = df.reindex(columns=list(dict.fromkeys([*CONCISE, "state", "collapse_step", "pruned_at_step",
                                                *attr["search_space"], *df.columns, *more])))
    df["outcome"] = df["outcome"].fillna(df["state"].map(STATE_OUTCOME))  # no `outcome` attr: by its state
    df["collapse_step"] = df["collapse_steps"].map(
        lambda s: min((v for v in s.values() if v is not None), default=None) if isinstance(s, dict) else None)
    df["stopped_at_step"] = df["collapse_step"].fillna(df["pruned_at_step"])
    trials = study.get_trials(deepcopy=False)
    df["last_intermediate"] = [t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None
                               for t in trials]
    runs = mlflow_runs_by_trial(attr["name"], tracking_uri, notes)
    df["mlflow_run_ids"] = [runs.get(n) or (ids if isinstance(ids, list) else [])
                            for n, ids in zip(df["number"], df["mlflow_run_ids"])]
    return df


def mlflow_runs_by_trial(sweep: str, tracking_uri: str, notes: list[str]) -> dict[int, list[str]]:
    """{trial number: its seed runs' ids} from the MLflow child runs tagged with the sweep."""
    out: dict[int, list[str]] = {}
    try:
        c = tracking.client(tracking_uri)
        exp = c.get_experiment_by_name(sweep)
        query = f"tags.`{TAG_SWEEP}` = '{sweep}'"
        for r in c.search_runs([exp.experiment_id], query, max_results=50000) if exp else []:
            if r.data.tags.get(TAG_TRIAL, "").isdigit():
                out.setdefault(int(r.data.tags[TAG_TRIAL]), []).append(r.info.run_id)
    except Exception as e:  # the Optuna store still has every trial's own record
        notes.append(f"MLflow runs not read from {tracking.redact(tracking_uri)}: {type(e).__name__}: {e}")
    return out


def param_importances(study: Any, notes: list[str]) -> dict[str, float]:
    """Optuna's parameter importances, or {} with a note when they cannot be computed (yet)."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < MIN_TRIALS_FOR_IMPORTANCE or len({t.value for t in complete}) < 2:
        notes.append(f"importances: need {MIN_TRIALS_FOR_IMPORTANCE} completed trials of different values")
        return {}
    try:
        with warnings.catch_warnings(action="ignore"):
            return {k: float(v) for k, v in optuna.importance.get_param_importances(study).items()}
    except Exception as e:
        notes.append(f"importances not computable yet: {type(e).__name__}: {e}")
        return {}


def draw_figures(attr: dict[str, Any], study: Any, table: pd.DataFrame, importances: dict[str, float],
                 out: Path, notes: list[str]) -> list[str]:
    """Every figure that can be drawn yet; one that fails is a note, not a lost summary."""
    table = table.assign(y=table["value"].fillna(table["last_intermediate"]))  # where a trial sits on a y axis
    draws = {
        "sweep_history.png": lambda: _mark(vis.plot_optimization_history(study, target_name=attr["metric"]),
                                           table, "number", "y"),
        "sweep_pair.png": lambda: plot_pair(attr, table) if attr["plot_pair"] and len(table) else None,
        "sweep_parallel.png": lambda: vis.plot_parallel_coordinate(study, target_name=attr["metric"]),
        "sweep_intermediate.png": lambda: vis.plot_intermediate_values(study),  # seed k at steps k*steps+1...
        "sweep_importances.png": lambda: importances and vis.plot_param_importances(study, target_name=attr["metric"]),
    }
    figures = []
    for file, draw in draws.items():
        # Optuna's plots switch pyplot to the ggplot style: rc_context puts the caller's style back.
        with matplotlib.rc_context(), warnings.catch_warnings(action="ignore"):  # Optuna's plots: experimental
            try:
                ax = draw() if len(table) else None
                if ax:
                    ax.set_title(f"Sweep {attr['name']}: {ax.get_title()} ({attr['direction']})")
                    ax.figure.savefig(out / file, dpi=150, bbox_inches="tight")
                    figures.append(str(out / file))
            except Exception as e:
                notes.append(f"{file} failed: {type(e).__name__}: {e}")
            plt.close("all")
    return figures


def _mark(ax: Any, table: pd.DataFrame, x: str, y: str) -> Any:
    """Trials of MARKERS outcomes as their markers (those without a y on the bottom edge), with a legend."""
    ys = pd.to_numeric(table[y], errors="coerce")
    bottom = ys.min() - 0.08 * ((ys.max() - ys.min()) or 1.0) if ys.notna().any() else 0.0
    for outcome, rows in table.groupby("outcome"):
        if outcome in MARKERS:
            marker, color = MARKERS[outcome]
            ax.scatter(rows[x], ys[rows.index].fillna(bottom), marker=marker, color=color, s=48, zorder=5,
                       label=f"{outcome} ({len(rows)})")
    ax.legend(loc="best", fontsize=7, framealpha=0.8)
    return ax


def plot_pair(attr: dict[str, Any], table: pd.DataFrame) -> Any:
    """The pair keys (or objective vs the one key), completed trials colored by objective: a plain scatter."""
    keys = attr["plot_pair"]
    x, y = keys if len(keys) == 2 else (keys[0], "y")
    ax = Figure(figsize=(FIG_WIDTH_IN, FIG_WIDTH_IN / 2), layout="constrained").add_subplot()
    done = table[table["outcome"] == "complete"]
    cmap = "viridis" if attr["direction"] == "maximize" else "viridis_r"
    dots = ax.scatter(done[x], done[y], c=done["value"], cmap=cmap, marker="o", s=36, edgecolors="black",
                      linewidths=0.4, label=f"complete ({len(done)})")
    for _, r in table[table["outcome"].isin(("complete", "collapsed"))].iterrows():
        ax.annotate(str(r["number"]), (r[x], r[y]), textcoords="offset points", xytext=(4, 3), fontsize=6, color="0.3")
    for k, set_scale in ((x, ax.set_xscale), (y, ax.set_yscale)):
        set_scale("log" if attr["search_space"].get(k, {}).get("log") else "linear")
    ax.set_xlabel(x)
    ax.set_ylabel(attr["metric"] if y == "y" else y)
    ax.set_title(f"{x} × {y}" if len(keys) == 2 else f"objective vs {x}")
    if len(keys) == 2 and len(done):
        ax.figure.colorbar(dots, ax=ax, label=attr["metric"])
    return _mark(ax, table, x, y)


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    p = argparse.ArgumentParser(prog="python -m analysis.sweep_plots", description=__doc__, parents=[STUDY_OPTIONS])
    p.add_argument("sweep", help="the sweep's name (its Optuna study) or its sweep YAML")
    p.add_argument("--out-dir", help="where figures and tables go (default: results/<name>/)")
    args = p.parse_args(argv)
    try:
        s = sweep_summary(args.sweep, args.tracking_uri, args.storage, out_dir=args.out_dir)
    except (KeyError, ValueError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    best = s["best"]
    print(f"== sweep {s['sweep']['name']}: {s['sweep']['metric']} ({s['sweep']['direction']}) ==")
    print(s["table"].to_string(index=False, float_format="{:.4g}".format))
    shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.get("params", {}).items())
    print(f"\nbest trial {best['number']}: {s['sweep']['metric']} = {best['value']:.4g} at {shown}"
          + (" (collapsed)" if best["collapsed"] else "") if best else "\nno completed trial yet")
    if s["importances"]:
        print("parameter importances: " + ", ".join(f"{k} {v:.2f}" for k, v in s["importances"].items()))
    for note in s["notes"]:
        print(f"note: {note}")
    files = [*s["figures"], s["table_csv"], s["best_json"]]
    print("\nfigures and tables:\n  " + "\n  ".join(files))
    if s["parent_run_id"]:
        tracking.log_file_artifacts(s["tracking_uri"], s["parent_run_id"], files, artifact_path="sweep")
        print(f"logged to MLflow parent run {s['parent_run_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
