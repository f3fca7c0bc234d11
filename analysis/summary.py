"""Reductions of the tidy metric frame (`analysis.store.load_metrics`): smoothing, mean and
spread over seeds per step, one number per run (final, peak, ...) and per variant.

Definitions used everywhere (figures, claims, report tables), so they say the same thing:
- smoothing: trailing rolling mean over `k` logged steps, per run, before seeds are combined;
- band: min-max over seeds at each step (with 2-3 seeds an std band would be a guess);
- final: mean over the last FINAL_TAIL fraction of a run's logged steps (at least one step),
  so one noisy last batch does not decide a verdict; initial: the same over the first steps;
- peak: the largest logged value; volatility: std of step-to-step changes.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from harness import keys as K

FINAL_TAIL = 0.1


def smooth(values: pd.Series, k: int) -> pd.Series:
    """Trailing rolling mean over `k` points (k <= 1: unchanged)."""
    if k is None or k <= 1:
        return values
    return values.rolling(int(k), min_periods=1).mean()


def seed_band(metrics: pd.DataFrame, metric: str, smooth_k: int = 1) -> pd.DataFrame:
    """Per (variant, step): mean, std, min, max and n over seeds of one metric (smoothed per run
    first). Steps a seed did not reach (it stopped early) average over the seeds that did."""
    m = metrics[metrics["metric"] == metric].sort_values(["run_id", "step"])
    cols = ["variant", "step", "mean", "std", "min", "max", "n"]
    if m.empty:
        return pd.DataFrame(columns=cols)
    m = m.assign(value=m.groupby("run_id", group_keys=False)["value"].apply(lambda s: smooth(s, smooth_k)))
    g = m.groupby(["variant", "step"])["value"]
    out = g.agg(["mean", "std", "min", "max", "count"]).rename(columns={"count": "n"}).reset_index()
    return out[cols]


def _tail(values: np.ndarray, frac: float, end: bool) -> np.ndarray:
    n = max(1, math.ceil(frac * len(values)))
    return values[-n:] if end else values[:n]


STATS = ("final", "initial", "rise", "peak", "min", "mean", "volatility", "last")


def reduce_run(values: np.ndarray, stat: str) -> float:
    """One number from one run's values in step order (see module doc for the definitions)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return float("nan")
    if stat == "final":
        return float(_tail(v, FINAL_TAIL, True).mean())
    if stat == "initial":
        return float(_tail(v, FINAL_TAIL, False).mean())
    if stat == "rise":
        return float(_tail(v, FINAL_TAIL, True).mean() - _tail(v, FINAL_TAIL, False).mean())
    if stat == "peak":
        return float(v.max())
    if stat == "min":
        return float(v.min())
    if stat == "mean":
        return float(v.mean())
    if stat == "last":
        return float(v[-1])
    if stat == "volatility":
        return float(np.diff(v).std()) if v.size > 2 else float("nan")
    raise ValueError(f"unknown statistic {stat!r}; allowed: {', '.join(STATS)}")


def run_stat(metrics: pd.DataFrame, metric: str, stat: str) -> pd.DataFrame:
    """Per run: run_id, variant, seed, value = `stat` of `metric` over its steps."""
    m = metrics[metrics["metric"] == metric].sort_values("step")
    rows = [
        {"run_id": rid, "variant": g["variant"].iloc[0], "seed": g["seed"].iloc[0],
         "value": reduce_run(g["value"].to_numpy(), stat)}
        for rid, g in m.groupby("run_id")
    ]
    return pd.DataFrame(rows, columns=["run_id", "variant", "seed", "value"])


def describe(values) -> dict[str, float]:
    """n, mean, sd (sample, ddof=1; NaN for one value), min, max of finite values."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size == 0:
        return {"n": 0, "mean": float("nan"), "sd": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"n": int(v.size), "mean": float(v.mean()), "sd": float(v.std(ddof=1)) if v.size > 1 else float("nan"),
            "min": float(v.min()), "max": float(v.max())}


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{digits}g}"


def fmt_mean_sd(d: dict[str, float]) -> str:
    """'1.23 ± 0.045' (n >= 2), '1.23' (n = 1), '–' (no data)."""
    if d["n"] == 0:
        return "–"
    return fmt(d["mean"]) if d["n"] == 1 else f"{fmt(d['mean'])} ± {fmt(d['sd'], 2)}"


# Columns of the report's final/peak table: (header, metric, statistic).
TRAIN_TABLE = [
    ("final RM score", K.RM_SCORE, "final"),
    ("peak RM score", K.RM_SCORE, "peak"),
    ("final gold", K.GOLD_SCORE, "final"),
    ("peak gold", K.GOLD_SCORE, "peak"),
    ("final KL", K.KL, "final"),
    ("final ppl", K.PPL, "final"),
    ("final length", K.LENGTH, "final"),
]
WORLD_TABLE = [
    ("final RM train acc", K.RM_TRAIN_ACC, "final"),
    ("final RM eval acc", K.RM_EVAL_ACC, "final"),
    ("final RM train loss", K.RM_TRAIN_LOSS, "final"),
]


def final_peak_table(data) -> pd.DataFrame:
    """One row per variant: "mean ± sd over seeds" strings for TRAIN_TABLE (WORLD_TABLE for
    world ablations), plus `collapsed` ("k/n (step mean)", train only). Columns without data anywhere
    are dropped (e.g. gold on HH-RLHF)."""
    spec_cols = WORLD_TABLE if data.spec.kind == "world" else TRAIN_TABLE
    if data.spec.kind != "world" and data.shown_metric(K.PPL) == K.PPL_TOKENS:
        spec_cols = [("final ppl (token-pooled)", K.PPL_TOKENS, s) if m == K.PPL else (h, m, s) for h, m, s in spec_cols]
    metrics = data.metrics(sorted({m for _, m, _ in spec_cols}))
    variants = data.variants
    table = pd.DataFrame({"variant": variants})
    for header, metric, stat in spec_cols:
        per_run = run_stat(metrics, metric, stat)
        if per_run.empty:
            continue
        table[header] = [fmt_mean_sd(describe(per_run.loc[per_run["variant"] == v, "value"])) for v in variants]
    if data.spec.kind == "world":  # reward-model runs do not collapse
        return table
    seeds = data.runs.groupby("variant")
    col = []
    for v in variants:
        g = seeds.get_group(v)
        k = int(g["collapsed"].sum())
        steps = g.loc[g["collapsed"], "collapse_step"].dropna()
        col.append(f"{k}/{len(g)}" + (f" (step {fmt(steps.mean())})" if len(steps) else ""))
    table["collapsed"] = col
    return table
