"""The numbers of a design study's analysis (analysis.tricks has the whole of it, in words): its
configurations and runs read from the Optuna study and the MLflow store (`load_study`), and per choice
value, per choice, per pair of choices and per pair of worlds the statistics with their intervals."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pandas as pd
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState
from scipy import stats as sps

from analysis.stats import proportion_ci
from analysis.store import distinct_values, one_or_sorted, provenance_tags
from harness import tracking
from harness.design import label
from harness.sweepstore import stored_study

NOT_DRAWN = "(not drawn)"
"""A dependent choice's label in a configuration where its `when` did not hold."""
QUANTILE = 95
TOP = 0.05
LEVEL = 0.95
BOOTSTRAP = 1000  # resamples for percentiles, shares and world correlations
IMPORTANCE_BOOTSTRAP = 1000  # resamples for importances (ped_anova and fanova fit twice each: give them ~100)
EVALUATORS = ("anova", "ped_anova", "fanova")
MIN_CONFIGS = 5  # fewer configurations with a value: no percentile interval


@dataclass
class StudyData:
    """A design study's configurations and runs, with what its sweep file says (the ATTR_SWEEP attr)."""

    name: str
    attr: dict[str, Any]
    configs: pd.DataFrame
    """One row per COMPLETE trial: number, one label column per choice, each objective's mean over its runs, runs."""
    runs: pd.DataFrame
    """One row per run: number, run_id, seed, world, collapsed, the choice labels, each objective."""
    tracking_uri: str
    storage_url: str
    notes: list[str] = field(default_factory=list)

    @property
    def choices(self) -> list[str]:
        return list(self.attr["search_space"])

    @property
    def objectives(self) -> list[dict[str, Any]]:
        return list(self.attr.get("objectives") or [])

    @property
    def score(self) -> str:
        """The first objective: what "the score" means in every table."""
        return self.objectives[0]["name"]

    @property
    def maximize(self) -> bool:
        return self.attr.get("direction", "maximize") == "maximize"

    def values(self, choice: str) -> list[str]:
        """The choice's value labels in the file's order, then NOT_DRAWN where it depends on another."""
        dim = self.attr["search_space"][choice]
        drawn = [label(c) for c in dim.get("choices") or []]
        if not drawn:  # a numeric range: the values the trials drew, sorted
            drawn = [label(v) for v in sorted({float(x) for x in self.configs[choice] if x != NOT_DRAWN})]
        return drawn + ([NOT_DRAWN] if dim.get("when") else [])

    @cached_property
    def mlflow_runs(self) -> list[Any]:
        """The MLflow runs of the study's configurations (their experiment's runs that `runs` names), fetched
        once for the throughput and the provenance."""
        ids = set(self.runs["run_id"]) if len(self.runs) else set()
        c = tracking.client(self.tracking_uri)
        exp = c.get_experiment_by_name(self.name)
        return [r for r in (c.search_runs([exp.experiment_id], max_results=50000) if exp else []) if r.info.run_id in ids]

    def worlds(self) -> list[Any]:
        return sorted({w for w in self.runs["world"] if w is not None and w == w}) if len(self.runs) else []


def load_study(name: str | Path, tracking_uri: str | None = None, storage_url: str | None = None) -> StudyData:
    """A design study by name (or its sweep YAML): its COMPLETE trials with their runs' objectives."""
    study, attr, tracking_uri, storage_url = stored_study(name, tracking_uri, storage_url)
    name = study.study_name
    if not attr.get("objectives"):
        raise ValueError(f"study {name!r} has no `objectives` (a sweep file's objectives: section): analysis.tricks "
                         "reads the numbers harness.sweep records per run for a design; for other sweeps use "
                         "analysis.sweep_plots")
    names = [o["name"] for o in attr["objectives"]]
    configs, runs, notes = [], [], []
    trials = study.get_trials(deepcopy=False)
    for t in trials:
        if t.state != TrialState.COMPLETE or not t.user_attrs.get("runs"):
            continue
        labels = {c: label(t.params[c]) if c in t.params else NOT_DRAWN for c in attr["search_space"]}
        rows = [{"number": t.number, **labels, **r, **{k: _num(r.get(k)) for k in names}} for r in t.user_attrs["runs"]]
        runs += rows
        configs.append({"number": t.number, **labels, **{k: float(np.nanmean([r[k] for r in rows]))
                                                        if any(math.isfinite(r[k]) for r in rows) else math.nan
                                                        for k in names}, "runs": len(rows)})
    failed = sum(t.state == TrialState.FAIL and t.user_attrs.get("outcome") == "failed" for t in trials)
    if failed:
        notes.append(f"{failed} trial(s) FAILED (a run's loss went NaN or it raised): left out of every table")
    return StudyData(name, attr, pd.DataFrame(configs, columns=["number", *attr["search_space"], *names, "runs"]),
                     pd.DataFrame(runs), tracking_uri, storage_url, notes)


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


# ------------------------------------------------------------------ per choice value
def _finite(x: Any) -> np.ndarray:
    v = np.asarray(x, dtype=float)
    return v[np.isfinite(v)]


def percentile_ci(x: Any, q: float = QUANTILE, B: int = BOOTSTRAP, seed: int = 0,
                  level: float = LEVEL) -> tuple[float, float, float]:
    """(q-th percentile, bootstrap interval low, high) of x; NaN interval below MIN_CONFIGS values."""
    x = _finite(x)
    if not len(x):
        return math.nan, math.nan, math.nan
    est = float(np.percentile(x, q))
    if B == 0:
        return est, math.nan, math.nan
    if len(x) < MIN_CONFIGS or np.ptp(x) == 0:
        return est, (est if len(x) >= MIN_CONFIGS else math.nan), (est if len(x) >= MIN_CONFIGS else math.nan)
    with warnings.catch_warnings(action="ignore"):
        ci = sps.bootstrap((x,), lambda s, axis: np.percentile(s, q, axis=axis), n_resamples=B, method="percentile",
                           confidence_level=level, rng=np.random.default_rng(seed)).confidence_interval
    return est, float(ci.low), float(ci.high)


def top_mask(scores: np.ndarray, maximize: bool, top: float = TOP) -> np.ndarray:
    """The best ceil(top * n) finite scores (ties at the edge included)."""
    finite = np.isfinite(scores)
    k = max(1, math.ceil(top * finite.sum()))
    signed = np.where(finite, scores if maximize else -scores, -np.inf)
    edge = np.sort(signed)[::-1][k - 1]
    return finite & (signed >= edge)


def value_table(d: StudyData, objective: str | None = None, *, q: float = QUANTILE, top: float = TOP,
                B: int = BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """One row per choice value: n, the score's q-th percentile [CI], mean, collapse rate [CI] over runs,
    share among the top `top` [CI] and share of all configurations."""
    obj = objective or d.score
    scores = d.configs[obj].to_numpy(dtype=float)
    rng = np.random.default_rng(seed)
    boot = [rng.integers(len(scores), size=len(scores)) for _ in range(B)] if len(scores) else []
    tops = [top_mask(scores[i], d.maximize, top) for i in boot]
    in_top = top_mask(scores, d.maximize, top) if len(scores) else np.zeros(0, bool)
    rows = []
    for choice in d.choices:
        col = d.configs[choice].to_numpy()
        for j, v in enumerate(d.values(choice)):
            has = col == v
            est, lo, hi = percentile_ci(scores[has], q, B, seed + j)
            runs = d.runs[d.runs[choice] == v] if len(d.runs) else d.runs
            k, n = int(runs["collapsed"].astype(bool).sum()) if len(runs) else 0, len(runs)
            c_lo, c_hi = proportion_ci(k, n, 1 - LEVEL)
            shares = [float(has[i][m].mean()) if m.any() else math.nan for i, m in zip(boot, tops)]
            s_lo, s_hi = (np.nanpercentile(shares, [50 * (1 - LEVEL), 100 - 50 * (1 - LEVEL)]) if shares
                          else (math.nan, math.nan))
            rows.append({"choice": choice, "value": v, "n": int(has.sum()), "percentile": est, "ci_low": lo,
                         "ci_high": hi, "mean": float(np.nanmean(scores[has])) if has.any() else math.nan,
                         "collapsed": k, "runs": n, "collapse_rate": k / n if n else math.nan,
                         "collapse_low": c_lo, "collapse_high": c_hi,
                         "top_share": float(has[in_top].mean()) if in_top.any() else math.nan,
                         "top_low": float(s_lo), "top_high": float(s_hi), "share": float(has.mean()) if len(has) else
                         math.nan})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------ importances
def _distributions(d: StudyData) -> dict[str, Any]:
    out = {}
    for c, dim in d.attr["search_space"].items():
        if dim.get("choices") is not None:
            out[c] = CategoricalDistribution(dim["choices"])
        elif dim.get("type") == "int":
            out[c] = IntDistribution(int(dim["low"]), int(dim["high"]), log=bool(dim.get("log")))
        else:
            out[c] = FloatDistribution(float(dim["low"]), float(dim["high"]), log=bool(dim.get("log")))
    return out


def trial_params(d: StudyData, storage: Any = None) -> list[dict[str, Any]]:
    """Each configuration's drawn values (not the labels), from its trial."""
    study = storage or optuna.load_study(study_name=d.name, storage=d.storage_url)
    by_number = {t.number: t.params for t in study.get_trials(deepcopy=False)}
    return [by_number[n] for n in d.configs["number"]]


def _evaluate(params: list[dict], values: np.ndarray, dists: dict[str, Any], evaluator: str, maximize: bool,
              seed: int) -> np.ndarray:
    """The evaluator's raw (unnormalized) importance of each choice on these configurations."""
    study = optuna.create_study(direction="maximize" if maximize else "minimize")
    study.add_trials([optuna.trial.create_trial(params=p, distributions={k: dists[k] for k in p}, value=float(v))
                      for p, v in zip(params, values)])
    ev = (optuna.importance.PedAnovaImportanceEvaluator() if evaluator == "ped_anova"
          else optuna.importance.FanovaImportanceEvaluator(seed=seed))
    with warnings.catch_warnings(action="ignore"):
        imp = optuna.importance.get_param_importances(study, evaluator=ev, normalize=False)
    return np.array([float(imp.get(k, 0.0)) for k in dists])


def _eta2(codes: np.ndarray, y: np.ndarray) -> float:
    """eta^2 - (k - 1)/(n - 1) of integer labels `codes` on y (module doc); NaN below 2 values or 3 configurations."""
    k, n = len(np.unique(codes)), len(y)
    ss = float(((y - y.mean()) ** 2).sum())
    if k < 2 or n < 3 or ss == 0:
        return math.nan
    sums, counts = np.bincount(codes, y), np.bincount(codes)
    m = counts > 0
    between = float((sums[m] ** 2 / counts[m]).sum() - y.sum() ** 2 / n)
    return between / ss - (k - 1) / (n - 1)


def _anova_importances(d: StudyData, obj: str, B: int, seed: int) -> pd.DataFrame:
    y_all = d.configs[obj].to_numpy(dtype=float)
    rng = np.random.default_rng(seed)
    rows, alpha = [], (1 - LEVEL) / max(1, len(d.choices))
    for j, c in enumerate(d.choices):
        labels = d.configs[c].to_numpy()
        ok = (labels != NOT_DRAWN) & np.isfinite(y_all)
        codes = np.unique(labels[ok], return_inverse=True)[1] if ok.any() else np.zeros(0, int)
        y, n = y_all[ok], int(ok.sum())
        est = _eta2(codes, y) if n else math.nan
        boot = [_eta2(codes[i], y[i]) for i in (rng.integers(n, size=n) for _ in range(B))] if n else []
        lo, hi = (np.nanpercentile(boot, [50 * alpha, 100 - 50 * alpha]) if np.isfinite(boot).any()
                  else (math.nan, math.nan)) if boot else (math.nan, math.nan)
        k = len(np.unique(codes))
        rows.append({"choice": c, "importance": est + (k - 1) / (n - 1) if n > 1 and math.isfinite(est) else math.nan,
                     "above_chance": est, "ci_low": float(lo), "ci_high": float(hi), "n": n})
    return pd.DataFrame(rows)


def importances(d: StudyData, objective: str | None = None, *, evaluator: str = "anova",
                B: int = IMPORTANCE_BOOTSTRAP, seed: int = 0, params: list[dict] | None = None) -> pd.DataFrame:
    """Per choice: importance, above chance with a Bonferroni bootstrap interval (module doc), n (the
    configurations it was judged on) and the rank by above chance."""
    if evaluator not in EVALUATORS:
        raise ValueError(f"evaluator: got {evaluator!r}; allowed: {', '.join(EVALUATORS)}")
    obj = objective or d.score
    if evaluator == "anova":
        out = _anova_importances(d, obj, B, seed)
        out["rank"] = out["above_chance"].rank(ascending=False, method="min")
        return out.sort_values("rank").reset_index(drop=True)
    keep = np.isfinite(d.configs[obj].to_numpy(dtype=float))
    values = d.configs[obj].to_numpy(dtype=float)[keep]
    params = [p for p, k in zip(params if params is not None else trial_params(d), keep) if k]
    dists = _distributions(d)
    n, k = len(values), len(dists)
    if n < 2 * MIN_CONFIGS or len(set(values)) < 2:
        return pd.DataFrame({"choice": list(dists), "importance": math.nan, "above_chance": math.nan,
                             "ci_low": math.nan, "ci_high": math.nan, "rank": math.nan, "n": n})
    full = _evaluate(params, values, dists, evaluator, d.maximize, seed)
    rng = np.random.default_rng(seed)
    excess, nulls = [], []
    for b in range(B):
        idx = rng.integers(n, size=n)
        p_b, v_b = [params[i] for i in idx], values[idx]
        null_b = _evaluate(p_b, rng.permutation(v_b), dists, evaluator, d.maximize, seed + b)
        excess.append(_evaluate(p_b, v_b, dists, evaluator, d.maximize, seed + b) - null_b)
        nulls.append(null_b)
    total = float(full.sum()) or 1.0
    null = np.mean(nulls, axis=0) if B else np.zeros(k)
    alpha = (1 - LEVEL) / k  # Bonferroni over the choices
    lo, hi = (np.percentile(excess, [50 * alpha, 100 - 50 * alpha], axis=0) if B else (np.full(k, np.nan),) * 2)
    out = pd.DataFrame({"choice": list(dists), "importance": full / total, "above_chance": (full - null) / total,
                        "ci_low": lo / total, "ci_high": hi / total, "n": n})
    out["rank"] = out["above_chance"].rank(ascending=False, method="min")
    return out.sort_values("rank").reset_index(drop=True)


# ------------------------------------------------------------------ interactions
def _rss(X: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    return float(((y - X @ beta) ** 2).sum()), int(np.linalg.matrix_rank(X))


def _one_hot(labels: np.ndarray) -> np.ndarray:
    """Indicator columns of every level but the first (sorted)."""
    levels = sorted(set(labels))
    return np.stack([labels == v for v in levels[1:]], axis=1).astype(float) if len(levels) > 1 else \
        np.zeros((len(labels), 0))


def interaction(a: np.ndarray, b: np.ndarray, y: np.ndarray, others: np.ndarray | None = None,
                where: np.ndarray | None = None) -> dict[str, float] | None:
    """Interaction of labels a, b on y beyond the main effects (of a, b and the `others` columns): the F
    test of the indicators of the (a, b) cells (rows `where`, default all) added to the additive
    least-squares model; its dfs, p, and the share of y's variance it explains. None when a or b has one
    level there or no df is left."""
    where = np.ones(len(y), bool) if where is None else where
    if len(set(a[where])) < 2 or len(set(b[where])) < 2:
        return None
    base = np.hstack([np.ones((len(y), 1)), _one_hot(a), _one_hot(b), *([others] if others is not None else [])])
    cells = sorted(set(zip(a[where], b[where])))
    C = np.stack([(a == x) & (b == z) & where for x, z in cells], axis=1).astype(float)
    rss_add, r_add = _rss(base, y)
    rss_full, r_full = _rss(np.hstack([base, C]), y)
    df_int, df_res = r_full - r_add, len(y) - r_full
    if df_int < 1 or df_res < 1:
        return None
    ss = float(((y - y.mean()) ** 2).sum()) or 1.0
    f = ((rss_add - rss_full) / df_int) / (rss_full / df_res) if rss_full > 0 else math.inf
    return {"F": f, "df_int": df_int, "df_res": df_res, "p": float(sps.f.sf(f, df_int, df_res)),
            "share": (rss_add - rss_full) / ss}


def interactions(d: StudyData, objective: str | None = None) -> pd.DataFrame:
    """Every pair of choices, strongest interaction (smallest p) first; the F test (`interaction`) over all
    configurations, with every other choice's main effect in the model (so that a choice that matters on
    its own does not pass for an interaction of two others), a pair's cells only where both were drawn
    (NOT_DRAWN is a level of its own); `bonferroni`: p below 0.05 / pairs."""
    obj = objective or d.score
    c = d.configs[d.configs[obj].notna()]
    y = c[obj].to_numpy(dtype=float)
    hot = {k: _one_hot(c[k].to_numpy()) for k in d.choices}
    rows = []
    for x, z in combinations(d.choices, 2):
        others = np.hstack([hot[k] for k in d.choices if k not in (x, z)] or [np.zeros((len(y), 0))])
        both = ((c[x] != NOT_DRAWN) & (c[z] != NOT_DRAWN)).to_numpy()
        res = interaction(c[x].to_numpy(), c[z].to_numpy(), y, others, both) if both.sum() > 2 else None
        if res is not None:
            rows.append({"a": x, "b": z, "n": int(both.sum()), **res})
    out = pd.DataFrame(rows, columns=["a", "b", "n", "F", "df_int", "df_res", "p", "share"])
    out["bonferroni"] = out["p"] < (1 - LEVEL) / max(1, len(out))
    return out.sort_values(["p", "share"], ascending=[True, False]).reset_index(drop=True)


def pair_table(d: StudyData, a: str, b: str, objective: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(mean score, count) per value pair of a (rows) and b (columns), where both were drawn."""
    obj = objective or d.score
    sub = d.configs[(d.configs[a] != NOT_DRAWN) & (d.configs[b] != NOT_DRAWN)]
    rows = [v for v in d.values(a) if v != NOT_DRAWN]
    cols = [v for v in d.values(b) if v != NOT_DRAWN]
    mean = sub.pivot_table(index=a, columns=b, values=obj, aggfunc="mean").reindex(index=rows, columns=cols)
    count = sub.pivot_table(index=a, columns=b, values=obj, aggfunc="count").reindex(index=rows, columns=cols)
    return mean, count.fillna(0).astype(int)


# ------------------------------------------------------------------ worlds
def on_world(d: StudyData, world: Any) -> StudyData:
    """The study seen on one world: each configuration's objectives over its runs on that world."""
    runs = d.runs[d.runs["world"] == world]
    names = [o["name"] for o in d.objectives]
    agg = runs.groupby("number")[names].mean().reset_index()
    configs = d.configs.drop(columns=names).merge(agg, on="number", how="inner")
    return StudyData(d.name, d.attr, configs, runs, d.tracking_uri, d.storage_url)


def _percentiles(scores: np.ndarray, labels: dict[str, np.ndarray], values: dict[str, list[str]],
                 q: float) -> np.ndarray:
    out = []
    for c, col in labels.items():
        for v in values[c]:
            x = _finite(scores[col == v])
            out.append(np.percentile(x, q) if len(x) else np.nan)
    return np.asarray(out)


def world_agreement(d: StudyData, objective: str | None = None, *, q: float = QUANTILE, B: int = BOOTSTRAP,
                    seed: int = 0, importance: bool = True, params: list[dict] | None = None) -> pd.DataFrame:
    """Per pair of worlds: Spearman rho of the per-value q-th percentiles [bootstrap CI, configurations resampled
    in pairs], its p, the values compared; and rho of the importances (PED-ANOVA shares, no interval)."""
    obj, worlds = objective or d.score, d.worlds()
    if len(worlds) < 2:
        return pd.DataFrame(columns=["world_a", "world_b", "rho", "ci_low", "ci_high", "p", "values", "configs",
                                     "importance_rho", "importance_p"])
    per = {w: on_world(d, w) for w in worlds}
    common = sorted(set.intersection(*(set(p.configs["number"]) for p in per.values())))
    values = {c: [v for v in d.values(c) if v != NOT_DRAWN] for c in d.choices}
    table = {w: p.configs.set_index("number").loc[common] for w, p in per.items()}
    labels = {c: table[worlds[0]][c].to_numpy() for c in d.choices}
    imps = {}
    if importance:
        all_params = dict(zip(d.configs["number"], params if params is not None else trial_params(d)))
        for w, p in per.items():
            imps[w] = importances(p, obj, B=0, seed=seed, params=[all_params[n] for n in p.configs["number"]])
    rng = np.random.default_rng(seed)
    rows = []
    for wa, wb in combinations(worlds, 2):
        ya, yb = (table[w][obj].to_numpy(dtype=float) for w in (wa, wb))
        pa, pb = _percentiles(ya, labels, values, q), _percentiles(yb, labels, values, q)
        ok = np.isfinite(pa) & np.isfinite(pb)
        rho, p = sps.spearmanr(pa[ok], pb[ok]) if ok.sum() > 2 else (math.nan, math.nan)
        boot = []
        for _ in range(B):
            i = rng.integers(len(common), size=len(common))
            lab = {c: col[i] for c, col in labels.items()}
            xa, xb = _percentiles(ya[i], lab, values, q), _percentiles(yb[i], lab, values, q)
            m = np.isfinite(xa) & np.isfinite(xb)
            if m.sum() > 2:
                with warnings.catch_warnings(action="ignore"):
                    boot.append(sps.spearmanr(xa[m], xb[m])[0])
        lo, hi = np.nanpercentile(boot, [50 * (1 - LEVEL), 100 - 50 * (1 - LEVEL)]) if boot else (math.nan,) * 2
        row = {"world_a": wa, "world_b": wb, "rho": float(rho), "ci_low": float(lo), "ci_high": float(hi),
               "p": float(p), "values": int(ok.sum()), "configs": len(common)}
        if importance:
            ia = imps[wa].set_index("choice")["above_chance"]
            ib = imps[wb].set_index("choice")["above_chance"].reindex(ia.index)
            m = ia.notna() & ib.notna()
            r2, p2 = sps.spearmanr(ia[m], ib[m]) if m.sum() > 2 else (math.nan, math.nan)
            row |= {"importance_rho": float(r2), "importance_p": float(p2)}
        rows.append(row)
    return pd.DataFrame(rows)


# ------------------------------------------------------------------ throughput
def throughput(d: StudyData) -> dict[str, float]:
    """Runs, their summed wall time and the span from the first start to the last end (hours), runs per hour
    over that span (pauses between invocations included) and per hour of run time divided by the runs
    that overlapped on average (the workers)."""
    spans = [(r.info.start_time, r.info.end_time) for r in d.mlflow_runs if r.info.start_time and r.info.end_time]
    if not spans:
        return {"runs": len(d.runs), "hours": math.nan, "runs_per_hour": math.nan, "run_hours": math.nan}
    hours = (max(e for _, e in spans) - min(s for s, _ in spans)) / 3.6e6
    busy = sum(e - s for s, e in spans) / 3.6e6
    return {"runs": len(spans), "hours": hours, "runs_per_hour": len(spans) / hours if hours else math.nan,
            "run_hours": busy, "mean_run_s": busy * 3600 / len(spans)}


def provenance_of(d: StudyData) -> dict[str, Any]:
    """The study's runs' provenance: their commits and each `provenance.*` tag (versions, CPU, worlds) with
    its distinct values (one: the value; several: the sorted list), as reports/reference.json keeps it."""
    return one_or_sorted(distinct_values(provenance_tags(r.data.tags) for r in d.mlflow_runs))


def best_config(d: StudyData, objective: str | None = None) -> dict[str, Any]:
    """The configuration with the best score: its trial number, score, drawn values and runs."""
    obj = objective or d.score
    c = d.configs.dropna(subset=[obj])
    if c.empty:
        return {}
    row = c.loc[c[obj].idxmax() if d.maximize else c[obj].idxmin()]
    return {"number": int(row["number"]), "score": float(row[obj]),
            "values": {k: row[k] for k in d.choices if row[k] != NOT_DRAWN},
            "objectives": {o["name"]: float(row[o["name"]]) for o in d.objectives}}
