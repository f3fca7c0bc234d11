"""Reductions of the tidy metric frame (`analysis.store.load_metrics`): smoothing, mean and
spread over seeds per step, one number per run (final, peak, ...) and per variant.

Definitions used everywhere (figures, claims, report tables), so they say the same thing:
- smoothing: trailing rolling mean over `k` logged steps, per run, before seeds are combined;
- band: min-max over seeds at each step (with 2-3 seeds an std band would be a guess);
- one number per run (final, peak, ...), mean ± sd over seeds and the final/peak table's columns:
  harness.summary (shared with the ablation runner's end-of-grid table).
"""
from __future__ import annotations

import pandas as pd

from harness import keys as K
from harness.summary import TRAIN_TABLE, WORLD_TABLE, describe, fmt, fmt_mean_sd, reduce_run


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


def run_stat(metrics: pd.DataFrame, metric: str, stat: str) -> pd.DataFrame:
    """Per run: run_id, variant, seed, value = `stat` of `metric` over its steps."""
    m = metrics[metrics["metric"] == metric].sort_values("step")
    rows = [
        {"run_id": rid, "variant": g["variant"].iloc[0], "seed": g["seed"].iloc[0],
         "value": reduce_run(g["value"].to_numpy(), stat)}
        for rid, g in m.groupby("run_id")
    ]
    return pd.DataFrame(rows, columns=["run_id", "variant", "seed", "value"])


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
