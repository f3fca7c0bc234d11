"""Hyperparameter sweeps: an Optuna study over TrainConfig keys, every trial an MLflow child run.

    python -m harness.sweep ablations/sweep_delta_eta.yaml --trials 16 --workers 2
    python -m analysis.sweep_plots sweep_delta_eta      # plots, trials table, best trial

A sweep file becomes tasks here (Optuna's ask/tell on a shared RDB storage: every runner asks the
next trial, each seed of it is a task); the study layer (harness.study) runs them on any executor
(`--executor slurm` as for grids). A trial scores the mean over its seeds (score_run); collapsed
trials stay COMPLETE, a FAILED run fails its trial, the pruner stops weak ones. `--trials` is the
study's TOTAL of trials with an outcome: rerunning continues the study and makes up trials cut off
by Ctrl-C, a dead worker or a dead runner; several runners may share one study.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from statistics import fmean
from typing import Annotated, Any, Callable, Literal, get_args, get_origin

import filelock
import numpy as np
import optuna
import sqlalchemy
from optuna.trial import TrialState
from pydantic import Field, model_validator

from harness import config, keys, prog, schema, tracking
from harness.config import TrainConfig, from_dict, merge
from harness.registry import resolve_file
from harness.schema import Bool, ConfigError, Count, Float, Int, NonNeg, Pos, PosCount, Seed, section
from harness.study import (
    Outcome, Progress, Study, StudyBusy, Task, add_executor_args, cluster_params, find_runs,
)

ATTR_OUTCOME = "outcome"  # trial user attr, set once a trial reached an outcome
ATTR_SWEEP = "sweep"  # study user attr: the resolved sweep (space, objective, ...) that analysis reads
ATTR_PARENT_RUNS = "mlflow_parent_runs"  # study user attr: {masked tracking URI: parent run id}
# Keys that say where a run is logged, or that the sweep sets itself, are not searched.
NOT_SEARCHABLE = (*config.BOOKKEEPING, "seed", "distributed.", "ppo.steps")
Scalar = bool | int | float | str | None
COUNTED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING)  # by MaxTrialsCallback


@section
class Dimension:
    """A search-space axis: `{low, high, log, step}` for a number, `{choices: [...]}` (or a list) for a categorical."""

    type: Literal["float", "int", "categorical"] | None = None
    """How to sample; default: the field's own type (bool and Literal fields: categorical over all values)."""
    low: Float | None = None
    """Lowest value (inclusive); it must itself be a valid value of the config field."""
    high: Float | None = None
    """Highest value (inclusive); it must itself be a valid value of the config field."""
    log: Bool = False
    """Sample on a log scale (needs low > 0)."""
    step: Pos | None = None
    """Discretization step on a linear scale (int axes: 1 by default)."""
    choices: list[Scalar] | None = None
    """Categorical values, each a valid value of the config field."""
    grid: list[Scalar] | None = None
    """Values the grid sampler tries (default: `grid_points` values spaced from low to high, or the choices)."""
    grid_points: PosCount | None = None
    """Grid values spaced from low to high without `grid` (default 3; all of an int range of at most 5)."""

    @model_validator(mode="after")
    def check_bounds(self) -> "Dimension":
        if self.low is not None and self.high is not None and not self.low < self.high:
            raise ValueError("allowed: low < high")
        if self.log and self.low is not None and self.low <= 0:
            raise ValueError("allowed: low > 0 with log: true")
        if self.log and self.step is not None:
            raise ValueError("allowed: step only on a linear scale (log: false)")
        return self

    def suggest(self, trial: Any, key: str) -> Any:
        if self.type == "categorical":
            return trial.suggest_categorical(key, self.choices)
        if self.type == "int":
            return trial.suggest_int(key, int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return trial.suggest_float(key, self.low, self.high, log=self.log, step=self.step)


@section
class Objective:
    """What a trial scores: the mean over its seeds of `metric` averaged over a run's last `last_steps` steps."""

    metric: str = "auto"
    """A step metric from harness/keys.py; auto = objective/gold_score on the world, else objective/rm_score."""
    last_steps: PosCount = 10
    """Logged steps averaged into a run's score."""
    collapsed: Literal["penalty", "worst", "ignore"] = "penalty"
    """How a collapsed run scores: penalty (score_run) | worst (of the completed trials so far) | ignore."""
    collapse_penalty: NonNeg = 1.0
    """What `penalty` takes off a collapsed run's score, in metric units."""


@section
class Sampler:
    """The Optuna sampler; `sampler: tpe` is short for `{name: tpe}`."""

    name: Literal["tpe", "random", "grid"] = "tpe"
    """tpe (multivariate TPE, constant liar for parallel workers) | random | grid (every axis's grid values)."""
    seed: Seed | None = 0
    """Base seed; every worker and continued run offsets it, so none repeats another's draws (null = random)."""
    n_startup_trials: Count = 5
    """tpe: random trials before TPE models the objective."""
    multivariate: Bool = True
    """tpe: model the parameters jointly."""


@section
class Pruner:
    """Stops weak trials early; `pruner: none` is short for `{name: none}`."""

    name: Literal["median", "threshold", "none"] = "median"
    """median (below the median of earlier trials at the same step) | threshold (outside [lower, upper]) | none."""
    n_startup_trials: Count = 4
    """median: trials that finish before any trial is pruned."""
    n_warmup_steps: Count | None = None
    """Steps before a trial can be pruned (default: steps // 5 for median, 0 for threshold)."""
    interval_steps: PosCount = 1
    """Check every this many steps."""
    lower: Float | None = None
    """threshold: prune when the running objective falls below this."""
    upper: Float | None = None
    """threshold: prune when the running objective rises above this."""

    @model_validator(mode="after")
    def check_threshold(self) -> "Pruner":
        if self.name == "threshold" and self.lower is None and self.upper is None:
            raise ValueError("allowed: name threshold with `lower` or `upper`")
        return self


@section
class Plots:
    """Figures drawn by analysis.sweep_plots."""

    pair: list[str] = dataclasses.field(default_factory=list)
    """The two search-space keys of the 2-D plot (default: the first two numeric axes)."""


@section
class SweepFile:
    """A sweep file (YAML, usually ablations/sweep_*.yaml)."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
    """Optuna study name = MLflow experiment = the results/<name>/ folder (one safe path component)."""
    search_space: Annotated[dict[str, Dimension], Field(min_length=1)]
    """TrainConfig leaf key -> Dimension (below); keys: python -m harness.train --help."""
    kind: Literal["sweep"] = "sweep"
    """Optional; a `search_space` already marks a sweep."""
    title: str = ""
    """Title in reports."""
    figure: str = ""
    """Paper figure this sweep belongs to, for reports."""
    description: str = ""
    """Free text for reports."""
    base: str | None = None
    """Train config YAML every trial starts from, relative to this file."""
    set: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Train-config overrides for every trial (dotted keys)."""
    steps: PosCount | None = None
    """Shorthand for ppo.steps (beats `set`; --set beats both)."""
    seeds: Annotated[Int, Field(ge=1, le=1000)] | list[Seed] = 1
    """Seeds per trial: a count n (the config's seed + 0..n-1) or a list; the trial's value is the mean."""
    trials: PosCount | None = None
    """TOTAL trials the study should hold (default 16; with the grid sampler the grid size)."""
    direction: Literal["maximize", "minimize"] = "maximize"
    """Optimization direction of the objective."""
    first_trials: list[dict[str, Scalar]] = dataclasses.field(default_factory=list)
    """Points tried first (enqueued when the study is new); keys left out are sampled."""
    objective: Objective = dataclasses.field(default_factory=Objective)
    """What a trial scores."""
    sampler: Sampler = dataclasses.field(default_factory=Sampler)
    """How trials are sampled."""
    pruner: Pruner = dataclasses.field(default_factory=Pruner)
    """How weak trials are stopped."""
    plots: Plots = dataclasses.field(default_factory=Plots)
    """Figures."""


@dataclasses.dataclass
class SweepSpec:
    """A validated sweep file resolved against TrainConfig."""

    file: SweepFile
    path: Path
    name: str
    direction: str
    base_config: dict[str, Any]  # train config data (base < set < steps < --set), validated; searched keys unset
    space: dict[str, Dimension]  # the axes with type, choices and grid resolved
    metric: str  # the objective metric (`auto` resolved)
    tracking_uri: str  # where trials log (--tracking-uri, else the train config's)
    seeds: list[int]
    trials: int
    steps: int
    plot_pair: list[str]

    def to_attr(self) -> dict[str, Any]:
        """What analysis.sweep_plots needs, stored as the study's ATTR_SWEEP user attr."""
        space = {k: {a: v for a, v in dataclasses.asdict(d).items() if v is not None} for k, d in self.space.items()}
        return {"name": self.name, "direction": self.direction, "metric": self.metric, "plot_pair": self.plot_pair,
                "search_space": space, "sweep_file": str(self.path)}


def _build_config(data: dict[str, Any]) -> tuple[TrainConfig | None, list[str]]:
    """TrainConfig from data, or the problems config validation found."""
    try:
        return from_dict(data), []
    except ConfigError as e:
        return None, list(e.problems)


def _resolve(key: str, dim: Dimension, tp: Any, base: dict[str, Any]) -> tuple[Dimension | None, list[str]]:
    """The axis with type, choices and grid filled in, each bound checked as a value of the field."""
    where = f"search_space.{key}"
    _, inner = schema.base_type(tp)
    literal = get_origin(inner) is Literal  # bool and Literal fields: categorical over all values by default
    values = list(get_args(inner)) if literal else [True, False] if inner is bool else None
    kind = "categorical" if values else inner.__name__ if inner in (int, float) else "other"
    typ = dim.type or ("categorical" if dim.choices is not None else kind)
    if typ == "other":
        return None, [f"{where}: got a range for a field of type {tp}; allowed: `choices: [...]`"]
    if typ != "categorical" and (kind not in ("float", "int") or (typ, kind) == ("float", "int")):
        return None, [f"{where}.type: got {typ!r} but {key} is {'an integer' if kind == 'int' else tp}; "
                      f"allowed: {'int' if kind == 'int' else 'categorical'}"]
    if typ == "categorical":
        choices = dim.choices if dim.choices is not None else values
        if not choices or len({json.dumps(c) for c in choices}) < len(choices):
            return None, [f"{where}.choices: got {choices!r}; allowed: a non-empty list of distinct values"]
        if dim.grid not in (None, choices):
            return None, [f"{where}.grid: a categorical axis uses its choices as grid; allowed: no grid"]
        checks = [("choices", c) for c in choices]
        out = dataclasses.replace(dim, type=typ, choices=list(choices), grid=list(choices))
    else:
        if dim.low is None or dim.high is None:
            return None, [f"{where}: got low={dim.low}, high={dim.high}; allowed: both bounds"]
        bad = [f"{where}.{a}: got {v!r}; allowed: an integer" for a, v in
               (("low", dim.low), ("high", dim.high), ("step", dim.step))
               if typ == "int" and v is not None and not float(v).is_integer()]
        n = dim.grid_points or (int(dim.high - dim.low) + 1 if typ == "int" and dim.high - dim.low < 5 else 3)
        spaced = (np.geomspace if dim.log else np.linspace)(dim.low, dim.high, n)  # even on the axis's scale
        spaced = sorted({int(round(v)) for v in spaced}) if typ == "int" else [float(f"{v:.6g}") for v in spaced]
        grid = dim.grid or spaced
        bad += [f"{where}.grid.{i}: got {g!r}; allowed: numbers in [{dim.low:g}, {dim.high:g}]"
                for i, g in enumerate(grid) if isinstance(g, (bool, str)) or g is None or not dim.low <= g <= dim.high]
        if bad:
            return None, bad
        cast = int if typ == "int" else float
        checks = [("low", cast(dim.low)), ("high", cast(dim.high))]
        out = dataclasses.replace(dim, type=typ, grid=[cast(g) for g in grid])
    problems = [f"{where}.{label}: {p}" for label, v in checks for p in _build_config(merge(base, {key: v}))[1]]
    return (None if problems else out), list(dict.fromkeys(problems))


def _apply_sweep_overrides(raw: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`--set sweep.<field>=v`; search-space keys are dotted themselves: `sweep.search_space.ppo.kl_coef.low=0.01`."""
    out = merge(raw, {k: v for k, v in over.items() if not k.startswith("search_space.")})
    space = out.get("search_space")
    for k, v in over.items():
        key, _, attr = k.removeprefix("search_space.").rpartition(".")
        if k.startswith("search_space.") and isinstance(space, dict):
            if key and attr in {f.name for f in dataclasses.fields(Dimension)}:
                space[key] = {**(space.get(key) or {}), attr: v}
            else:
                space[k.removeprefix("search_space.")] = v
    return out


def _point_problems(f: SweepFile, space: dict[str, Dimension]) -> list[str]:
    """What is wrong with the `first_trials` points: each value must be one the sampler can draw."""
    problems = []
    for i, point in enumerate(f.first_trials):
        for k, v in point.items():
            d, at = space.get(k), f"first_trials.{i}.{k}"
            if k not in f.search_space:
                problems.append(f"{at}: not a search-space key" + schema.did_you_mean(k, f.search_space))
            elif d is None:
                continue  # the axis itself is wrong (reported already)
            elif f.sampler.name == "grid" or d.type == "categorical":
                if v not in d.grid or type(v) is not type(d.grid[d.grid.index(v)]):
                    problems.append(f"{at}: got {v!r}; allowed: one of {d.grid}")
            elif (isinstance(v, (bool, str)) or v is None or not d.low <= v <= d.high
                  or (d.type == "int" and not float(v).is_integer())):
                what = "an integer" if d.type == "int" else "a number"
                problems.append(f"{at}: got {v!r}; allowed: {what} in [{d.low:g}, {d.high:g}]")
    return problems


def load_sweep(path: str | Path, overrides: list[str] | None = None, tracking_uri: str | None = None) -> SweepSpec:
    """Validate a sweep file, its world, data and models (ConfigError lists every problem). `overrides`:
    `--set` items; `sweep.<field>=v` changes the sweep file, any other key the train config of every trial."""
    from harness.models import preflight  # lazy: torch

    path = Path(path)
    raw = schema.read_yaml(path, "sweep file")
    over = config.parse_overrides(overrides)
    raw = _apply_sweep_overrides(raw, {k.removeprefix("sweep."): v for k, v in over.items() if k.startswith("sweep.")})
    raw.update({k: {"name": raw[k]} for k in ("sampler", "pruner") if isinstance(raw.get(k), str)})
    if isinstance(raw.get("search_space"), dict):
        raw["search_space"] = {k: {"choices": v} if isinstance(v, list) else (v or {})
                               for k, v in raw["search_space"].items()}
    f: SweepFile = schema.validate(SweepFile, raw, str(path))

    problems: list[str] = []
    base = resolve_file(f.base, path, f"{path}: base", problems)  # as a figure file's base: beside it, or ablations/
    if problems:
        raise ConfigError(problems)
    train_over = {k: v for k, v in over.items() if not k.startswith("sweep.")}
    # precedence: base file < set < steps < --set; the experiment is the sweep; the store: tracking.resolve_uri
    layers = [f.set, {"ppo.steps": f.steps} if f.steps else {}, {"logging.experiment": f.name}]
    _, in_file = _build_config(functools.reduce(merge, layers, base))
    if in_file:  # the file's own settings are wrong
        raise ConfigError([f"{path}: train config: {p}" for p in in_file])
    data = merge(functools.reduce(merge, layers, base), train_over)
    cfg, problems = _build_config(data)
    if cfg is None:  # what the file has is valid: the command line's --set is not
        raise ConfigError([f"--set: {p}" for p in problems])

    types_ = {key: tp for key, tp, *_ in schema.iter_fields(TrainConfig)}
    space: dict[str, Dimension] = {}
    for key, dim in f.search_space.items():
        if key not in types_:
            problems.append(f"search_space.{key}: not a TrainConfig key" + schema.did_you_mean(key, types_))
        elif key.startswith(NOT_SEARCHABLE):
            problems.append(f"search_space.{key}: not searchable; allowed: keys that change what a run computes, "
                            f"not {', '.join(NOT_SEARCHABLE)} (several seeds per trial: `seeds:`; steps: `steps:`)")
        else:
            d, p = _resolve(key, dim, types_[key], data)
            problems += p
            if d is not None:
                space[key] = d

    gold = cfg.data.source == "world"
    metric = f.objective.metric if f.objective.metric != "auto" else (keys.GOLD_SCORE if gold else keys.RM_SCORE)
    known = keys.KNOWN_METRICS
    if metric not in known:
        problems.append(f"objective.metric: got {metric!r}; allowed: auto or a metric key from harness/keys.py"
                        + schema.did_you_mean(metric, known))
    elif not gold and metric in (keys.GOLD_SCORE, keys.GOLD_SCORE_STD, keys.EVAL_GOLD, keys.EVAL_WIN_RATE):
        problems.append(f"objective.metric: got {metric!r} with data.source={cfg.data.source}; "
                        f"allowed: a metric that source logs, e.g. {keys.RM_SCORE}")
    seeds = [cfg.seed + i for i in range(f.seeds)] if isinstance(f.seeds, int) else list(f.seeds)
    if not seeds or len(set(seeds)) < len(seeds):
        problems.append(f"seeds: got {f.seeds!r}; allowed: a count >= 1 or a list of distinct integers")
    grid_size = math.prod(len(d.grid or []) for d in space.values())
    n_trials = f.trials or (grid_size if f.sampler.name == "grid" else 16)
    if f.sampler.name == "grid" and space and n_trials > grid_size:
        problems.append(f"trials: got {n_trials} with sampler grid; allowed: at most the grid size {grid_size}")
    if cfg.ppo.steps < 1:
        problems.append("ppo.steps: got 0; allowed: an integer >= 1 for a sweep (set `steps:`)")
    problems += preflight(cfg) + _point_problems(f, space)
    numeric = [k for k, d in space.items() if d.type != "categorical"]
    pair = list(f.plots.pair) or numeric[:2]
    if f.plots.pair and (len(pair) != 2 or not set(pair) <= set(numeric) | (set(f.search_space) - set(space))):
        problems.append(f"plots.pair: got {pair!r}; allowed: two numeric search-space keys from {numeric}")
    if problems:
        raise ConfigError([f"{path}: {p}" for p in problems])
    return SweepSpec(file=f, path=path, name=f.name, direction=f.direction, base_config=data, space=space,
                     metric=metric, tracking_uri=tracking.resolve_uri(tracking_uri, cfg.logging.tracking_uri),
                     seeds=seeds, trials=n_trials, steps=cfg.ppo.steps, plot_pair=pair)


def default_storage_url(tracking_uri: str) -> str:
    """optuna.db next to the MLflow sqlite file; sqlite:///optuna.db (here) for other tracking URIs."""
    db = tracking.sqlite_path(tracking_uri)
    return f"sqlite:///{(db.parent if db else Path()) / 'optuna.db'}"


def _creation_lock(storage_url: str) -> Any:
    """Serializes creating a sqlite store and study (sweeps started at once race in the schema creation)."""
    db = tracking.sqlite_path(storage_url)
    if db is None:
        return contextlib.nullcontext()
    db.parent.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(f"{db}.lock", is_singleton=True)  # reentrant


def make_storage(url: str) -> Any:
    """RDBStorage. On sqlite every transaction starts with BEGIN IMMEDIATE: pysqlite otherwise begins
    only at the first write, so two runners could both read a queued trial as WAITING and both run it."""
    engine_kwargs = ({"connect_args": {"timeout": 600, "isolation_level": None}}
                     if url.startswith("sqlite") else {"pool_pre_ping": True})
    storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
    if url.startswith("sqlite"):
        sqlalchemy.event.listen(storage.engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    return storage


class TrialSeeded(optuna.samplers.BaseSampler):
    """A sampler whose draws for trial n come from `make(seed + n)` (Optuna's user-defined sampler
    interface). Trial numbers are unique in a storage, so runners started at once on one study never
    draw the same values (each seeded the same would), and a random design reproduces exactly however
    many runners and resumes it took."""

    def __init__(self, make: Callable[[int | None], Any], seed: int | None):
        self.make, self.seed = make, seed
        self._by_trial: dict[int, Any] = {}

    def _of(self, trial: Any) -> Any:
        if trial.number not in self._by_trial:
            self._by_trial[trial.number] = self.make(None if self.seed is None else self.seed + 1009 * trial.number)
        return self._by_trial[trial.number]

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
        return self._of(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        return self._of(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study: Any, trial: Any, param_name: str, param_distribution: Any) -> Any:
        return self._of(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: Any, trial: Any) -> None:
        self._of(trial).before_trial(study, trial)

    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        sampler = self._by_trial.pop(trial.number, None) or self.make(None)  # the trial's (another runner's: a fresh one)
        sampler.after_trial(study, trial, state, values)


def make_sampler(spec: SweepSpec) -> Any:
    """The sweep's sampler: grid as Optuna's GridSampler (which already hands out each point once
    across runners); tpe and random seeded per trial (TrialSeeded)."""
    s = spec.file.sampler
    if s.name == "grid":
        return optuna.samplers.GridSampler({k: d.grid for k, d in spec.space.items()}, seed=s.seed)
    if s.name == "random":
        return TrialSeeded(lambda seed: optuna.samplers.RandomSampler(seed=seed), s.seed)
    return TrialSeeded(lambda seed: optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=s.n_startup_trials, multivariate=s.multivariate, constant_liar=True), s.seed)


def make_pruner(spec: SweepSpec) -> Any:
    p = spec.file.pruner
    if p.name == "none":
        return optuna.pruners.NopPruner()
    if p.name == "threshold":
        return optuna.pruners.ThresholdPruner(lower=p.lower, upper=p.upper, n_warmup_steps=p.n_warmup_steps or 0,
                                              interval_steps=p.interval_steps)
    warmup = p.n_warmup_steps if p.n_warmup_steps is not None else max(1, spec.steps // 5)
    return optuna.pruners.MedianPruner(n_startup_trials=p.n_startup_trials, n_warmup_steps=warmup,
                                       interval_steps=p.interval_steps)


def open_study(spec: SweepSpec, storage_url: str) -> Any:
    """Create the study (named after the sweep) or load it to continue."""
    quiet = warnings.catch_warnings(action="ignore", category=optuna.exceptions.ExperimentalWarning)
    with _creation_lock(storage_url), quiet:  # multivariate TPE is experimental in Optuna
        study = optuna.create_study(storage=make_storage(storage_url), study_name=spec.name, direction=spec.direction,
                                    sampler=make_sampler(spec), pruner=make_pruner(spec), load_if_exists=True)
    stored = study.direction.name.lower()
    if stored != spec.direction:
        raise ConfigError([f"{spec.path}: direction: got {spec.direction!r} but study {spec.name!r} in "
                           f"{tracking.redact(storage_url)} was created with {stored!r}; allowed: {stored!r} "
                           "(or a new sweep name)"])
    return study


def trial_counts(study: Any) -> dict[str, int]:
    """Trials that count toward the total (an outcome), were interrupted, are running or queued."""
    names = {TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}
    counts = Counter("interrupted" if t.state == TrialState.FAIL and ATTR_OUTCOME not in t.user_attrs
                     else names.get(t.state, "counted") for t in study.get_trials(deepcopy=False))
    return {k: counts[k] for k in ("counted", "interrupted", "running", "waiting")}


class TrialFailed(Exception):
    """A trial whose training run ended FAILED (stored as an Optuna FAIL trial)."""


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def score_run(history: list[tuple[int, float]], objective: Objective, direction: str,
              collapse_step: int | None) -> tuple[float, float]:
    """(score, raw) of one run: raw = mean of the last `last_steps` values; a collapsed run under `penalty`
    scores mean(last `last_steps` values up to the collapse step) -/+ collapse_penalty (maximize/minimize)."""
    history = sorted((s, v) for s, v in history if math.isfinite(v))
    if not history:
        raise TrialFailed(f"{objective.metric} was never logged (finite) in this run")
    raw = fmean([v for _, v in history[-objective.last_steps:]])
    if collapse_step is None or objective.collapsed == "ignore":
        return raw, raw
    upto = [v for s, v in history if s <= collapse_step] or [history[0][1]]
    worse = -1.0 if direction == "maximize" else 1.0
    return fmean(upto[-objective.last_steps:]) + worse * objective.collapse_penalty, raw


@dataclasses.dataclass
class OpenTrial:
    """A trial asked from the study whose seeds' runs are in flight (this runner's)."""

    trial: Any
    params: dict[str, Any]
    tasks: dict[int, Task]
    """seed -> its task."""
    outcomes: dict[int, Outcome] = dataclasses.field(default_factory=dict)
    t0: float = dataclasses.field(default_factory=time.time)
    reported: int = 0
    """The last step reported to the pruner."""
    pruned_at: int | None = None


class TrialSource:
    """The study layer's tasks of a sweep: each trial asked from Optuna (ask/tell, on the shared
    storage) becomes one task per seed; finished seeds are scored and told; a pruner sees the
    running objective, read from the store while the runs train, and stops a weak trial's runs
    (a STOP file in each run folder: a step or two late)."""

    def __init__(self, spec: SweepSpec, study: Any, target: int, threads: int | None, nproc: int | None,
                 launcher: str, parent_run_id: str):
        self.spec, self.study, self.target, self.threads = spec, study, target, threads
        self.nproc, self.launcher, self.parent_run_id = nproc, launcher, parent_run_id
        self.open: dict[int, OpenTrial] = {}
        counts = trial_counts(study)
        self.total = len(spec.seeds) * max(0, target - counts["counted"] - counts["running"])
        self.worker_died: list[str] = []

    # -- asking
    def _wanted(self) -> bool:
        """The study holds fewer started trials than the target (every runner's trials count)."""
        return len(self.study.get_trials(deepcopy=False, states=COUNTED)) < self.target

    def take(self, free: int) -> list[Task]:
        out: list[Task] = []
        while free > len(out) and self._wanted():
            trial = self.study.ask()
            params = {k: d.suggest(trial, k) for k, d in self.spec.space.items()}
            trial.set_user_attr("runner_pid", os.getpid())
            tasks = {seed: self._task(trial, params, seed) for seed in self.spec.seeds}
            self.open[trial.number] = OpenTrial(trial, params, tasks)
            out += tasks.values()
        return out

    def _task(self, trial: Any, params: dict[str, Any], seed: int) -> Task:
        spec, uri = self.spec, self.spec.tracking_uri
        name = f"{spec.name}-t{trial.number:04d}-s{seed}"
        tags = {keys.TAG_SWEEP: spec.name, keys.TAG_TRIAL: str(trial.number), keys.TAG_SEED: str(seed)}
        over = {**params, "seed": seed, "logging.tracking_uri": uri, "logging.experiment": spec.name,
                "logging.run_name": name, "logging.parent_run_id": self.parent_run_id,
                "logging.tags": {**((spec.base_config.get("logging") or {}).get("tags") or {}), **tags},
                **({"threads": self.threads} if self.threads else {})}
        # values the sampler drew that make no valid config fail the trial in its worker (ConfigError)
        return Task(name, f"trial {trial.number} · seed {seed} ({', '.join(f'{k}={_fmt(v)}' for k, v in params.items())})",
                    merge(spec.base_config, over), tags=tags, steps=spec.steps, nproc=self.nproc,
                    launcher=self.launcher, parent_run_id=self.parent_run_id)

    def exhausted(self) -> bool:
        return not self._wanted() and not self.open

    # -- while the runs train
    def poll(self, running: list[Task]) -> None:
        """Report each open trial's running objective to the pruner while its runs train."""
        for ot in list(self.open.values()):
            self._report(ot)

    def _report(self, ot: OpenTrial) -> None:
        """Report the steps not reported yet: at each step every seed has logged, the mean over the
        seeds of the last `last_steps` values of the objective; once the pruner says prune, STOP
        files end the trial's runs at their next step (FINISHED, tag harness.stopped_by=callback)."""
        if ot.pruned_at is not None or isinstance(self.study.pruner, optuna.pruners.NopPruner):
            return
        obj, uri = self.spec.file.objective, self.spec.tracking_uri
        series = []
        for task in ot.tasks.values():
            run = _run_of(uri, self.spec.name, task)
            series.append(dict(tracking.metric_history(uri, run.info.run_id, self.spec.metric)) if run else {})
        for step in sorted(set.intersection(*(set(x) for x in series))):
            value = fmean(_running(x, step, obj.last_steps) for x in series)
            if step <= ot.reported or not math.isfinite(value):
                continue
            ot.trial.report(value, step)
            ot.reported = step
            if ot.trial.should_prune():
                ot.pruned_at = step
                for task in ot.tasks.values():
                    run_dir = Path(task.cfg["logging"]["output_dir"]) / task.cfg["logging"]["run_name"]
                    if run_dir.is_dir():
                        (run_dir / keys.STOP_FILE).touch()
                return

    # -- telling
    def done(self, task: Task, outcome: Outcome) -> None:
        n = int(task.tags[keys.TAG_TRIAL])
        ot = self.open[n]
        seed = int(task.tags[keys.TAG_SEED])
        ot.outcomes[seed] = outcome
        if len(ot.outcomes) < len(ot.tasks):
            return
        del self.open[n]
        self._tell(ot)

    def _tell(self, ot: OpenTrial) -> None:
        spec, obj, uri, trial = self.spec, self.spec.file.objective, self.spec.tracking_uri, ot.trial
        for seed, o in ot.outcomes.items():  # a worker that died left no run id in its outcome: the store has it
            if o.run_id is None and (run := _run_of(uri, spec.name, ot.tasks[seed])) is not None:
                o.run_id = run.info.run_id
        if all(o.ok for o in ot.outcomes.values()):
            self._report(ot)  # the steps logged since the last poll (short runs end between two polls)
        run_ids = [o.run_id for _, o in sorted(ot.outcomes.items()) if o.run_id]
        for rid in run_ids:
            tracking.log_params(uri, rid, {f"trial.{k}": v for k, v in ot.params.items()})
        trial.set_user_attr("mlflow_run_ids", run_ids)
        trial.set_user_attr("duration_s", round(time.time() - ot.t0, 2))
        died = [o for o in ot.outcomes.values() if o.worker_died]
        failed = [(s, o) for s, o in sorted(ot.outcomes.items()) if not o.ok and not o.worker_died]
        if died or (not failed and any(o.status == "KILLED" for o in ot.outcomes.values())):
            # interrupted: it does not count, and is made up with the same values
            self.worker_died += [o.why for o in died]
            self._finish(ot, TrialState.FAIL, "interrupted", "interrupted: " + (died[0].why if died else "runs KILLED"),
                         run_status="KILLED")
            self.study.enqueue_trial(ot.params, user_attrs={"retry_of": trial.number})
            return
        if failed:
            reason = f"seed {failed[0][0]}: {failed[0][1].why}"
            trial.set_user_attr("failure_reason", reason[:2000])
            trial.set_user_attr("failed_seed", failed[0][0])
            self._finish(ot, TrialState.FAIL, "failed", f"FAILED: {reason[:200]}", tags={keys.TAG_FAILURE: reason[:500]})
            return
        if ot.pruned_at is not None:
            trial.set_user_attr("pruned_at_step", ot.pruned_at)
            self._finish(ot, TrialState.PRUNED, "pruned", f"pruned at step {ot.pruned_at}")
            return
        scores, raws, collapse_steps = [], [], {}
        try:
            for seed, o in sorted(ot.outcomes.items()):
                collapse_step = (o.collapse_step or o.steps_done) if o.collapsed else None
                score, raw = score_run(tracking.metric_history(uri, o.run_id, spec.metric), obj, spec.direction,
                                       collapse_step)
                if collapse_step is not None and obj.collapsed == "worst":
                    done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    score = (min if spec.direction == "maximize" else max)([t.value for t in done] + [score])
                collapse_steps[str(seed)] = collapse_step
                scores.append(score)
                raws.append(raw)
                tracking.MetricLogger(uri, o.run_id).log({keys.SWEEP_OBJECTIVE: score}, step=o.steps_done)
        except TrialFailed as e:
            trial.set_user_attr("failure_reason", str(e)[:2000])
            self._finish(ot, TrialState.FAIL, "failed", f"FAILED: {e}", tags={keys.TAG_FAILURE: str(e)[:500]})
            return
        value = fmean(scores)
        collapsed = [int(s) for s, c in collapse_steps.items() if c is not None]
        for k, v in {"seed_scores": scores, "seed_raw_scores": raws, "collapsed": bool(collapsed),
                     "collapsed_seeds": collapsed, "collapse_steps": collapse_steps}.items():
            trial.set_user_attr(k, v)
        self._finish(ot, TrialState.COMPLETE, "collapsed" if collapsed else "complete", f"{spec.metric}={_fmt(value)}"
                     + (f" (collapsed seeds {collapsed}, raw {_fmt(fmean(raws))})" if collapsed else ""), value=value)

    def _finish(self, ot: OpenTrial, state: TrialState, outcome: str, text: str, *, value: float | None = None,
                tags: dict[str, str] | None = None, run_status: str | None = None) -> None:
        """Tag the trial's runs, tell Optuna, log the parent's sweep/ metrics at the trial's own step."""
        uri, trial = self.spec.tracking_uri, ot.trial
        for o in ot.outcomes.values():
            if o.run_id:
                tracking.set_tags(uri, o.run_id, {keys.TAG_TRIAL_STATE: state.name, keys.TAG_TRIAL_OUTCOME: outcome,
                                                  **(tags or {})})
                if run_status and tracking.client(uri).get_run(o.run_id).info.status == "RUNNING":
                    tracking.end_run(uri, o.run_id, run_status)
        if outcome != "interrupted":
            trial.set_user_attr(ATTR_OUTCOME, outcome)
        self.study.tell(trial, value, state=None if state == TrialState.COMPLETE else state)
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in ot.params.items())
        print(f"[sweep {self.spec.name}] trial {trial.number} {shown}: {text} [{time.time() - ot.t0:.1f}s]", flush=True)
        counts = trial_counts(self.study)
        metrics = {f"sweep/n_{k}": v for k, v in counts.items()}
        best = next(iter(self.study.best_trials), None) if counts["counted"] else None
        if best is not None:
            metrics[keys.SWEEP_OBJECTIVE] = best.value
        tracking.MetricLogger(uri, self.parent_run_id).log(metrics, step=trial.number)

    def interrupt(self) -> None:
        """The runner stops (Ctrl-C): its open trials are told interrupted and made up next time."""
        for ot in list(self.open.values()):
            self._finish(ot, TrialState.FAIL, "interrupted", "interrupted", run_status="KILLED")
            self.study.enqueue_trial(ot.params, user_attrs={"retry_of": ot.trial.number})
        self.open.clear()


def _running(series: dict[int, float], step: int, last: int) -> float:
    values = [v for t, v in sorted(series.items()) if t <= step and math.isfinite(v)]
    return fmean(values[-last:]) if values else math.nan


def _run_of(uri: str, experiment: str, task: Task) -> Any:
    runs = find_runs(uri, experiment, task.tags)
    return runs[-1] if runs else None


def fail_orphans(st: Study, study: Any) -> list[int]:
    """With no other runner of the study alive (st.alone), every RUNNING trial's runner is dead: tell
    them failed (interrupted: made up with the same values), end their MLflow runs KILLED."""
    if not st.alone:
        return []
    lost = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
            study.tell(t.number, state=TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
            lost.append(t.number)
    for r in st.runs(f"tags.`{keys.TAG_SWEEP}` = '{st.experiment}'"):
        if r.data.tags.get(keys.TAG_TRIAL) in {str(n) for n in lost}:
            tracking.set_tags(st.uri, r.info.run_id, {keys.TAG_TRIAL_STATE: "FAIL", keys.TAG_TRIAL_OUTCOME: "interrupted"})
    st.mark_dead(f"tags.`{keys.TAG_SWEEP}` = '{st.experiment}'")
    return lost


def run_sweep(spec: SweepSpec, *, workers: int = 1, storage_url: str | None = None, threads: int | None = None,
              executor: str = "local", nproc: int | None = None, launcher: str = "torchrun",
              cluster: dict[str, Any] | None = None, runs_dir: str | Path = "runs") -> dict[str, Any]:
    """Run the study up to spec.trials total trials on the study layer; returns counts, best trial,
    parent run, the errors of workers that died. Torch threads per trial: `threads`, else the config's
    `threads`, else the CPUs split between workers."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    uri = spec.tracking_uri
    storage_url = storage_url or default_storage_url(uri)
    study = open_study(spec, storage_url)
    status, interrupted = "FINISHED", False
    with Study(uri, spec.name, ("sweep", spec.name, tracking.redact(storage_url)), runs_dir=runs_dir,
               exclusive=False, what="python -m harness.sweep", noun="sweep") as st:
        with st.creation_lock():  # one parent run and one set of first trials when two sweeps start at once
            stored = study.user_attrs.get(ATTR_SWEEP)
            if stored is None and not study.get_trials(deepcopy=False):
                for point in spec.file.first_trials:
                    study.enqueue_trial(point, skip_if_exists=True)
            elif stored and stored["search_space"] != json.loads(json.dumps(spec.to_attr()["search_space"])):
                print(f"[sweep {spec.name}] warning: the search space differs from the one this study was started "
                      "with; continuing the same study")
            study.set_user_attr(ATTR_SWEEP, spec.to_attr())
        parent_run_id = st.parent(create=True, run_name=f"sweep {spec.name}", tags={
            keys.TAG_SWEEP: spec.name, "harness.optuna_study": spec.name,
            "harness.optuna_storage": tracking.redact(storage_url), "harness.sweep_file": str(spec.path)}, params={
            "sweep.direction": spec.direction, "sweep.objective": spec.metric,
            **{f"sweep.objective.{k}": v for k, v in dataclasses.asdict(spec.file.objective).items() if k != "metric"},
            "sweep.search_space": spec.to_attr()["search_space"], "sweep.sampler": dataclasses.asdict(spec.file.sampler),
            "sweep.pruner": dataclasses.asdict(spec.file.pruner), "sweep.seeds": spec.seeds, "sweep.steps": spec.steps})
        with st.creation_lock():
            runs = dict(study.user_attrs.get(ATTR_PARENT_RUNS) or {})
            if runs.get(tracking.redact(uri)) != parent_run_id:
                tracking.log_text_artifact(uri, parent_run_id, spec.path.read_text(), "sweep.yaml")
                study.set_user_attr(ATTR_PARENT_RUNS, {**runs, tracking.redact(uri): parent_run_id})
        lost = fail_orphans(st, study)
        counts = trial_counts(study)
        target = spec.trials + counts["interrupted"]  # interrupted trials are made up
        remaining = max(0, spec.trials - counts["counted"] - counts["running"])  # queued ones are run here
        n_workers = max(0, min(workers, remaining * len(spec.seeds))) if workers else 0
        print(f"[sweep {spec.name}] study in {tracking.redact(storage_url)}: {counts['counted']} finished, "
              f"{counts['running']} running elsewhere, {counts['interrupted']} interrupted"
              + (f" (trials {lost} of a runner that died: made up)" if lost else "")
              + f"; target {spec.trials} total -> running {remaining} now with {max(1, n_workers) if remaining else 0}"
              " worker(s)", flush=True)
        cpus = max(1, (os.cpu_count() or 1) // n_workers) if n_workers > 1 else None
        threads = threads or spec.base_config.get("threads") or cpus
        source = TrialSource(spec, study, target, threads, nproc, launcher, parent_run_id)
        progress = Progress(spec.name, source.total, 0, bars=False)
        try:
            outcomes, interrupted = st.execute(source, executor=executor, workers=n_workers if remaining else 0,
                                               progress=progress, cluster=cluster)
        finally:
            if source.open:  # Ctrl-C, or a runner-side error: made up next time
                source.interrupt()
                interrupted = True
        if interrupted:
            status = "KILLED"
        elif source.worker_died:
            status = "FAILED"
            reason = "; ".join(dict.fromkeys(source.worker_died)) + "; rerun the same command to make them up"
            tracking.set_tags(uri, parent_run_id, {keys.TAG_FAILURE: reason[:4000]})
            print(f"[sweep {spec.name}] warning: {reason}", file=sys.stderr)
        counts = trial_counts(study)
        best = next(iter(study.best_trials), None) if any(
            t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)) else None
        if best:
            tracking.set_tags(uri, parent_run_id, {"harness.best_trial": str(best.number),
                                                   "harness.best_params": json.dumps(best.params)[:5000]})
        if status == "FINISHED":
            tracking.delete_tags(uri, parent_run_id, [keys.TAG_FAILURE])
        tracking.end_run(uri, parent_run_id, status=status)
    return {"counts": counts, "best": best, "parent_run_id": parent_run_id, "worker_errors": source.worker_died,
            "storage_url": storage_url, "interrupted": interrupted}


def build_parser() -> argparse.ArgumentParser:
    dims = schema.help_text(Dimension).replace("[top level]", "[search_space.<TrainConfig key>]")
    p = argparse.ArgumentParser(prog=prog("harness.sweep"), description=__doc__,
                                epilog=f"Sweep file (YAML):\n{schema.help_text(SweepFile)}\n{dims}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="sweep YAML, e.g. ablations/sweep_delta_eta.yaml")
    p.add_argument("--trials", type=int, help="TOTAL trials the study should hold (overrides `trials:`)")
    p.add_argument("--workers", type=int, default=1, help="runs at a time, each in its own process or job "
                   "(0: in this process, for pdb; default 1); several runners may share one study")
    p.add_argument("--storage", help="Optuna RDB URL (default: optuna.db next to MLflow's sqlite file)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the train "
                   "config's, else sqlite:///mlflow.db)")
    p.add_argument("--threads", type=int, help="torch threads per trial (default: `threads`, else CPUs / workers)")
    p.add_argument("--runs-dir", default="runs", metavar="DIR", help="the runner's own files (submitit jobs, the lock "
                   "of a store that is no sqlite file) under DIR/NAME/ (default: runs)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="train-config override for every trial (ppo.steps=50), or sweep.<field>=v for the sweep "
                   "file (sweep.seeds=2, sweep.pruner.name=none); repeatable")
    p.add_argument("--dry-run", action="store_true", help="validate the sweep file and print the search space; "
                   "nothing is created")
    add_executor_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    args = build_parser().parse_args(argv)
    try:
        for flag, v in (("--workers", args.workers), ("--threads", args.threads), ("--trials", args.trials)):
            if v is not None and v < (0 if flag == "--workers" else 1):
                raise ConfigError([f"{flag}: got {v}; allowed: an integer >= {0 if flag == '--workers' else 1}"])
        trials = [] if args.trials is None else [f"sweep.trials={args.trials}"]
        spec = load_sweep(args.file, args.overrides + trials, args.tracking_uri)
        if args.dry_run:
            print(f"sweep {spec.name}: {spec.trials} trials x {len(spec.seeds)} seed(s) x {spec.steps} steps, "
                  f"objective {spec.metric} ({spec.direction})")
            for k, v in spec.to_attr()["search_space"].items():
                print(f"  {k}: {json.dumps(v)}")
            return 0
        result = run_sweep(spec, workers=args.workers, storage_url=args.storage, threads=args.threads,
                           executor=args.executor, nproc=args.nproc, launcher=args.launcher,
                           cluster=cluster_params(args, f"sweep-{spec.name}"), runs_dir=args.runs_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StudyBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("\ninterrupted; rerun the same command to continue the study", file=sys.stderr)
        return 130
    c, best = result["counts"], result["best"]
    print(f"\n== sweep {spec.name}: {c['counted']} trials finished, {c['interrupted']} interrupted, "
          f"{c['running']} running elsewhere ==")
    if best:
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in best.params.items())
        print(f"best trial {best.number}: {spec.metric} = {best.value:.6g} ({spec.direction}) at {params}"
              + (" (collapsed)" if best.user_attrs.get("collapsed") else ""))
    else:
        print("no completed trial yet")
    print(f"MLflow parent run {result['parent_run_id']} in {tracking.redact(spec.tracking_uri)}")
    print(f"plots and tables: python -m analysis.sweep_plots {spec.name} "  # a masked secret is given again
          f"--tracking-uri {tracking.redact(spec.tracking_uri)} --storage {tracking.redact(result['storage_url'])}")
    if result["interrupted"]:
        return 130
    # Failed, pruned and collapsed trials are results (exit 0); a dead worker process is not.
    return 1 if result["worker_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
