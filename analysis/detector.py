"""The collapse detector (harness.detector) fit on runs whose gold truth is known, and scored on
runs it was not fit on:

    python -m analysis.detector fit --tracking-uri sqlite:///runs.db [--out FILE]   # fit, then evaluate
    python -m analysis.detector evaluate --tracking-uri sqlite:///runs.db [--params FILE]
    python -m analysis.detector evaluate --summary reports/reference.json          # the committed numbers
    python -m analysis.detector export --tracking-uri sqlite:///runs.db --to runs.npz  # the runs, without the store
    python -m analysis.detector families --runs reports/detector/campaign/runs.npz ...  # any command, from that file
    python -m analysis.detector declared --runs A.npz,B.npz --params PA.json,PB.json  # each file, its own detector, pooled

The truth of a run is its gold onset (harness.metrics.GoldTruth, with the run's own collapse
settings): a run whose gold fell, or one whose gold never fell over its whole budget (the detector
campaign runs figure files at 2x their steps, so a negative is a run that held on, not one cut off).

The split (recorded in the fitted file): the fit runs are those on the fit world, of the fit figure
files, at the fit seeds; every other run is held out and grouped by how it differs from them: a
world built from another seed or at another size (one group per world), another figure file on the
fit world, or another seed of a fit file on the fit world. A held-out run whose config and seed
equal a fit run's (vanilla PPO appears in several files) is the same run and is dropped, and so is
one that repeats another held-out run (one configuration in two held-out files). Where both kinds
are held out, the held-out runs are pooled also by their estimator: with a critic (gae, what the
committed detectors were fit on) and critic-free (grpo, rloo, ...).

Fit: a logistic regression (scikit-learn, balanced classes, L2) of the features at each step
(harness.detector.FEATURES) on the label "the gold falls within `lead` steps, or has fallen"; the
threshold is the lowest whose false-alarm rate over the fit runs is at most `--fa-target`.
Scored per run: recall = share of gold falls warned (at any step), false alarms = share of runs
whose gold never fell that were warned, lead = onset - warning step (> 0: warned before the gold
fell); 95% intervals: Clopper-Pearson for the shares, a percentile bootstrap for the median lead.
The same numbers for three baselines, each threshold fit on the fit runs the same way: today's
indicator rule (harness.metrics.IndicatorRule at its paper-scale defaults: nothing to fit), KL above a
threshold alone, and a KL-spike stop as TRL's early_stopping does it (policy/approx_kl above 1.5 x
target_kl).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
from scipy import stats

from analysis.detector_runs import RunData, load_runs, read_runs, save_runs
from analysis.store import distinct_values
from harness import keys as K
from harness import tracking
from harness.algorithms.names import NEEDS_CRITIC
from harness.detector import (
    BASE_FEATURES,
    DEFAULT_PARAMS,
    FAMILIES,
    FEATURES,
    DetectorParams,
    Features,
    family_features,
    load_params,
    reads_audit,
    replay,
    resolve_params,
    signals_of,
)
from harness.metrics import IndicatorRule
from harness.schema import ConfigError
from harness.summary import fmt

MIN_FIT_RUNS = 20  # fewer fit runs, or fewer than MIN_EACH of either kind, make no detector
MIN_EACH = 5
LEADS = (10, 20, 30)  # steps before the onset labelled collapsing, tried by cross-validation
PATIENCES = (3, 5)  # steps over the threshold before a warning, likewise
FA_TARGET = 0.1
FA_BY = ("pooled", "estimator")
"""Over which runs the false alarms of a threshold (and of a cross-validated setting) are held to fa_target
(--fa-by): pooled, every run whose gold held at once (the rate of the fit runs' own mix of estimators), or
estimator, each kind apart: runs with a critic and critic-free runs, each at most fa_target, so that a world
whose held runs are mostly critic-free (campaign 5: 14 of 22) does not meet a detector whose pooled rate hid
the critic-free ones. Measured, not the default: fit on campaigns 1-4 it lowered the cross-validated false alarms
but not campaign 5's held-out ones (0.18 either way, the same GRPO and RLOO runs; bench/RESULTS.md, Session 26)."""
DEFAULT_FIT_FILES = ("score_reparam", "policy_constraints", "adv_value_clip", "kl_eta", "ppo_max")
RESULTS = Path("results") / "detector"


# ------------------------------------------------------------------ the split
@dataclasses.dataclass
class Split:
    """Which runs a detector is fit on; every other run is held out."""

    world: str | list[str]
    """The fit world's hash (or the fit worlds')."""
    files: list[str]
    seeds: list[int]
    trials: list[int] | None = None
    """The design-study trials (configurations) of the fit runs; a fit file's other trials are held out
    (None: every trial)."""

    def group(self, r: RunData, worlds: dict[str, str]) -> str:
        if r.world not in ([self.world] if isinstance(self.world, str) else self.world):
            return f"held-out world: {worlds.get(r.world, r.world)}"
        if r.ablation not in self.files:
            return "held-out figure files"
        if self.trials is not None and r.trial is not None and r.trial not in self.trials:
            return "held-out configurations"
        return "fit" if r.seed in self.seeds else "held-out seeds"


def world_names(runs: list[RunData]) -> dict[str, str]:
    """World hash -> a readable name: its hash, RM accuracy and response cap."""
    out = {}
    for r in runs:
        out.setdefault(r.world, f"{r.world[:8]} (cap {r.cap})")
    return out


def assign(runs: list[RunData], split: Split) -> list[RunData]:
    """Each run's group; a held-out run that is a fit run again, or another held-out run again (same world,
    config and seed: one configuration in two figure files, the same training twice), dropped, so that no
    run is scored twice."""
    names = world_names(runs)
    for r in runs:
        r.group = split.group(r, names)
    seen = {(r.world, r.config_hash, r.seed) for r in runs if r.group == "fit"}
    out = []
    for r in runs:
        key = (r.world, r.config_hash, r.seed)
        if r.group == "fit" or key not in seen:
            out.append(r)
            seen.add(key)
    return out


POOLED = ("held-out, with a critic", "held-out, critic-free", "held-out (all)")
"""Held-out runs pooled across the groups: by whether their estimator has a critic (the committed detectors
were fit on PPO runs with one), and all of them."""


# ------------------------------------------------------------------ features and the fit
def feature_rows(r: RunData, window: int, baseline_steps: int,
                 names: tuple[str, ...] = tuple(FEATURES)) -> tuple[np.ndarray, np.ndarray]:
    """(steps, features [n, len(names)]) of one run, as harness.detector.Features computes them online."""
    f = Features(window, baseline_steps, names)
    steps, rows = [], []
    for step, m in r.rows:
        x = f.update(m)
        if x is not None:
            steps.append(step)
            rows.append([x[k] for k in names])
    return np.asarray(steps), np.asarray(rows, dtype=float).reshape(-1, len(names))


_FEATS: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray]] = {}


def _features_of(r: RunData, window: int, baseline_steps: int, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    key = (r.run_id, window, baseline_steps)
    if key not in _FEATS:  # every feature the run's signals allow, once; a detector reads its columns
        _FEATS[key] = feature_rows(r, window, baseline_steps, tuple(available_features(r)))
    steps, x = _FEATS[key]
    have = available_features(r)
    return steps, x[:, [have.index(n) for n in names]]


def available_features(r: RunData) -> list[str]:
    """The features whose signals the run logged at every step, in FEATURES order."""
    logged = set(r.rows[0][1]) if r.rows else set()
    return [n for n in FEATURES if set(signals_of([n]).values()) <= logged]


def has_features(r: RunData, names: tuple[str, ...]) -> bool:
    return set(names) <= set(available_features(r))


def _train(runs: list[RunData], lead: int, window: int, baseline_steps: int,
           names: tuple[str, ...] = tuple(BASE_FEATURES)) -> tuple:
    """(mean, scale, coef, intercept, names) of the logistic model of the features `names` on the runs'
    steps, labelled 1 from `lead` steps before the onset on."""
    from sklearn.linear_model import LogisticRegression

    xs, ys = [], []
    for r in runs:
        steps, x = _features_of(r, window, baseline_steps, names)
        xs.append(x)
        ys.append((steps >= r.onset - lead) if r.fell else np.zeros(len(steps), dtype=bool))
    X, y = np.vstack(xs), np.concatenate(ys)
    mean, scale = X.mean(0), X.std(0)
    scale[scale < 1e-9] = 1.0
    model = LogisticRegression(C=1.0, class_weight="balanced", max_iter=2000).fit((X - mean) / scale, y)
    return mean, scale, model.coef_[0], float(model.intercept_[0]), names


def _warnings(runs: list[RunData], model: tuple, window: int, baseline_steps: int, threshold: float,
              patience: int) -> list[int | None]:
    """Each run's warning step under `model` (the scores harness.detector computes, here at once per run)."""
    mean, scale, coef, b, names = model
    out = []
    for r in runs:
        steps, x = _features_of(r, window, baseline_steps, names)
        z = np.clip(b + ((x - mean) / scale) @ coef, -60, 60)
        out.append(first_streak(list(zip(steps.tolist(), (1 / (1 + np.exp(-z))).tolist())), threshold, patience))
    return out


def _threshold(runs: list[RunData], model: tuple, window: int, baseline_steps: int, patience: int,
               fa_target: float, fa_by: str = "pooled") -> float:
    return choose_threshold(lambda t: _warnings(runs, model, window, baseline_steps, t, patience), runs, THRESHOLDS,
                            fa_target, fa_by)


CV_FOLDS = 5
"""Folds of the cross-validation by configuration (a design study's fit runs, or figure files of which one
holds out too many of a kind for the rest to fit on): StratifiedGroupKFold, a configuration's runs in one
fold, each fold with runs whose gold fell and runs whose gold held where there are."""


CV_CHOICES = ("auto", "file", "config", "world")
"""How `select` cross-validates (--cv): auto (leave one figure file out, else folds by configuration: the
first whose every fold keeps MIN_EACH runs of each kind to fit on), or one of those, or leave one world out,
asked for by name. Leaving a world out is not the default: on campaign 4, a world none was fit on, the
detector it chose led by 6 steps (cross-validated 11) where the one chosen by figure files led by 8.5
(cross-validated 13), with fewer false alarms (bench/RESULTS.md, Session 25)."""


def cv_folds(runs: list[RunData], cv: str = "auto") -> tuple[str, list[tuple[list[int], list[int]]]]:
    """How the fit runs are split for `select`, and the (train, test) index lists (`cv`: CV_CHOICES): leave
    one figure file out when there are several, else CV_FOLDS folds by configuration, stratified by the gold
    truth; auto takes the first whose every fold keeps MIN_EACH runs of each kind to fit on, a named one
    (world: leave one world out) that does not is an error. (Leaving out the one file whose gold held would
    leave a fold nothing to choose a threshold on: `select` would skip it, and its pooled false alarms would
    rest on the few held runs of the others.)"""
    from sklearn.model_selection import LeaveOneGroupOut, StratifiedGroupKFold

    if cv not in CV_CHOICES:
        raise ConfigError([f"--cv: got {cv!r}; allowed: {', '.join(CV_CHOICES)}"])

    def fits(folds: list) -> bool:
        return all(min(sum(runs[i].fell for i in train), sum(not runs[i].fell for i in train)) >= MIN_EACH
                   for train, _ in folds)

    leave_out = {"world": ("world", "leave one world out", "world(s)"),
                 "file": ("ablation", "leave one figure file out", "figure file(s)")}
    if (name := "file" if cv == "auto" else cv) in leave_out:
        attr, how, noun = leave_out[name]
        groups = [getattr(r, attr) for r in runs]
        folds = list(LeaveOneGroupOut().split(runs, groups=groups)) if len(set(groups)) > 1 else []
        if folds and fits(folds):
            return how, [(list(a), list(b)) for a, b in folds]
        if cv == name:
            raise ConfigError([f"--cv {cv}: the fit runs span {len(set(groups))} {noun}; allowed: at least 2, each "
                               f"left out leaving {MIN_EACH} runs whose gold fell and {MIN_EACH} whose gold held to fit "
                               f"on (or --cv {', '.join(c for c in CV_CHOICES if c != cv)})"])
    configs = [r.config_hash or r.run_id for r in runs]
    # one design-study trial is one configuration on each of its worlds (a config hash per world): one group,
    # named by its smallest hash (a trial on one world keeps its own hash, as before)
    name: dict[tuple[str, int], str] = {}
    for r, c in zip(runs, configs):
        if r.trial is not None:
            name[(r.ablation, r.trial)] = min(c, name.get((r.ablation, r.trial), c))
    configs = [name.get((r.ablation, r.trial), c) if r.trial is not None else c for r, c in zip(runs, configs)]
    k = min(CV_FOLDS, len(set(configs)))
    folds = StratifiedGroupKFold(n_splits=k).split(runs, [r.fell for r in runs], groups=configs)
    return f"{k} folds by configuration", [(list(a), list(b)) for a, b in folds]


def select(runs: list[RunData], *, fa_target: float, leads: tuple[int, ...], patiences: tuple[int, ...],
           window: int, baseline_steps: int, names: tuple[str, ...] = tuple(BASE_FEATURES), cv: str = "auto",
           fa_by: str = "pooled") -> tuple[int, int, list[dict[str, Any]]]:
    """(lead, patience) by cross-validation over the fit runs (`cv_folds`: leave one world, or one figure file,
    out, or folds by configuration; fit and choose the threshold on the rest, warn on the fold): the
    longest median lead among the settings whose out-of-fold false alarms (pooled, or each kind's: `fa_by`,
    the row's fa_gate) are within fa_target and recall at least 0.9, else the best recall minus false alarms
    (ties: the longer lead). Only fit runs are used: the held-out runs stay unseen."""
    how, folds = cv_folds(runs, cv)
    table = []
    for lead in leads:
        for patience in patiences:
            warns: dict[str, int | None] = {}
            for train_i, test_i in folds:
                train, test = [runs[i] for i in train_i], [runs[i] for i in test_i]
                if sum(r.fell for r in train) < MIN_EACH or sum(not r.fell for r in train) < MIN_EACH:
                    continue
                model = _train(train, lead, window, baseline_steps, names)
                t = _threshold(train, model, window, baseline_steps, patience, fa_target, fa_by)
                warns |= dict(zip((r.run_id for r in test), _warnings(test, model, window, baseline_steps, t, patience)))
            scored = [r for r in runs if r.run_id in warns]
            w = [warns[r.run_id] for r in scored]
            s = score(scored, w)
            table.append({"lead": lead, "patience": patience, "recall": s["recall"], "fa_rate": s["fa_rate"],
                          "fa_gate": fa_gate(scored, w, fa_by), "lead_median": s["lead_median"], "runs": s["runs"],
                          "folds": how})
    ok = [row for row in table if row["fa_gate"] <= fa_target and row["recall"] >= 0.9 and row["runs"]]
    best = (max(ok, key=lambda row: (np.nan_to_num(row["lead_median"], nan=-1e9), row["recall"])) if ok
            else max(table, key=lambda row: (np.nan_to_num(row["recall"] - row["fa_gate"], nan=-1e9),
                                             np.nan_to_num(row["lead_median"], nan=-1e9))))
    return best["lead"], best["patience"], table


def fit(runs: list[RunData], *, fa_target: float = FA_TARGET, leads: tuple[int, ...] = LEADS,
        patiences: tuple[int, ...] = PATIENCES, window: int = 10, baseline_steps: int = 5,
        provenance: dict[str, Any] | None = None, names: tuple[str, ...] = tuple(BASE_FEATURES),
        cv: str = "auto", fa_by: str = "pooled") -> DetectorParams:
    """The logistic detector fit on `runs`: its label lead and patience chosen by `select` (cross-validation
    over the runs' worlds, figure files or configurations: `cv_folds`), then the model on every run, its threshold the lowest with at most
    `fa_target` false alarms over them (pooled, or in each kind of estimator: `fa_by`)."""
    fell = sum(r.fell for r in runs)
    if len(runs) < MIN_FIT_RUNS or fell < MIN_EACH or len(runs) - fell < MIN_EACH:
        raise ConfigError([f"fit: got {len(runs)} runs ({fell} whose gold fell, {len(runs) - fell} whose gold never fell); "
                           f"allowed: at least {MIN_FIT_RUNS} runs with at least {MIN_EACH} of each kind (a detector fit "
                           "on fewer says nothing that carries to other runs)"])
    lead, patience, table = select(runs, fa_target=fa_target, leads=leads, patiences=patiences, window=window,
                                   baseline_steps=baseline_steps, names=names, cv=cv, fa_by=fa_by)
    model = _train(runs, lead, window, baseline_steps, names)
    mean, scale, coef, b, _ = model
    params = DetectorParams(features=list(names), mean=mean.tolist(), scale=scale.tolist(), coef=coef.tolist(),
                            intercept=b, threshold=_threshold(runs, model, window, baseline_steps, patience, fa_target,
                                                              fa_by),
                            patience=patience, window=window, baseline_steps=baseline_steps,
                            provenance={**(provenance or {}), "lead": lead, "selection": table, "fa_by": fa_by,
                                        "baselines": {n: baseline_threshold(n, runs, fa_target, fa_by)
                                                      for n in BASELINES}})
    return params


THRESHOLDS = [round(x, 3) for x in np.linspace(0.05, 0.995, 190)]


def held_kinds(runs: list[RunData], fa_by: str = "pooled") -> list[list[int]]:
    """The indices of the runs whose gold held, in the groups whose false alarms are each held to fa_target
    (FA_BY): one group (pooled), or one per kind of estimator with such runs (with a critic, critic-free)."""
    if fa_by not in FA_BY:
        raise ConfigError([f"--fa-by: got {fa_by!r}; allowed: {', '.join(FA_BY)}"])
    neg = [i for i, r in enumerate(runs) if not r.fell]
    if fa_by == "pooled":
        return [neg]
    kinds = ([i for i in neg if runs[i].estimator in NEEDS_CRITIC], [i for i in neg if runs[i].estimator not in NEEDS_CRITIC])
    return [k for k in kinds if k]


def fa_gate(runs: list[RunData], warns: list[int | None], fa_by: str = "pooled") -> float:
    """The false-alarm rate a setting is judged by: over every held run (pooled), or the worst kind's (FA_BY)."""
    rates = [sum(warns[i] is not None for i in k) / len(k) for k in held_kinds(runs, fa_by) if k]
    return max(rates) if rates else math.nan


def choose_threshold(warnings_at: Callable[[float], list[int | None]], runs: list[RunData], grid: list[float],
                     fa_target: float, fa_by: str = "pooled") -> float:
    """The lowest threshold of `grid` whose false-alarm rate over `runs` is at most fa_target, pooled or in
    each kind of estimator (`fa_by`: FA_BY); the highest of the grid when none is."""
    kinds = held_kinds(runs, fa_by)
    for t in sorted(grid):
        w = warnings_at(t)
        if all(sum(w[i] is not None for i in k) <= fa_target * len(k) for k in kinds):
            return t
    return max(grid)


def first_streak(scores: list[tuple[int, float]], threshold: float, patience: int) -> int | None:
    """The step a warning is raised: the first where the score has been >= threshold `patience` steps in a row."""
    streak = 0
    for step, x in scores:
        streak = streak + 1 if x >= threshold else 0
        if streak >= patience:
            return step
    return None


_SCORES: dict[tuple[int, str], tuple[DetectorParams, list[tuple[int, float]]]] = {}


def warn_step(params: DetectorParams, r: RunData, threshold: float | None = None) -> int | None:
    """The detector's warning step on a run (harness.detector.replay's scores; a threshold only picks
    where the same scores cross, so they are computed once per run)."""
    key = (id(params), r.run_id)
    hit = _SCORES.get(key)
    if hit is None or hit[0] is not params:
        # the cache holds the detector it scored, so no later detector can be given its id (and its scores)
        hit = _SCORES[key] = (params, replay(params, r.rows)[0])
    return first_streak(hit[1], params.threshold if threshold is None else threshold, params.patience)


# ------------------------------------------------------------------ baselines
def rule_step(r: RunData, _: float | None = None) -> int | None:
    """Today's indicator rule at its defaults (KL > 2, perplexity < 1.3, 90% at the cap: two of them for
    10 steps), replayed over the logged rows."""
    d = IndicatorRule()
    for step, m in r.rows:
        if d.update(step, m)[1] is not None:
            return step
    return None


def streak_step(r: RunData, key: str, threshold: float, patience: int = 3) -> int | None:
    """The first step where `key` has been above `threshold` for `patience` steps in a row."""
    streak = 0
    for step, m in r.rows:
        streak = streak + 1 if m[key] > threshold else 0
        if streak >= patience:
            return step
    return None


BASELINES: dict[str, tuple[str, list[float], Callable[[RunData, float], int | None]]] = {
    "indicator rule (today's, paper scale)": ("", [0.0], rule_step),
    "KL above a threshold": ("KL (nats)", [round(x, 3) for x in np.geomspace(0.05, 20, 120)],
                             lambda r, t: streak_step(r, K.KL, t)),
    "KL-spike stop (TRL early_stopping)": ("target_kl", [round(x, 5) for x in np.geomspace(1e-4, 2, 120)],
                                           lambda r, t: streak_step(r, K.APPROX_KL, 1.5 * t, patience=1)),
}
"""Name -> (what its threshold is, the thresholds tried, warn step of a run at a threshold)."""


# ------------------------------------------------------------------ scoring
def _ci(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return math.nan, math.nan
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return float(ci.low), float(ci.high)


def score(runs: list[RunData], warns: list[int | None]) -> dict[str, Any]:
    """Recall, false alarms and lead time of warnings `warns` (one per run) against the gold truth."""
    fell = [(r, w) for r, w in zip(runs, warns) if r.fell]
    held = [(r, w) for r, w in zip(runs, warns) if not r.fell]
    hits = [(r, w) for r, w in fell if w is not None]
    leads = np.asarray([r.onset - w for r, w in hits], dtype=float)
    k_fa = sum(w is not None for _, w in held)
    out = {"runs": len(runs), "fell": len(fell), "held": len(held), "warned_fell": len(hits), "false_alarms": k_fa,
           "recall": len(hits) / len(fell) if fell else math.nan, "recall_ci": _ci(len(hits), len(fell)),
           "fa_rate": k_fa / len(held) if held else math.nan, "fa_ci": _ci(k_fa, len(held)),
           "warned_before": int((leads > 0).sum()), "lead_median": float(np.median(leads)) if leads.size else math.nan,
           "lead_ci": (math.nan, math.nan)}
    if leads.size >= 3 and np.ptp(leads) > 0:
        b = stats.bootstrap((leads,), np.median, confidence_level=0.95, method="percentile", random_state=0,
                            n_resamples=2000)
        out["lead_ci"] = (float(b.confidence_interval.low), float(b.confidence_interval.high))
    elif leads.size:
        out["lead_ci"] = (float(leads.min()), float(leads.max()))
    return out


def fmt_steps(x: float | None) -> str:
    """A lead in steps, to a tenth of a step: 106.5 (not 1.1e+02), 5.5 (a bootstrap's 5.488)."""
    return "–" if x is None or not math.isfinite(x) else f"{round(x, 1):g}"


def iv(x: float, ci: Any, f: Callable[[float], str] = lambda v: fmt(v, 2)) -> str:
    """'0.9 [0.8, 0.96]': a number and its interval, each written by `f`."""
    return f"{f(x)} [{f(ci[0])}, {f(ci[1])}]"


def line(s: dict[str, Any]) -> str:
    """'recall 0.9 [0.8, 0.96], false alarms 0.05 [0, 0.2], median lead 12 [8, 15] steps (n runs)'."""
    return (f"recall {iv(s['recall'], s['recall_ci'])}, false alarms {iv(s['fa_rate'], s['fa_ci'])}, "
            f"median lead {iv(s['lead_median'], s['lead_ci'], fmt_steps)} steps ({s['runs']} runs: {s['fell']} fell, "
            f"{s['held']} held)")


def baseline_threshold(name: str, fit_runs: list[RunData], fa_target: float, fa_by: str = "pooled") -> float:
    """A baseline's threshold fit on the fit runs as the detector's is: the lowest with at most fa_target false
    alarms (pooled, or in each kind of estimator: `fa_by`)."""
    _, grid, step_of = BASELINES[name]
    return choose_threshold(lambda t: [step_of(r, t) for r in fit_runs], fit_runs, grid, fa_target, fa_by)


def evaluate(runs: list[RunData], params: DetectorParams, fa_target: float = FA_TARGET) -> dict[str, Any]:
    """Per group of runs (fit and each held-out group, and every held-out run pooled): the detector's
    score at its threshold and each baseline's at the threshold fit on the fit runs; the operating
    curve of the detector over thresholds on the pooled held-out runs."""
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    held = [r for r in runs if r.group != "fit"]
    if not held:
        raise ConfigError(["evaluate: every run of the store is a fit run; allowed: a store with held-out runs "
                           "(another world, figure file or seed)"])
    fit_runs = groups.get("fit", [])
    out: dict[str, Any] = {"threshold": params.threshold, "groups": {}, "baselines": {}, "curve": []}
    names = ["fit", *sorted(g for g in groups if g != "fit"), *POOLED]
    critic = [r for r in held if r.estimator in NEEDS_CRITIC]
    members = {**groups, "held-out (all)": held}
    if 0 < len(critic) < len(held):  # both kinds held out: each pooled too
        members |= {POOLED[0]: critic, POOLED[1]: [r for r in held if r.estimator not in NEEDS_CRITIC]}
    warns = {r.run_id: warn_step(params, r) for r in runs}
    for g in names:
        if g in members:
            out["groups"][g] = score(members[g], [warns[r.run_id] for r in members[g]])
    stored = (params.provenance or {}).get("baselines") or {}
    for name, (unit, grid, step_of) in BASELINES.items():
        # fit on this store's fit runs, else where the detector was (its file keeps them): never on held-out runs
        t = (baseline_threshold(name, fit_runs, fa_target, (params.provenance or {}).get("fa_by", "pooled"))
             if fit_runs else stored.get(name, grid[0]))
        out["baselines"][name] = {"threshold": t, "unit": unit, "held-out (all)": score(held, [step_of(r, t) for r in held]),
                                  **{g: score(members[g], [step_of(r, t) for r in members[g]])
                                     for g in names if g in members and g != "held-out (all)"}}
    for t in THRESHOLDS[::5] + [params.threshold]:
        s = score(held, [warn_step(params, r, t) for r in held])
        out["curve"].append({"threshold": t, **{k: s[k] for k in ("recall", "recall_ci", "fa_rate", "fa_ci",
                                                                   "lead_median", "lead_ci")}})
    out["curve"].sort(key=lambda c: c["threshold"])
    out["runs"] = [{"run_id": r.run_id, "group": r.group, "ablation": r.ablation, "variant": r.variant, "seed": r.seed,
                    "onset": r.onset, "warning": warns[r.run_id], "last_step": r.last_step} for r in runs]
    return out


# ------------------------------------------------------------------ the signal families, ablated
FAMILY_SETS: dict[str, tuple[str, ...]] = {
    "base (today's features)": ("base",),
    "base + diversity": ("base", "diversity"),
    "base + audit RMs": ("base", "audit"),
    "base + forecast": ("base", "forecast"),
    "forecast alone": ("forecast",),
    "every family": tuple(f for f in FAMILIES if f != "trend"),
}
"""The detectors of the ablation: each fit on the same fit runs, scored on the same held-out runs."""
TREND_SETS: dict[str, tuple[str, ...]] = {
    "base + trend": ("base", "trend"),
    "base + audit RMs + trend": ("base", "audit", "trend"),
    "every family + trend": FAMILIES,
}
"""The trend family's sets (`families --trend`): measured in bench/RESULTS.md session 16, not adopted (in
neither fold did they lengthen the held-out lead without more held-out false alarms), so not in the
default ablation, whose choice they would change."""


def cv_row(params: DetectorParams) -> dict[str, Any]:
    """The cross-validated row (fit runs only, out of fold) of the lead and patience `fit` chose."""
    sel = params.provenance["selection"]
    return next(r for r in sel if r["lead"] == params.provenance["lead"] and r["patience"] == params.patience)


def choose_family(results: dict[str, dict[str, Any]], fa_target: float) -> str:
    """The family set chosen on the fit runs alone (its cross-validated row, never a held-out number): the
    longest median lead among those within fa_target false alarms and recall at least 0.9, else the best
    recall minus false alarms, ties to the longer lead. The same rule `select` applies to lead and patience."""
    rows = {name: r["cv"] for name, r in results.items()}
    ok = [n for n, r in rows.items() if r["fa_gate"] <= fa_target and r["recall"] >= 0.9]  # fa_gate: `select`
    if ok:
        return max(ok, key=lambda n: (np.nan_to_num(rows[n]["lead_median"], nan=-1e9), rows[n]["recall"]))
    return max(rows, key=lambda n: (np.nan_to_num(rows[n]["recall"] - rows[n]["fa_gate"], nan=-1e9),
                                    np.nan_to_num(rows[n]["lead_median"], nan=-1e9)))


def ablate_families(runs: list[RunData], *, fa_target: float = FA_TARGET, provenance: dict[str, Any] | None = None,
                    sets: dict[str, tuple[str, ...]] | None = None, cv: str = "auto",
                    fa_by: str = "pooled") -> dict[str, dict[str, Any]]:
    """Per family set: the detector fit on the fit runs that log its signals (lead and patience by
    cross-validation, as `fit`), its cross-validated row, and its evaluation on the held-out runs that
    log them: every set is scored on the same held-out runs where all of them can be (None where every
    run is a fit run: a detector fit on all of them, for runs still to come)."""
    out: dict[str, dict[str, Any]] = {}
    for name, fams in (sets or FAMILY_SETS).items():
        names = tuple(family_features(fams))
        usable = [r for r in runs if has_features(r, names)]
        fit_runs = [r for r in usable if r.group == "fit"]
        try:
            params = fit(fit_runs, fa_target=fa_target, provenance=provenance, names=names, cv=cv, fa_by=fa_by)
        except ConfigError as e:
            out[name] = {"families": list(fams), "error": "; ".join(e.problems)}
            continue
        held = any(r.group != "fit" for r in usable)
        out[name] = {"families": list(fams), "params": params, "cv": cv_row(params),
                     "evaluation": evaluate(usable, params, fa_target) if held else None}
    return out


def family_rows(results: dict[str, dict[str, Any]], chosen: str) -> list[list[str]]:
    """The ablation as a table (header first): per family set its cross-validated numbers on the fit runs
    and its held-out recall, false alarms and median lead with their intervals."""
    rows = [["signals", "fit runs, cross-validated: recall / false alarms / lead", "held-out runs",
             "held-out recall [95% CI]", "held-out false alarms [95% CI]", "held-out median lead, steps [95% CI]"]]
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "not fit", "", "", "", ""])
            continue
        cv, h = r["cv"], r["evaluation"]["groups"]["held-out (all)"]
        rows.append([name + (" (chosen)" if name == chosen else ""),
                     f"{fmt(cv['recall'], 2)} / {fmt(cv['fa_rate'], 2)} / {fmt_steps(cv['lead_median'])}",
                     f"{h['runs']} ({h['fell']} fell)", iv(h["recall"], h["recall_ci"]), iv(h["fa_rate"], h["fa_ci"]),
                     iv(h["lead_median"], h["lead_ci"], fmt_steps)])
    return rows


def print_families(results: dict[str, dict[str, Any]], chosen: str) -> None:
    print("signal families, each detector fit on the fit runs and scored on held-out runs it was not fit on:")
    for name, r in results.items():
        if "error" in r:
            print(f"  {name:<26} not fit: {r['error']}")
            continue
        cv = r["cv"]
        mark = "  <- chosen on the fit runs" if name == chosen else ""
        print(f"  {name:<26} fit runs (cross-validated): recall {fmt(cv['recall'], 2)}, false alarms "
              f"{fmt(cv['fa_rate'], 2)}, median lead {fmt_steps(cv['lead_median'])}{mark}")
        if r["evaluation"]:
            print(f"  {'':<26} held-out: {line(r['evaluation']['groups']['held-out (all)'])}")


def draw_families(results: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    """Each family set's operating curve on the held-out runs: median lead and recall against false alarms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        if "error" in r:
            continue
        c = pd.DataFrame(r["evaluation"]["curve"]).sort_values("fa_rate")
        a.plot(c["fa_rate"], c["lead_median"], "o-", ms=3, label=name)
        b.plot(c["fa_rate"], c["recall"], "o-", ms=3, label=name)
        h = r["evaluation"]["groups"]["held-out (all)"]
        a.plot([h["fa_rate"]], [h["lead_median"]], "k*", ms=9)
    a.axhline(10, color="grey", ls=":", lw=1)
    a.axvline(0.1, color="grey", ls=":", lw=1)
    a.set(xlabel="false-alarm rate (held-out runs whose gold never fell)", ylabel="median lead (steps)",
          title="lead against false alarms (held-out); * = chosen threshold")
    b.set(xlabel="false-alarm rate", ylabel="recall (gold falls warned)", ylim=(-0.02, 1.02), title="recall")
    a.legend(fontsize=7)
    return save_figure(fig, out, "families")


def save_figure(fig: Any, out: Path, stem: str) -> list[Path]:
    """OUT/STEM.png and .pdf, the figure closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    paths = [out / f"{stem}.png", out / f"{stem}.pdf"]
    for p in paths:
        fig.savefig(p, dpi=130)
    plt.close(fig)
    return paths


def summary_line(ev: dict[str, Any]) -> str:
    """The one line the issue asks for: the detector on every held-out run."""
    s = ev["groups"]["held-out (all)"]
    return (f"held-out: recall {fmt(s['recall'], 2)}, false alarms {fmt(s['fa_rate'], 2)}, median lead "
            f"{fmt_steps(s['lead_median'])} steps ({s['runs']} runs)")


def print_evaluation(ev: dict[str, Any]) -> None:
    print(f"detector at threshold {ev['threshold']:g} (scored out of sample except the fit row):")
    for g, s in ev["groups"].items():
        print(f"  {g:<34} {line(s)}")
    for name, b in ev["baselines"].items():
        t = f" ({b['unit']} {b['threshold']:g}, fit on the fit runs)" if b["unit"] else ""
        print(f"baseline {name}{t}:")
        for g, s in b.items():
            if isinstance(s, dict):
                print(f"  {g:<34} {line(s)}")
    print("operating curve on the held-out runs (threshold: recall, false alarms, median lead):")
    print("  " + "; ".join(f"{c['threshold']:.2f}: {fmt(c['recall'], 2)}, {fmt(c['fa_rate'], 2)}, {fmt_steps(c['lead_median'])}"
                           for c in ev["curve"][::3]))
    print(summary_line(ev))


def draw(ev: dict[str, Any], out: Path) -> list[Path]:
    """The operating curve (recall and false alarms over thresholds) and the lead times per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    c = pd.DataFrame(ev["curve"])
    a.plot(c["fa_rate"], c["recall"], "o-", ms=3, label="detector (over thresholds)")
    s = ev["groups"]["held-out (all)"]
    a.plot([s["fa_rate"]], [s["recall"]], "r*", ms=14, label=f"chosen threshold {ev['threshold']:g}")
    for name, bl in ev["baselines"].items():
        h = bl["held-out (all)"]
        a.plot([h["fa_rate"]], [h["recall"]], "s", ms=7, label=name)
    a.set(xlabel="false-alarm rate (runs whose gold never fell)", ylabel="recall (gold falls warned)",
          xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), title="held-out runs")
    a.legend(fontsize=7, loc="lower right")
    runs = pd.DataFrame(ev["runs"])
    hits = runs[runs["onset"].notna() & runs["warning"].notna()].assign(lead=lambda d: d["onset"] - d["warning"])
    groups = [g for g in ev["groups"] if g not in POOLED]
    b.boxplot([hits.loc[hits["group"] == g, "lead"].to_numpy() for g in groups], showfliers=True)
    b.set_xticks(range(1, len(groups) + 1), [g.replace("held-out ", "") for g in groups], rotation=15, fontsize=7)
    b.axhline(0, color="k", lw=0.8)
    b.set(ylabel="lead = gold onset - warning step", title="lead time of warned gold falls")
    return save_figure(fig, out, "detector")


def to_summary(ev: dict[str, Any]) -> dict[str, Any]:
    """What the committed reference summary keeps: the numbers, not the per-run table."""
    return {k: v for k, v in ev.items() if k != "runs"} | {"line": summary_line(ev)}


def table_rows(ev: dict[str, Any]) -> list[list[str]]:
    """The evaluation as a table (header first) for the reports: the detector per group, then each
    baseline on every held-out run."""
    def cells(s: dict[str, Any]) -> list[str]:
        return [f"{s['runs']} ({s['fell']} fell)", iv(s["recall"], s["recall_ci"]), iv(s["fa_rate"], s["fa_ci"]),
                iv(s["lead_median"], s["lead_ci"], fmt_steps)]

    rows = [["warning", "runs", "recall [95% CI]", "false alarms [95% CI]", "median lead, steps [95% CI]"]]
    rows += [[f"detector: {g}", *cells(s)] for g, s in ev["groups"].items()]
    for name, b in ev["baselines"].items():
        t = f" ({b['unit']} {b['threshold']:g})" if b["unit"] else ""
        rows.append([f"{name}{t}: held-out (all)", *cells(b["held-out (all)"])])
    return rows


def load_summary(path: str | Path) -> dict[str, Any] | None:
    """A committed evaluation (evaluation.json written with --out) as the reports read it; None when absent."""
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else None


# ------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m analysis.detector", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    helps = {"fit": "fit a detector, then evaluate it", "evaluate": "evaluate a detector",
             "families": "the signal families ablated: a detector per family set, fit on the fit runs, scored held out"}
    store = "the MLflow store of the runs (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)"
    for name in ("fit", "evaluate", "families"):
        p = sub.add_parser(name, help=helps[name])
        p.add_argument("--tracking-uri", help=store)
        p.add_argument("--runs", metavar="FILE.npz", help="read the runs from a runs file (`export`) instead of a store, "
                       "e.g. a committed campaign's reports/detector/*/runs.npz, or several comma-separated (their "
                       "runs pooled, each run once)")
        p.add_argument("--summary", metavar="JSON", help="evaluate: print the detector section of a reference "
                       "summary (reports/reference.json) instead of reading a store") if name == "evaluate" else None
        p.add_argument("--params", metavar="FILE", help=f"the detector (default: {DEFAULT_PARAMS.name}, the committed one)"
                       if name == "evaluate" else argparse.SUPPRESS)
        p.add_argument("--fit-world", metavar="HASH", help="the fit world's hash or a unique prefix (e.g. the 8 characters "
                       "the tables print), or several comma-separated (default: the detector file's; fit: the world of "
                       "most runs)")
        p.add_argument("--fit-files", metavar="LIST", help=f"figure files of the fit runs (default: "
                       f"{','.join(DEFAULT_FIT_FILES)})")
        p.add_argument("--fit-seeds", metavar="LIST", default=None, help="seeds of the fit runs (default: 0-2)")
        p.add_argument("--fit-trials", metavar="LIST", default=None, help="design-study trials (configurations) of the "
                       "fit runs, e.g. 0-23; the fit files' other trials are held out (default: every trial)")
        p.add_argument("--fa-target", type=float, default=FA_TARGET, help=f"false alarms allowed on the fit runs when "
                       f"a threshold is chosen (default {FA_TARGET})")
        p.add_argument("--out", metavar="DIR", default=str(RESULTS), help=f"figures and JSON (default {RESULTS})")
        if name in ("fit", "families"):
            p.add_argument("--cv", choices=CV_CHOICES, default="auto", help="how lead and patience are "
                           "cross-validated over the fit runs: auto (default: leave one figure file out, else folds by "
                           "configuration, the first that leaves enough of each kind to fit on), file, config, or world "
                           "(leave one world out; measured, not the default: bench/RESULTS.md Session 25)")
            p.add_argument("--fa-by", choices=FA_BY, default="pooled", help="over which runs --fa-target holds: "
                           "pooled (default: every run whose gold held) or estimator (runs with a critic and critic-free "
                           "runs each apart; measured, not the default: bench/RESULTS.md Session 26)")
        if name == "fit":
            p.add_argument("--families", default="base", metavar="LIST", help="signal families whose features the "
                           f"detector reads, of {', '.join(FAMILIES)} (default base: today's features; harness.detector)")
        if name == "families":
            p.add_argument("--save", metavar="FILE", help="write the detector of the family set chosen on the fit runs here")
            p.add_argument("--save-no-audit", metavar="FILE", help="and the one chosen among the sets without the audit "
                           "RMs' signals (a run without audit RMs) here")
            p.add_argument("--trend", action="store_true", help="also the trend family's sets (measured, not adopted: "
                           "bench/RESULTS.md session 16)")
        if name == "fit":
            p.add_argument("--leads", default=",".join(map(str, LEADS)), metavar="LIST", help="steps before the onset "
                           f"labelled as collapsing, tried by cross-validation over the fit runs (default {LEADS})")
            p.add_argument("--patiences", default=",".join(map(str, PATIENCES)), metavar="LIST",
                           help=f"warning patiences tried likewise (default {PATIENCES})")
            p.add_argument("--save", metavar="FILE", help="where the fitted detector goes (default: OUT/detector_params.json; "
                           f"{DEFAULT_PARAMS} is the committed one)")
    d = sub.add_parser("declared", help="campaigns pooled, each scored with the detector declared before it",
                       description="Score each runs file with its own detector (the one declared before that campaign "
                       "was scored) and pool the warnings: the held-out line of a protocol that fits a new detector "
                       "before each campaign, which no single detector's evaluation gives. A file's runs that its "
                       "detector was fit on are left out (and counted).")
    d.add_argument("--runs", metavar="A.npz,B.npz", required=True, help="the campaigns' runs files, comma-separated")
    d.add_argument("--params", metavar="PA.json,PB.json", required=True, help="the detector of each runs file, in the "
                   "same order (one may appear several times)")
    e = sub.add_parser("export", help="write a store's runs, as the detector reads them, to a runs file",
                       description="Write every finished train run of a store, as fit and evaluate read it (per-step "
                       "signals, gold onset, where it belongs), to a compressed .npz that --runs reads back: a "
                       "campaign's runs, committed, refit without the store.")
    e.add_argument("--tracking-uri", help=store)
    e.add_argument("--to", metavar="FILE.npz", required=True, help="the runs file to write")
    return ap


def _source(args: argparse.Namespace) -> tuple[list[RunData], str]:
    """The runs and where they came from: a runs file (--runs) or the store."""
    if getattr(args, "runs", None):
        if args.tracking_uri:
            raise ConfigError([f"--runs {args.runs} and --tracking-uri both given; allowed: one source of runs"])
        runs, seen, where = [], set(), []
        for path in [f.strip() for f in args.runs.split(",") if f.strip()]:
            part, prov = read_runs(path)
            # a run in two files (a file exported twice, a store exported after more runs) counts once
            runs += [r for r in part if r.run_id not in seen]
            seen |= {r.run_id for r in part}
            where.append(f"{path} (exported from {prov.get('store', '?')} at {prov.get('commit', '?')})")
        return runs, " + ".join(where)
    uri = tracking.resolve_uri(args.tracking_uri)
    return load_runs(uri), tracking.redact(uri)


def declared(pairs: list[tuple[list[RunData], DetectorParams]]) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """(the pooled score, each pair's score, the runs left out as fit runs) of runs scored each with its own
    detector: every run held out from its detector's split (analysis.detector.assign), warned by warn_step."""
    runs, warns, each, dropped = [], [], [], 0
    for part, params in pairs:
        mine = [r for r in assign(part, recorded_split(params, part)) if has_features(r, tuple(params.features))]
        held = [r for r in mine if r.group != "fit"]
        dropped += len(part) - len(held)
        w = [warn_step(params, r) for r in held]
        each.append(score(held, w))
        runs += held
        warns += w
    return score(runs, warns), each, dropped


def _declared(args: argparse.Namespace) -> int:
    files = [f.strip() for f in args.runs.split(",") if f.strip()]
    dets = [f.strip() for f in args.params.split(",") if f.strip()]
    if len(files) != len(dets):
        raise ConfigError([f"--params: got {len(dets)} detector files for {len(files)} runs files (--runs); allowed: "
                           "one detector per runs file, in the same order"])
    loaded = {p: load_params(p) for p in dict.fromkeys(dets)}  # each file once: one detector, one cache entry
    pooled, each, dropped = declared([(read_runs(f)[0], loaded[p]) for f, p in zip(files, dets)])
    for f, p, s in zip(files, dets, each):
        print(f"{f} with {p}: {line(s)}")
    if dropped:
        print(f"note: {dropped} runs left out: fit runs of their file's detector, or without a signal it reads")
    print(f"pooled, each runs file with its own detector: {line(pooled)}")
    print(summary_line({"groups": {"held-out (all)": pooled}}))
    return 0


def _export(args: argparse.Namespace) -> int:
    runs, store = _source(args)
    if not runs:
        raise ConfigError([f"{store}: no finished train run with a gold reward and the detector's signals; nothing "
                           "to export"])
    worlds = sorted({r.world for r in runs})
    path = save_runs(runs, args.to, {"commit": tracking.git_commit(), "store": store,
                                     "run_commits": sorted({r.commit for r in runs}), "worlds": worlds})
    print(f"written {len(runs)} runs ({sum(r.fell for r in runs)} whose gold fell; worlds "
          f"{', '.join(w[:8] for w in worlds)}) to {path}, {path.stat().st_size / 1e6:.2f} MB")
    return 0


def recorded_split(params: DetectorParams | None, runs: list[RunData]) -> Split:
    """The split a detector file records (where it records none: the world of most of `runs`, the default fit
    files, seeds 0-2): the runs it was fit on; `--fit-world`, `--fit-files`, ... override it (_split)."""
    stored = (params.provenance.get("split") if params else None) or {}
    world = stored.get("world")
    if world is None:
        world = pd.Series([r.world for r in runs]).value_counts().index[0]
    return Split(world, stored.get("files") or list(DEFAULT_FIT_FILES), stored.get("seeds") or [0, 1, 2],
                 stored.get("trials"))


def _split(args: argparse.Namespace, runs: list[RunData], params: DetectorParams | None) -> Split:
    from harness.registry import parse_seeds

    recorded = recorded_split(params, runs)
    world = recorded.world
    if args.fit_world:
        have = sorted({r.world for r in runs})
        given = [w.strip() for w in args.fit_world.split(",") if w.strip()]
        found = [[h for h in have if h.startswith(w)] for w in given]
        if bad := [w for w, f in zip(given, found) if len(f) != 1]:
            raise ConfigError([f"--fit-world: got {', '.join(bad)}; allowed: the hashes (or unique prefixes, e.g. "
                               f"the 8 characters the tables print) of the worlds these runs are on: {', '.join(have)}"])
        world = [f[0] for f in found] if len(found) > 1 else found[0][0]
    files = args.fit_files.split(",") if args.fit_files else recorded.files
    present = {r.ablation for r in runs}
    if args.cmd != "evaluate" and args.fit_files and (bad := [f for f in files if f not in present]):
        # (evaluate may name the files a detector was fit on elsewhere: none of them here, every run held out)
        raise ConfigError([f"--fit-files: got {','.join(bad)}, which no run here is of; allowed: figure files of these "
                           f"runs: {', '.join(sorted(present))}"])
    seeds = parse_seeds(args.fit_seeds, "--fit-seeds") if args.fit_seeds else recorded.seeds
    trials = parse_seeds(args.fit_trials, "--fit-trials") if args.fit_trials else recorded.trials
    return Split(world, files, seeds, trials)


def store_record(store: str, runs: list[RunData]) -> dict[str, Any]:
    """An evaluation's runs: where from, how many, the code and each provenance tag's values they ran with."""
    seen = distinct_values(r.provenance for r in runs)  # the runs' versions, CPU, worlds: each tag's values
    return {"uri": store, "runs": len(runs), "commits": sorted({r.commit for r in runs}),
            "provenance": {k: sorted(v) for k, v in sorted(seen.items())}}


def _split_text(split: Split) -> str:
    world = split.world if isinstance(split.world, str) else ",".join(split.world)
    return f"world {world}, files {','.join(split.files)}, seeds {','.join(map(str, split.seeds))}"


def _write_params(params: DetectorParams, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(params), indent=1, default=float) + "\n")


def _families(args: argparse.Namespace, runs: list[RunData], prov: dict[str, Any]) -> int:
    results = ablate_families(runs, fa_target=args.fa_target, provenance=prov,
                              sets=FAMILY_SETS | TREND_SETS if args.trend else None, cv=args.cv, fa_by=args.fa_by)
    fitted = {n: r for n, r in results.items() if "error" not in r}
    if not fitted:
        raise ConfigError(list(dict.fromkeys(r["error"] for r in results.values())))  # each problem once
    chosen = choose_family(fitted, args.fa_target)
    no_audit = {n: r for n, r in fitted.items() if not reads_audit(family_features(r["families"]))}
    chosen_no_audit = choose_family(no_audit, args.fa_target) if no_audit else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"chosen": chosen, "chosen_no_audit": chosen_no_audit, "fa_target": args.fa_target, "fa_by": args.fa_by,
               "split": prov["split"],
               "sets": {n: {"families": r["families"], **({"error": r["error"]} if "error" in r else {
                   "cv": r["cv"], "lead": r["params"].provenance["lead"], "patience": r["params"].patience,
                   "threshold": r["params"].threshold, "features": r["params"].features,
                   "evaluation": to_summary(r["evaluation"]) if r["evaluation"] else None})} for n, r in results.items()}}
    (out / "families.json").write_text(json.dumps(summary, indent=1, default=float, sort_keys=True) + "\n")
    scored_ev = fitted[chosen]["evaluation"]  # None: every run a fit run, the choice and the detectors only
    if scored_ev is not None:
        draw_families(fitted, out)
        ev = scored_ev  # the chosen detector's evaluation, as `evaluate --out` writes it, with the ablation
        params = fitted[chosen]["params"]
        ev["detector"] = {"file": str(args.save or chosen), "threshold": params.threshold, "patience": params.patience,
                          "provenance": params.provenance, "families": fitted[chosen]["families"]}
        ev["families"] = {"chosen": chosen, "chosen_no_audit": chosen_no_audit, "rows": family_rows(results, chosen)}
        scored = [r for r in runs if has_features(r, tuple(params.features))]  # the runs the chosen detector was scored on
        ev["store"] = store_record(prov["store"], scored)
        (out / "evaluation.json").write_text(json.dumps(to_summary(ev), indent=1, default=float, sort_keys=True) + "\n")
        draw(ev, out)
    for path, name in ((args.save, chosen), (args.save_no_audit, chosen_no_audit)):
        if path and name:
            _write_params(fitted[name]["params"], Path(path))
            print(f"written {name!r} to {path}")
    print_families(results, chosen)
    print(f"chosen on the fit runs: {chosen}" + (f"; without audit RMs: {chosen_no_audit}" if chosen_no_audit else ""))
    print(summary_line(scored_ev) if scored_ev is not None else
          f"every run here is a fit run ({prov['fit_runs']}): none to score the detectors on. Score them on runs they "
          "were not fit on with `python -m analysis.detector evaluate --params FILE --runs FILE.npz`")
    return 0


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError([f"{flag}: got {text!r}; allowed: a comma-separated list of whole numbers, e.g. 10,20"]) from None
    if any(x < 1 for x in out):
        raise ConfigError([f"{flag}: got {text!r}; allowed: whole numbers >= 1"])
    return out


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "evaluate" and args.summary:
            try:
                ref = json.loads(Path(args.summary).read_text())
            except (OSError, ValueError) as e:
                raise ConfigError([f"--summary: {args.summary!r} is not a JSON summary ({type(e).__name__}); allowed: "
                                   "reports/reference.json or an evaluation.json"]) from None
            # an evaluation.json itself (its "detector" is the detector's parameters), or reports/reference.json
            ev = ref if "groups" in ref else ref.get("detector", ref)
            if "groups" not in ev:
                raise ConfigError([f"--summary {args.summary}: holds no detector evaluation; allowed: reports/reference.json "
                                   "or an evaluation.json written by `python -m analysis.detector evaluate --out DIR`"])
            print_evaluation(ev)
            return 0
        if args.cmd == "evaluate" and args.summary and not Path(args.summary).is_file():
            raise ConfigError([f"--summary: got {args.summary!r}; allowed: an existing reports/reference.json or evaluation.json"])
        leads = _int_list(getattr(args, "leads", None) or ",".join(map(str, LEADS)), "--leads")
        patiences = _int_list(getattr(args, "patiences", None) or ",".join(map(str, PATIENCES)), "--patiences")
        families = [f.strip() for f in (getattr(args, "families", None) or "base").split(",") if f.strip()]
        if bad := [f for f in families if f not in FAMILIES]:
            raise ConfigError([f"--families: got {','.join(bad)}; allowed: a comma-separated list of {', '.join(FAMILIES)}"])
        params = load_params(args.params) if args.cmd == "evaluate" and args.params else (
            resolve_params("default") if args.cmd == "evaluate" else None)
        if args.cmd == "export":
            return _export(args)
        if args.cmd == "declared":
            return _declared(args)
        runs, store = _source(args)
        if not runs:
            raise ConfigError([f"{store}: no finished train run with a gold reward and the detector's "
                               f"signals; allowed: a store of runs on the embedded world (fit needs gold)"])
        split = _split(args, runs, params)
        runs = assign(runs, split)
        fit_runs = [r for r in runs if r.group == "fit"]
        prov = {"commit": tracking.git_commit(), "store": store, "split": dataclasses.asdict(split),
                "worlds": sorted({r.world for r in runs}), "fa_target": args.fa_target,
                "fit_runs": len(fit_runs), "fit_fell": sum(r.fell for r in fit_runs),
                "run_commits": sorted({r.commit for r in fit_runs})}
        held_out = any(r.group != "fit" for r in runs)
        if args.cmd == "evaluate" and not held_out:
            raise ConfigError([f"{args.cmd}: every run here is a fit run ({len(runs)} runs of {_split_text(split)}); "
                               "allowed: runs with held-out ones (another world, figure file or seed than "
                               "--fit-world, --fit-files, --fit-seeds)"])
        if args.cmd == "families":
            return _families(args, runs, prov)
        if args.cmd == "fit":
            names = tuple(family_features(families))
            fit_runs = [r for r in fit_runs if has_features(r, names)]
            params = fit(fit_runs, fa_target=args.fa_target, provenance=prov, leads=leads, patiences=patiences,
                         names=names, cv=args.cv, fa_by=args.fa_by)
            save = Path(args.save or Path(args.out) / "detector_params.json")
            _write_params(params, save)
            print(f"fit on {len(fit_runs)} runs ({sum(r.fell for r in fit_runs)} whose gold fell), features of "
                  f"{', '.join(families)}: lead {params.provenance['lead']}, patience {params.patience} (cross-validated: "
                  f"{params.provenance['selection'][0]['folds']}), threshold {params.threshold:g}; written to {save}")
            if not held_out:
                print(f"every run here is a fit run: none to score it on. Score it on runs it was not fit on with "
                      f"`python -m analysis.detector evaluate --params {save} --tracking-uri STORE` (or --runs FILE.npz)")
                return 0
        kept = [r for r in runs if has_features(r, tuple(params.features))]
        if len(kept) < len(runs):
            print(f"note: {len(runs) - len(kept)} runs do not log every signal the detector reads; scored on the other "
                  f"{len(kept)}")
        runs = kept
        ev = evaluate(runs, params, args.fa_target)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        ev["detector"] = {"file": str(getattr(args, "save", None) or getattr(args, "params", None) or DEFAULT_PARAMS.name),
                          "threshold": params.threshold,
                          "patience": params.patience, "provenance": params.provenance}
        ev["store"] = store_record(store, runs)
        (out / "evaluation.json").write_text(json.dumps(to_summary(ev), indent=1, default=float, sort_keys=True) + "\n")
        draw(ev, out)
        print_evaluation(ev)
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
