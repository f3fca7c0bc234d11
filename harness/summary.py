"""One number per run, and mean ± sd over seeds, behind every final/peak table (the runner's
end-of-grid table and reports.build.final_peak_table), so a heading means the same everywhere.
final: mean over the last FINAL_TAIL of a run's logged steps (at least one step), so one noisy
last batch does not decide a verdict; initial: the same over the first steps; rise = final -
initial; peak: the largest value; min, mean, last: as named; volatility: std of step-to-step changes.
"""
from __future__ import annotations

import math

import numpy as np

from . import keys as K

FINAL_TAIL = 0.1
"""Fraction of a run's logged steps that `final` (and `initial`) average over."""
TRAIN_TABLE = [
    ("final RM score", K.RM_SCORE, "final"), ("peak RM score", K.RM_SCORE, "peak"),
    ("final gold", K.GOLD_SCORE, "final"), ("peak gold", K.GOLD_SCORE, "peak"),
    ("final KL", K.KL, "final"), ("final ppl", K.PPL, "final"), ("final length", K.LENGTH, "final"),
]
"""Columns of a train grid's final/peak table: (header, metric, statistic)."""
WORLD_TABLE = [("final RM train acc", K.RM_TRAIN_ACC, "final"), ("final RM eval acc", K.RM_EVAL_ACC, "final"),
               ("final RM train loss", K.RM_TRAIN_LOSS, "final")]
"""Columns of a world (reward-model) grid's final table."""


def _tail(values: np.ndarray, end: bool) -> float:
    n = max(1, math.ceil(FINAL_TAIL * len(values)))
    return float((values[-n:] if end else values[:n]).mean())


REDUCTIONS = {
    "final": lambda v: _tail(v, True), "initial": lambda v: _tail(v, False),
    "rise": lambda v: _tail(v, True) - _tail(v, False), "peak": np.max, "min": np.min, "mean": np.mean,
    "volatility": lambda v: np.diff(v).std() if v.size > 2 else float("nan"), "last": lambda v: v[-1],
}
"""Each statistic's reduction of one run's values in step order (definitions: the module doc)."""


def reduce_run(values, stat: str) -> float:
    """One number from one run's values in step order (NaN for no values)."""
    if stat not in REDUCTIONS:
        raise ValueError(f"unknown statistic {stat!r}; allowed: {', '.join(REDUCTIONS)}")
    v = np.asarray(values, dtype=float)
    return float(REDUCTIONS[stat](v)) if v.size else float("nan")


def describe(values) -> dict[str, float]:
    """n, mean, sd (sample, ddof=1; NaN for one value), min, max of finite values."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size == 0:
        return {"n": 0, "mean": float("nan"), "sd": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"n": int(v.size), "mean": float(v.mean()), "sd": float(v.std(ddof=1)) if v.size > 1 else float("nan"),
            "min": float(v.min()), "max": float(v.max())}


def fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}g}"


def fmt_mean_sd(d: dict[str, float]) -> str:
    """'1.23 ± 0.045' (n >= 2), '1.23' (n = 1), '–' (no data)."""
    if d["n"] == 0:
        return "–"
    return fmt(d["mean"]) if d["n"] == 1 else f"{fmt(d['mean'])} ± {fmt(d['sd'], 2)}"


def by_step(points) -> list[float]:
    """A run's values in step order from its logged (step, value) points, in the order they were logged:
    the last value of a step logged twice (a resumed run) wins."""
    last: dict[int, float] = {}
    for step, value in points:
        last[step] = value
    return [last[s] for s in sorted(last)]


def variant_table(per_run, headers: list[str]):
    """Per variant (in first-seen order), mean ± sd over its runs of each header column of `per_run`
    (a pandas DataFrame, one row per run, with a `variant` column): the one end-of-grid table of the
    runner and the reports. With `status` / `collapsed` columns, also the counts of runs, finished,
    failed and collapsed."""
    import pandas as pd

    rows = []
    for name, g in per_run.groupby("variant", sort=False):
        r: dict = {"variant": name}
        if "status" in g:
            r |= {"runs": len(g), "finished": int((g["status"] == "FINISHED").sum()),
                  "failed": int((g["status"] != "FINISHED").sum())}
        if "collapsed" in g:
            r["collapsed"] = int(g["collapsed"].sum())
        for h in headers:
            if h in g:  # no data anywhere (gold on HH-RLHF): no column
                r[h] = fmt_mean_sd(describe(g[h]))
        rows.append(r)
    return pd.DataFrame(rows).set_index("variant") if rows else pd.DataFrame()
