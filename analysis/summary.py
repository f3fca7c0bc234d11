"""Reductions of the tidy metric frame (`AblationData.metrics`): mean and spread over seeds per
step, one number per run (`harness.summary.reduce_run`: final, peak, ...) and per variant.

- smoothing: trailing rolling mean over `k` logged steps, per run, before seeds are combined;
- band: min-max over seeds at each step (with 2-3 seeds an std band would be a guess).
"""
from __future__ import annotations

import pandas as pd

from harness import keys as K
from harness.summary import TRAIN_TABLE, WORLD_TABLE, describe, fmt, fmt_mean_sd, reduce_run


def seed_band(metrics: pd.DataFrame, metric: str, smooth_k: int = 1) -> pd.DataFrame:
    """Per (variant, step): mean, std, min, max and n over seeds of one metric (smoothed per run
    first). Steps a seed did not reach (it stopped early) average over the seeds that did."""
    m = metrics[metrics["metric"] == metric].sort_values(["run_id", "step"])
    if m.empty:
        return pd.DataFrame(columns=["variant", "step", "mean", "std", "min", "max", "n"])
    k = max(int(smooth_k or 1), 1)
    m = m.assign(value=m.groupby("run_id")["value"].transform(lambda s: s.rolling(k, min_periods=1).mean()))
    out = m.groupby(["variant", "step"])["value"].agg(["mean", "std", "min", "max", "count"])
    return out.rename(columns={"count": "n"}).reset_index()


def run_stat(metrics: pd.DataFrame, metric: str, stat: str) -> pd.DataFrame:
    """Per run: run_id, variant, seed, value = `stat` of `metric` over its steps."""
    m = metrics[metrics["metric"] == metric].sort_values("step")
    out = m.groupby(["run_id", "variant", "seed"])["value"].agg(lambda v: reduce_run(v.to_numpy(), stat))
    return out.reset_index()


def final_peak_table(data) -> pd.DataFrame:
    """One row per variant: "mean ± sd over seeds" strings for TRAIN_TABLE (WORLD_TABLE for
    world ablations), plus `collapsed` ("k/n (step mean)", train only). Columns without data anywhere
    are dropped (e.g. gold on HH-RLHF)."""
    world = data.spec.kind == "world"
    spec_cols = WORLD_TABLE if world else TRAIN_TABLE
    if not world and data.shown_metric(K.PPL) == K.PPL_TOKENS:
        spec_cols = [("final ppl (token-pooled)", K.PPL_TOKENS, s) if m == K.PPL else (h, m, s) for h, m, s in spec_cols]
    metrics = data.metrics(sorted({m for _, m, _ in spec_cols}))
    table = pd.DataFrame({"variant": data.variants})
    for header, metric, stat in spec_cols:
        per_run = run_stat(metrics, metric, stat)
        if not per_run.empty:
            table[header] = [fmt_mean_sd(describe(per_run.loc[per_run["variant"] == v, "value"])) for v in data.variants]
    if not world:  # reward-model runs do not collapse
        runs = data.runs.groupby("variant")
        table["collapsed"] = [
            f"{g['collapsed'].sum()}/{len(g)}" + (f" (step {fmt(g['collapse_step'].mean())})" if g["collapse_step"].notna().any() else "")
            for g in (runs.get_group(v) for v in data.variants)]
    return table
