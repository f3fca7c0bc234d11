"""Hyperparameter sweeps: an Optuna study over TrainConfig keys, every trial an MLflow child run.

    python -m harness.sweep ablations/sweep_delta_eta.yaml --trials 16 --workers 2
    python -m analysis.sweep_plots sweep_delta_eta      # plots, trials table, best trial

Objective. A training run scores the mean of `objective.metric` over its last `last_steps` logged
steps (read back from MLflow); a trial's value is the mean over its seeds. A collapsed run scores
(`objective.collapsed`): penalty = the mean over the `last_steps` steps up to the collapse step,
made worse by `collapse_penalty`; worst = the worst completed trial so far (or the penalty score
when that is worse); ignore = like any run. Collapsed trials stay COMPLETE (the sampler learns to
avoid them) with user attr `collapsed` and MLflow tag harness.trial_outcome=collapsed.

Failures and pruning. A run that ends FAILED (NaN loss, an exception) fails its trial (Optuna FAIL,
user attrs `outcome=failed`, `failure_reason`); the study goes on. After every step the trial
reports the running objective at step `seed_index * steps + step`; when the pruner says so the
run stops (tag harness.stopped_by=callback) and the trial is PRUNED (`pruned_at_step`).

Trial counting. `trials:` / `--trials N` is the study's TOTAL. A trial counts once it reached an
outcome (COMPLETE, PRUNED, or FAIL with an `outcome` user attr); a trial cut off by Ctrl-C or a
killed worker does not, and the next run makes it up (retrying its values once). Rerunning the
same command continues the study and runs only what is missing.

Workers. Optuna's multi-process pattern: each worker process calls `study.optimize` on the shared
storage, stopped by `MaxTrialsCallback` at the total (running and queued trials of every process
count, so several machines can share one study). Workers beat a heartbeat; a trial whose worker
died is failed as stale (by any later sweep process, at once when no other sweep process of the
study is alive) and its MLflow runs end KILLED. A sweep whose worker died ends its parent run
FAILED with the reason.

Storage. Default: `optuna.db` next to the MLflow sqlite file (sqlite:///optuna.db for other
tracking URIs); any Optuna RDB URL works (--storage postgresql://user:pw@host/db). The study name
is the sweep name. Passwords in the storage URL and tracking URI are masked wherever printed,
tagged or stored.

MLflow. One parent run per study and tracking store (tag harness.role=parent); every trial seed is
a child run tagged harness.sweep, harness.trial, harness.seed, harness.trial_state,
harness.trial_outcome, with the sampled values as params `trial.<key>` and its score as metric
sweep/objective. The parent gets the best value and trial; analysis.sweep_plots adds the figures.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import filelock
import optuna
import sqlalchemy
from optuna.trial import TrialState
from pydantic import Field, FiniteFloat, model_validator

from harness import config, keys, schema
from harness.config import TrainConfig, from_dict, merge
from harness.schema import ConfigError, section
from harness.tracking import redact

TAG_STUDY = "harness.optuna_study"
TAG_STORAGE = "harness.optuna_storage"  # password masked
TAG_SWEEP_FILE = "harness.sweep_file"
TRIAL_PARAM_PREFIX = "trial."
ATTR_OUTCOME = "outcome"  # trial user attr, set once a trial reached an outcome
ATTR_SWEEP = "sweep"  # study user attr: the resolved sweep (space, objective, ...) that analysis reads
ATTR_PARENT_RUNS = "mlflow_parent_runs"  # study user attr: {masked tracking URI: parent run id}
# Keys that say where a run is logged, or that the sweep sets itself, are not searched.
NOT_SEARCHABLE = (*config.BOOKKEEPING, "seed", "distributed.", "ppo.steps")
HEARTBEAT_INTERVAL_S = 20
HEARTBEAT_GRACE_S = 120
SQLITE_TIMEOUT_S = 600
Scalar = Union[bool, int, float, str, None]


# ----------------------------------------------------------------------------------------------
# The sweep file
# ----------------------------------------------------------------------------------------------
@section
class Dimension:
    """One search-space axis `search_space.<TrainConfig key>`: `{low, high, log, step}` for a number,
    `{choices: [...]}` (or a bare list) for a categorical."""

    type: Literal["float", "int", "categorical"] | None = None
    """How to sample; default: the config field's own type (bool and Literal fields: categorical over all their values)."""
    low: FiniteFloat | None = None
    """Lowest value (inclusive); it must itself be a valid value of the config field."""
    high: FiniteFloat | None = None
    """Highest value (inclusive); it must itself be a valid value of the config field."""
    log: bool = False
    """Sample on a log scale (needs low > 0)."""
    step: Annotated[FiniteFloat, Field(gt=0)] | None = None
    """Discretization step on a linear scale (int axes: 1 by default)."""
    choices: list[Scalar] | None = None
    """Categorical values, each a valid value of the config field."""
    grid: list[Scalar] | None = None
    """Values the grid sampler tries (default: grid_points values spaced from low to high, or the choices)."""
    grid_points: Annotated[int, Field(ge=1)] | None = None
    """Grid values spaced between low and high when `grid` is not given (default 3; every value of an int range of at most 5)."""

    @model_validator(mode="after")
    def check_bounds(self) -> "Dimension":
        if self.low is not None and self.high is not None and not self.low < self.high:
            raise ValueError("allowed: low < high")
        if self.log and self.low is not None and self.low <= 0:
            raise ValueError("allowed: low > 0 with log: true")
        if self.log and self.step is not None:
            raise ValueError("allowed: step only on a linear scale (log: false)")
        return self

    @property
    def numeric(self) -> bool:
        return self.type in ("float", "int")

    def suggest(self, trial: Any, key: str) -> Any:
        if self.type == "categorical":
            return trial.suggest_categorical(key, self.choices)
        if self.type == "int":
            return trial.suggest_int(key, int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return trial.suggest_float(key, self.low, self.high, log=self.log, step=self.step)


@section
class Objective:
    """What a trial scores (see the module doc): mean of `metric` over a run's last `last_steps` steps."""

    metric: str = "auto"
    """A step metric from harness/keys.py; auto = objective/gold_score on the embedded world, objective/rm_score on other prompt sources."""
    last_steps: Annotated[int, Field(ge=1)] = 10
    """Logged steps averaged into a run's score."""
    collapsed: Literal["penalty", "worst", "ignore"] = "penalty"
    """How a collapsed run scores: penalty | worst | ignore."""
    collapse_penalty: Annotated[FiniteFloat, Field(ge=0)] = 1.0
    """What `penalty` takes off a collapsed run's score, in metric units."""


@section
class Sampler:
    """The Optuna sampler; `sampler: tpe` is short for `{name: tpe}`."""

    name: Literal["tpe", "random", "grid"] = "tpe"
    """tpe (multivariate TPE, constant liar for parallel workers) | random | grid (every axis's grid values)."""
    seed: int | None = 0
    """Base seed; every worker and every continued run offsets it, so none repeats another's draws (null = random)."""
    n_startup_trials: Annotated[int, Field(ge=0)] = 5
    """tpe: random trials before TPE models the objective."""
    multivariate: bool = True
    """tpe: model the parameters jointly."""


@section
class Pruner:
    """Stops weak trials early; `pruner: none` is short for `{name: none}`."""

    name: Literal["median", "threshold", "none"] = "median"
    """median (below the median of earlier trials at the same step) | threshold (outside [lower, upper]) | none."""
    n_startup_trials: Annotated[int, Field(ge=0)] = 4
    """median: trials that finish before any trial is pruned."""
    n_warmup_steps: Annotated[int, Field(ge=0)] | None = None
    """Steps before a trial can be pruned (default: steps // 5 for median, 0 for threshold)."""
    interval_steps: Annotated[int, Field(ge=1)] = 1
    """Check every this many steps."""
    lower: FiniteFloat | None = None
    """threshold: prune when the running objective falls below this."""
    upper: FiniteFloat | None = None
    """threshold: prune when the running objective rises above this."""

    @model_validator(mode="after")
    def check_threshold(self) -> "Pruner":
        if self.name == "threshold" and self.lower is None and self.upper is None:
            raise ValueError("allowed: name threshold with `lower` or `upper`")
        return self


@section
class Plots:
    """Figures drawn by analysis.sweep_plots."""

    pair: list[str] = field(default_factory=list)
    """The two search-space keys of the 2-D plot (default: the first two numeric axes)."""


@section
class SweepFile:
    """A sweep file (YAML, usually ablations/sweep_*.yaml)."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
    """Optuna study name = MLflow experiment = the reports/<name>/ folder (one safe path component)."""
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
    set: dict[str, Any] = field(default_factory=dict)
    """Train-config overrides for every trial (dotted keys)."""
    steps: Annotated[int, Field(ge=1)] | None = None
    """Shorthand for ppo.steps (beats `set`; --set beats both)."""
    seeds: Annotated[int, Field(ge=1)] | list[int] = 1
    """Seeds per trial: a count n (the config's seed + 0..n-1) or a list; the trial's value is the mean."""
    trials: Annotated[int, Field(ge=1)] | None = None
    """TOTAL trials the study should hold (default 16; with the grid sampler the grid size)."""
    direction: Literal["maximize", "minimize"] = "maximize"
    """Optimization direction of the objective."""
    first_trials: list[dict[str, Scalar]] = field(default_factory=list)
    """Points tried first (enqueued when the study is new); keys left out are sampled."""
    objective: Objective = field(default_factory=Objective)
    """What a trial scores."""
    sampler: Sampler = field(default_factory=Sampler)
    """How trials are sampled."""
    pruner: Pruner = field(default_factory=Pruner)
    """How weak trials are stopped."""
    plots: Plots = field(default_factory=Plots)
    """Figures."""


@dataclass
class SweepSpec:
    """A validated sweep file resolved against TrainConfig."""

    file: SweepFile
    path: Path | None
    base_config: dict[str, Any]
    """Train config data (base < set < steps < --set), validated; searched keys not set yet."""
    space: dict[str, Dimension]
    """The axes with type, choices and grid resolved."""
    metric: str
    """The objective metric (`auto` resolved)."""
    tracking_uri: str
    """Where trials log (--tracking-uri, else the train config's)."""
    seeds: list[int]
    trials: int
    steps: int
    plot_pair: list[str]

    @property
    def name(self) -> str:
        return self.file.name

    @property
    def direction(self) -> str:
        return self.file.direction

    def to_attr(self) -> dict[str, Any]:
        """What analysis.sweep_plots needs, stored as the study's ATTR_SWEEP user attr."""
        space = {k: {a: v for a, v in dataclasses.asdict(d).items() if v is not None} for k, d in self.space.items()}
        return {"name": self.name, "title": self.file.title, "direction": self.direction, "metric": self.metric,
                "last_steps": self.file.objective.last_steps, "seeds": self.seeds, "steps": self.steps,
                "pruner": self.file.pruner.name, "plot_pair": self.plot_pair, "search_space": space,
                "sweep_file": str(self.path or "")}


def _config_types() -> dict[str, Any]:
    """Every TrainConfig leaf key -> its type (bounds are checked by from_dict on sample values)."""
    return {key: tp for key, tp, *_ in schema.iter_fields(TrainConfig)}


def _kind(tp: Any) -> tuple[str, list[Any] | None]:
    """(sampling type, all values or None) a config field type allows by default; 'other' when none."""
    _, inner = schema.base_type(tp)
    if typing.get_origin(inner) is Literal:
        return "categorical", list(typing.get_args(inner))
    if inner is bool:
        return "categorical", [True, False]
    return (inner.__name__, None) if inner in (int, float) else ("other", None)


def _build_config(data: dict[str, Any]) -> tuple[TrainConfig | None, list[str]]:
    """TrainConfig from data, or the problems config validation found."""
    try:
        return from_dict(data), []
    except ConfigError as e:
        return None, list(e.problems)


def _spaced(low: float, high: float, n: int, log: bool, integer: bool) -> list[Any]:
    """n grid values from low to high, evenly spaced on the axis's scale."""
    f, inv = (math.log, math.exp) if log else (float, float)
    vals = [inv(f(low) + i * (f(high) - f(low)) / max(n - 1, 1)) for i in range(n)]
    return sorted({int(round(v)) for v in vals}) if integer else [float(f"{v:.6g}") for v in vals]


def _resolve(key: str, dim: Dimension, tp: Any, base: dict[str, Any]) -> tuple[Dimension | None, list[str]]:
    """The axis with type, choices and grid filled in, each bound checked as a value of the field."""
    where = f"search_space.{key}"
    kind, values = _kind(tp)
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
        if typ == "int":
            bad = [(a, v) for a, v in (("low", dim.low), ("high", dim.high), ("step", dim.step)) if v is not None and not float(v).is_integer()]
            if bad:
                return None, [f"{where}.{a}: got {v!r}; allowed: an integer" for a, v in bad]
        cast = int if typ == "int" else float
        small_int = typ == "int" and dim.high - dim.low < 5
        grid = dim.grid or _spaced(dim.low, dim.high, dim.grid_points or (int(dim.high - dim.low) + 1 if small_int else 3), dim.log, typ == "int")
        wrong = [g for g in grid if isinstance(g, (bool, str)) or g is None or not dim.low <= g <= dim.high]
        if wrong:
            return None, [f"{where}.grid: got {g!r}; allowed: numbers in [{dim.low:g}, {dim.high:g}]" for g in wrong]
        checks = [("low", cast(dim.low)), ("high", cast(dim.high))]
        out = dataclasses.replace(dim, type=typ, grid=[cast(g) for g in grid])
    problems = [f"{where}.{label}: {p}" for label, v in checks for p in _build_config(merge(base, {key: v}))[1]]
    return (None if problems else out), list(dict.fromkeys(problems))


def _apply_sweep_overrides(raw: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`--set sweep.<field>=v`; search-space keys are dotted themselves: `sweep.search_space.ppo.kl_coef.low=0.01`."""
    out = merge(raw, {k: v for k, v in over.items() if not k.startswith("search_space.")})
    for k, v in over.items():
        if k.startswith("search_space.") and isinstance(out.get("search_space"), dict):
            key, _, attr = k.removeprefix("search_space.").rpartition(".")
            if key and attr in {f.name for f in dataclasses.fields(Dimension)}:
                out["search_space"][key] = {**(out["search_space"].get(key) or {}), attr: v}
            else:
                out["search_space"][k.removeprefix("search_space.")] = v
    return out


def load_sweep(path: str | Path | dict[str, Any], overrides: list[str] | None = None, *,
               trials: int | None = None, tracking_uri: str | None = None, check_data: bool = True) -> SweepSpec:
    """Read and validate a sweep file (or dict) completely; ConfigError lists every problem.

    `overrides`: `--set` items; `sweep.<field>=v` changes the sweep file (sweep.seeds=2,
    sweep.pruner.name=none), any other key the train config of every trial. `check_data=False`
    skips checking that the world dir / HH-RLHF file exist (for drawing reports later)."""
    if isinstance(path, dict):
        raw, src, here, path = dict(path), "sweep", Path.cwd(), None
    else:
        path = Path(path)
        raw, src, here = schema.read_yaml(path, "sweep file"), str(path), path.resolve().parent
    try:
        over = config.parse_overrides(overrides)
    except ConfigError as e:
        raise ConfigError(e.problems) from None
    raw = _apply_sweep_overrides(raw, {k.removeprefix("sweep."): v for k, v in over.items() if k.startswith("sweep.")})
    for k in ("sampler", "pruner"):
        if isinstance(raw.get(k), str):
            raw[k] = {"name": raw[k]}
    if isinstance(raw.get("search_space"), dict):
        raw["search_space"] = {k: {"choices": v} if isinstance(v, list) else (v or {}) for k, v in raw["search_space"].items()}
    f: SweepFile = schema.validate(SweepFile, raw, src)

    problems: list[str] = []
    base: dict[str, Any] = {}
    if f.base:
        try:
            base = schema.read_yaml(here / f.base, "base train config")
        except ConfigError as e:
            problems += [f"base: {p}" for p in e.problems]
    train_over = {k: v for k, v in over.items() if not k.startswith("sweep.")}
    # precedence: base file < set < steps < --set < --tracking-uri; the experiment is the sweep
    data = merge(merge(merge(base, f.set), {"ppo.steps": f.steps} if f.steps else {}), train_over)
    data = merge(data, {"logging.experiment": f.name, **({"logging.tracking_uri": tracking_uri} if tracking_uri else {})})
    cfg, cfg_problems = _build_config(data)
    problems += [f"train config: {p}" for p in cfg_problems]
    if cfg is None:
        raise ConfigError([f"{src}: {p}" for p in problems])

    types_ = _config_types()
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
    known = list(dict.fromkeys(keys.STEP_METRICS + keys.GOLD_METRICS + keys.EVAL_METRICS))
    if metric not in known:
        problems.append(f"objective.metric: got {metric!r}; allowed: auto or a metric key from harness/keys.py" + schema.did_you_mean(metric, known))
    elif not gold and metric in (keys.GOLD_SCORE, keys.GOLD_SCORE_STD, keys.EVAL_GOLD, keys.EVAL_WIN_RATE):
        problems.append(f"objective.metric: got {metric!r} with data.source={cfg.data.source}; allowed: a metric that source logs, e.g. {keys.RM_SCORE}")
    seeds = [cfg.seed + i for i in range(f.seeds)] if isinstance(f.seeds, int) else list(f.seeds)
    if not seeds or len(set(seeds)) < len(seeds):
        problems.append(f"seeds: got {f.seeds!r}; allowed: a count >= 1 or a list of distinct integers")
    grid_size = math.prod(len(d.grid or []) for d in space.values())
    n_trials = trials if trials is not None else f.trials or (grid_size if f.sampler.name == "grid" else 16)
    if n_trials < 1:
        problems.append(f"--trials: got {n_trials}; allowed: an integer >= 1 (the study's total)")
    if f.sampler.name == "grid" and space and n_trials > grid_size:
        problems.append(f"trials: got {n_trials} with sampler grid; allowed: at most the grid size {grid_size}")
    if cfg.ppo.steps < 1:
        problems.append("ppo.steps: got 0; allowed: an integer >= 1 for a sweep (set `steps:`)")
    if check_data and gold and not Path(cfg.data.world_dir).exists():
        problems.append(f"data.world_dir: {cfg.data.world_dir!r} holds no built world; build it with "
                        f"`python -m harness.world build --out {cfg.data.world_dir}` or --set data.world_dir=...")
    if check_data and not gold and cfg.data.hh_path and not Path(cfg.data.hh_path).exists():
        problems.append(f"data.hh_path: {cfg.data.hh_path!r} not found")
    for i, point in enumerate(f.first_trials):
        for k, v in point.items():
            d = space.get(k)
            if k not in f.search_space:
                problems.append(f"first_trials.{i}.{k}: not a search-space key" + schema.did_you_mean(k, f.search_space))
            elif d is None:
                continue  # the axis itself is wrong (reported above)
            elif f.sampler.name == "grid" or d.type == "categorical":
                if v not in d.grid or type(v) is not type(d.grid[d.grid.index(v)]):
                    problems.append(f"first_trials.{i}.{k}: got {v!r}; allowed: one of {d.grid}")
            elif isinstance(v, (bool, str)) or v is None or not d.low <= v <= d.high or (d.type == "int" and not float(v).is_integer()):
                problems.append(f"first_trials.{i}.{k}: got {v!r}; allowed: {'an integer' if d.type == 'int' else 'a number'} in [{d.low:g}, {d.high:g}]")
    numeric = [k for k, d in space.items() if d.numeric]
    pair = list(f.plots.pair) or numeric[:2]
    if f.plots.pair and (len(pair) != 2 or not set(pair) <= set(numeric)):
        problems.append(f"plots.pair: got {pair!r}; allowed: two numeric search-space keys from {numeric}")
    if problems:
        raise ConfigError([f"{src}: {p}" for p in problems])
    return SweepSpec(file=f, path=path, base_config=data, space=space, metric=metric, tracking_uri=cfg.logging.tracking_uri, seeds=seeds,
                     trials=n_trials, steps=cfg.ppo.steps, plot_pair=pair)


# ----------------------------------------------------------------------------------------------
# Storage, sampler, pruner, dead workers
# ----------------------------------------------------------------------------------------------
def default_storage_url(tracking_uri: str) -> str:
    """optuna.db next to the MLflow sqlite file; sqlite:///optuna.db for other tracking URIs."""
    if tracking_uri.startswith("sqlite:///"):
        return "sqlite:///" + str(Path(tracking_uri.removeprefix("sqlite:///")).parent / "optuna.db")
    return "sqlite:///optuna.db"


def _sqlite_file(url: str) -> Path | None:
    return Path(url.removeprefix("sqlite:///")).expanduser().resolve() if url.startswith("sqlite:///") else None


def _creation_lock(storage_url: str) -> Any:
    """Creating a store and a study is serialized by a file lock next to a sqlite store: two sweeps
    started at once on a fresh store race in the schema creation otherwise. Servers need none."""
    db = _sqlite_file(storage_url)
    if db is None:
        return contextlib.nullcontext()
    db.parent.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(f"{db}.lock", is_singleton=True)  # reentrant: run_sweep holds it around open_study


def _run_lock(storage_url: str, name: str) -> Any:
    """The study's run lock next to a sqlite store: every sweep process holds it shared while it runs,
    so a process that gets it exclusively knows no other sweep of the study is alive."""
    db = _sqlite_file(storage_url)
    return filelock.ReadWriteLock(f"{db}.{name}.run.lock", is_singleton=False) if db else None


@contextlib.contextmanager
def _alone(lock: Any) -> typing.Iterator[bool]:
    """Yields True while holding the run lock exclusively, False when another sweep process holds it."""
    if lock is None:
        yield False
        return
    try:
        lock.acquire_write(blocking=False)
    except filelock.Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


@dataclass
class StaleTrialCallback:
    """Optuna's `heartbeat_stale_trial_callback` for a trial whose worker died: its MLflow runs end KILLED
    (tagged interrupted), and the trial is retried once with the same values."""

    tracking_uri: str
    name: str

    def __call__(self, study: Any, trial: Any) -> None:
        from harness import tracking

        c = tracking.client(self.tracking_uri)
        exp = c.get_experiment_by_name(self.name)
        runs = c.search_runs([exp.experiment_id], f"tags.`{keys.TAG_SWEEP}` = '{self.name}' and tags.`{keys.TAG_TRIAL}` = '{trial.number}'") if exp else []
        for r in runs:
            tracking.set_tags(self.tracking_uri, r.info.run_id, {keys.TAG_TRIAL_STATE: "FAIL", keys.TAG_TRIAL_OUTCOME: "interrupted"})
            if r.info.status == "RUNNING":
                tracking.end_run(self.tracking_uri, r.info.run_id, "KILLED")
        print(f"[sweep {self.name}] trial {trial.number}: its worker died; failed as interrupted, MLflow runs KILLED, retried once")
        optuna.storages.RetryFailedTrialCallback(max_retry=1)(study, trial)


def make_storage(url: str, tracking_uri: str, name: str) -> Any:
    """RDBStorage with heartbeats (a dead worker's trial is failed as stale by StaleTrialCallback).

    On sqlite every transaction starts with BEGIN IMMEDIATE: pysqlite otherwise begins only at the
    first write, so two workers could both read a queued trial as WAITING and both run it."""
    engine_kwargs = ({"connect_args": {"timeout": SQLITE_TIMEOUT_S, "isolation_level": None}}
                     if url.startswith("sqlite") else {"pool_pre_ping": True})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(
            url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_INTERVAL_S,
            grace_period=HEARTBEAT_GRACE_S, heartbeat_stale_trial_callback=StaleTrialCallback(tracking_uri, name))
    if url.startswith("sqlite"):
        sqlalchemy.event.listen(storage.engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    return storage


def make_sampler(spec: SweepSpec, seed_offset: int = 0) -> Any:
    """The sweep's sampler; `seed_offset` keeps workers and continued runs from repeating draws."""
    s = spec.file.sampler
    seed = None if s.seed is None else s.seed + seed_offset
    if s.name == "grid":
        return optuna.samplers.GridSampler({k: d.grid for k, d in spec.space.items()}, seed=seed)
    if s.name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.n_startup_trials,
                                          multivariate=s.multivariate, constant_liar=True)


def make_pruner(spec: SweepSpec) -> Any:

    p = spec.file.pruner
    if p.name == "none":
        return optuna.pruners.NopPruner()
    if p.name == "threshold":
        return optuna.pruners.ThresholdPruner(lower=p.lower, upper=p.upper, n_warmup_steps=p.n_warmup_steps or 0,
                                              interval_steps=p.interval_steps)
    warmup = p.n_warmup_steps if p.n_warmup_steps is not None else max(1, spec.steps // 5)
    return optuna.pruners.MedianPruner(n_startup_trials=p.n_startup_trials, n_warmup_steps=warmup, interval_steps=p.interval_steps)


def open_study(spec: SweepSpec, storage_url: str, tracking_uri: str, seed_offset: int = 0) -> tuple[Any, Any]:
    """(study, its storage): create the study (named after the sweep) or load it to continue."""
    with _creation_lock(storage_url):
        storage = make_storage(storage_url, tracking_uri, spec.name)
        study = optuna.create_study(storage=storage, study_name=spec.name, direction=spec.direction, load_if_exists=True,
                                    sampler=make_sampler(spec, seed_offset), pruner=make_pruner(spec))
    stored = study.direction.name.lower()
    if stored != spec.direction:
        raise ConfigError([f"{spec.path or 'sweep'}: direction: got {spec.direction!r} but study {spec.name!r} in "
                           f"{redact(storage_url)} was created with {stored!r}; allowed: {stored!r} (or a new sweep name)"])
    return study, storage


def fail_running_trials(study: Any, storage: Any) -> list[int]:
    """Fail every RUNNING trial as interrupted and run the storage's stale-trial callback on it: for a
    process alone with the study (see _run_lock), where every RUNNING trial's worker is dead."""
    study_id = storage.get_study_id_from_name(study.study_name)
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
            if storage.set_trial_state_values(trial_id, TrialState.FAIL):
                failed.append(storage.get_trial(trial_id))
    for t in failed:
        storage.get_heartbeat_stale_trial_callback()(study, t)
    return [t.number for t in failed]


def trial_counts(study: Any) -> dict[str, int]:
    """Trials that count toward the total (an outcome), were interrupted, are running or queued."""
    counts = {"counted": 0, "interrupted": 0, "running": 0, "waiting": 0}
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.FAIL and ATTR_OUTCOME not in t.user_attrs:
            counts["interrupted"] += 1
        else:
            counts[{TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}.get(t.state, "counted")] += 1
    return counts


# ----------------------------------------------------------------------------------------------
# One trial
# ----------------------------------------------------------------------------------------------
class TrialFailed(Exception):
    """A trial whose training run ended FAILED (stored as an Optuna FAIL trial)."""


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


class IntermediateReporter:
    """The trainer's on_step callback: report the running objective, return should_prune()."""

    def __init__(self, trial: Any, metric: str, window: int, step_offset: int):
        self.trial, self.metric, self.window, self.step_offset = trial, metric, window, step_offset
        self.values: list[float] = []
        self.pruned_at: int | None = None

    def __call__(self, step: int, metrics: dict[str, float]) -> bool:
        value = metrics.get(self.metric)
        if value is None or not math.isfinite(float(value)):
            return False
        self.values.append(float(value))
        self.trial.report(_mean(self.values[-self.window:]), self.step_offset + step)
        if self.trial.should_prune():
            self.pruned_at = step
            return True
        return False


def score_run(history: list[tuple[int, float]], objective: Objective, direction: str,
              collapse_step: int | None) -> tuple[float, float]:
    """(score, raw) of one run from its metric history; raw ignores the collapse rule.

    raw = mean of the last `last_steps` values; a collapsed run under `penalty` scores
    mean(last `last_steps` values up to the collapse step) -/+ collapse_penalty (maximize/minimize)."""
    history = sorted((s, v) for s, v in history if math.isfinite(v))
    if not history:
        raise TrialFailed(f"{objective.metric} was never logged (finite) in this run")
    raw = _mean([v for _, v in history[-objective.last_steps:]])
    if collapse_step is None or objective.collapsed == "ignore":
        return raw, raw
    upto = [v for s, v in history if s <= collapse_step] or [history[0][1]]
    worse = -1.0 if direction == "maximize" else 1.0
    return _mean(upto[-objective.last_steps:]) + worse * objective.collapse_penalty, raw


class TrialObjective:
    """Optuna's objective: every seed trained with the sampled values, scored, recorded everywhere."""

    def __init__(self, spec: SweepSpec, parent_run_id: str | None, tracking_uri: str,
                 threads: int | None = None, worker: int = 0):
        self.spec, self.parent_run_id, self.tracking_uri = spec, parent_run_id, tracking_uri
        self.threads, self.worker = threads, worker

    def trial_config(self, params: dict[str, Any], seed: int, number: int) -> TrainConfig:
        name = self.spec.name
        tags = {**((self.spec.base_config.get("logging") or {}).get("tags") or {}),
                keys.TAG_SWEEP: name, keys.TAG_TRIAL: str(number), keys.TAG_SEED: str(seed)}
        over = {**params, "seed": seed, "logging.tracking_uri": self.tracking_uri, "logging.experiment": name,
                "logging.run_name": f"{name}-t{number:04d}-s{seed}", "logging.parent_run_id": self.parent_run_id,
                "logging.tags": tags, **({"threads": self.threads} if self.threads else {})}
        cfg, problems = _build_config(merge(self.spec.base_config, over))
        if cfg is None:
            raise TrialFailed("config with the sampled values is invalid: " + "; ".join(problems))
        return cfg

    def __call__(self, trial: Any) -> float:
        from harness import tracking
        from harness.train import train  # lazy: torch is only needed inside a trial

        spec, obj = self.spec, self.spec.file.objective
        t0 = time.time()
        params = {k: d.suggest(trial, k) for k, d in spec.space.items()}
        trial.set_user_attr("worker", self.worker)
        trial.set_user_attr("pid", os.getpid())  # which process to look for when a trial dies with its worker
        run_ids: list[str] = []
        scores: list[float] = []
        raws: list[float] = []
        collapse_steps: dict[str, int | None] = {}

        def finish(state: str, outcome: str, text: str, tags: dict[str, str] | None = None) -> None:
            for rid in run_ids:
                tracking.set_tags(self.tracking_uri, rid, {keys.TAG_TRIAL_STATE: state, keys.TAG_TRIAL_OUTCOME: outcome, **(tags or {})})
            trial.set_user_attr("mlflow_run_ids", run_ids)
            trial.set_user_attr(ATTR_OUTCOME, outcome)
            trial.set_user_attr("duration_s", round(time.time() - t0, 2))
            shown = ", ".join(f"{k}={_fmt(v)}" for k, v in params.items())
            print(f"[sweep {spec.name}] trial {trial.number} (worker {self.worker}) {shown}: {text} [{time.time() - t0:.1f}s]", flush=True)

        try:
            for i, seed in enumerate(spec.seeds):
                reporter = IntermediateReporter(trial, spec.metric, obj.last_steps, i * spec.steps)
                result = train(self.trial_config(params, seed, trial.number), on_step=reporter)
                if result.run_id:
                    run_ids.append(result.run_id)
                    tracking.log_params(self.tracking_uri, result.run_id, {TRIAL_PARAM_PREFIX + k: v for k, v in params.items()})
                if result.status == "FAILED":
                    trial.set_user_attr("failed_seed", seed)
                    raise TrialFailed(result.error or "training run ended FAILED")
                if reporter.pruned_at is not None:
                    trial.set_user_attr("pruned_at_step", reporter.pruned_at)
                    trial.set_user_attr("pruned_seed", seed)
                    finish("PRUNED", "pruned", f"pruned at step {reporter.pruned_at} of seed {seed}")
                    raise optuna.TrialPruned()
                collapse_step = (result.collapse_step or result.steps_done) if result.collapsed else None
                history = tracking.metric_history(self.tracking_uri, result.run_id, spec.metric) if result.run_id else []
                score, raw = score_run(history or list(enumerate(reporter.values, start=1)), obj, spec.direction, collapse_step)
                if collapse_step is not None and obj.collapsed == "worst":
                    score = self._worst_so_far(trial, score)
                collapse_steps[str(seed)] = collapse_step
                scores.append(score)
                raws.append(raw)
                if result.run_id:
                    tracking.MetricLogger(self.tracking_uri, result.run_id).log({keys.SWEEP_OBJECTIVE: score}, step=result.steps_done)
        except optuna.TrialPruned:
            raise
        except TrialFailed as e:
            trial.set_user_attr("failure_reason", str(e)[:2000])
            finish("FAIL", "failed", f"FAILED: {str(e)[:200]}", {keys.TAG_FAILURE: str(e)[:500]})
            raise
        except Exception as e:  # a bug or an infrastructure error: recorded; Optuna fails the trial, the study goes on
            trial.set_user_attr("failure_reason", f"{type(e).__name__}: {e}"[:2000])
            finish("FAIL", "error", f"ERROR {type(e).__name__}: {str(e)[:200]}\n{traceback.format_exc()}")
            raise
        value = _mean(scores)
        collapsed = [int(s) for s, c in collapse_steps.items() if c is not None]
        for k, v in {"seed_scores": scores, "seed_raw_scores": raws, "collapsed": bool(collapsed),
                     "collapsed_seeds": collapsed, "collapse_steps": collapse_steps}.items():
            trial.set_user_attr(k, v)
        finish("COMPLETE", "collapsed" if collapsed else "complete",
               f"{spec.metric}={_fmt(value)}" + (f" (collapsed seeds {collapsed}, raw {_fmt(_mean(raws))})" if collapsed else ""))
        return value

    def _worst_so_far(self, trial: Any, fallback: float) -> float:
        values = [t.value for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))] + [fallback]
        return min(values) if self.spec.direction == "maximize" else max(values)


# ----------------------------------------------------------------------------------------------
# Running a study
# ----------------------------------------------------------------------------------------------
def _worker(spec: SweepSpec, storage_url: str, tracking_uri: str, parent_run_id: str | None,
            target: int, worker: int, seed_offset: int, threads: int | None) -> None:
    """One worker process (or the sweep process itself): Optuna's own loop on the shared storage,
    until the study holds `target` started trials (running ones of every process count; queued
    ones are run first by whichever worker asks next)."""
    if threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    # TrialObjective prints every outcome (with the traceback of a real error); Optuna's own
    # warning for each FAIL trial would only repeat it.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    lock = _run_lock(storage_url, spec.name)
    with lock.read_lock() if lock else contextlib.nullcontext():
        study, _ = open_study(spec, storage_url, tracking_uri, seed_offset + worker)
        study.optimize(TrialObjective(spec, parent_run_id, tracking_uri, threads, worker), catch=(Exception,),
                       callbacks=[optuna.study.MaxTrialsCallback(target, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING))])


def _parent_run(spec: SweepSpec, study: Any, tracking_uri: str, storage_url: str) -> str:
    """The study's MLflow parent run in this tracking store (reopened when continuing)."""
    from harness import tracking

    runs = dict(study.user_attrs.get(ATTR_PARENT_RUNS) or {})
    store = redact(tracking_uri)
    if runs.get(store):
        with contextlib.suppress(Exception):  # deleted meanwhile: start a new one
            tracking.reopen_run(tracking_uri, runs[store])
            return runs[store]
    run_id = tracking.start_run(tracking_uri, spec.name, run_name=f"sweep {spec.name}", tags={
        keys.TAG_ROLE: "parent", keys.TAG_SWEEP: spec.name, TAG_STUDY: spec.name, TAG_STORAGE: redact(storage_url),
        keys.TAG_COMMIT: tracking.git_commit(), TAG_SWEEP_FILE: str(spec.path or "")})
    f = spec.file
    tracking.log_params(tracking_uri, run_id, {
        "sweep.direction": f.direction, "sweep.objective": spec.metric, **{f"sweep.objective.{k}": v for k, v in dataclasses.asdict(f.objective).items() if k != "metric"},
        "sweep.search_space": spec.to_attr()["search_space"], "sweep.sampler": dataclasses.asdict(f.sampler),
        "sweep.pruner": dataclasses.asdict(f.pruner), "sweep.seeds": spec.seeds, "sweep.steps": spec.steps})
    if spec.path:
        tracking.log_text_artifact(tracking_uri, run_id, Path(spec.path).read_text(), "sweep.yaml")
    study.set_user_attr(ATTR_PARENT_RUNS, {**runs, store: run_id})
    return run_id


def run_sweep(spec: SweepSpec, *, workers: int = 1, storage_url: str | None = None,
              threads: int | None = None) -> dict[str, Any]:
    """Run the study up to spec.trials total trials; returns counts, best trial, parent run, worker errors.

    Torch threads per trial: `threads`, else the config's `threads` when set, else (with several
    workers) the CPUs split evenly between the workers."""
    from harness import tracking

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tracking_uri = spec.tracking_uri
    storage_url = storage_url or default_storage_url(tracking_uri)
    with _creation_lock(storage_url):  # one parent run even when two sweeps start at once
        study, storage = open_study(spec, storage_url, tracking_uri)
        stored = study.user_attrs.get(ATTR_SWEEP)
        if stored is None and not study.get_trials(deepcopy=False):
            for point in spec.file.first_trials:
                study.enqueue_trial(point, skip_if_exists=True)
        elif stored and stored["search_space"] != json.loads(json.dumps(spec.to_attr()["search_space"])):
            print(f"[sweep {spec.name}] warning: the search space differs from the one this study was started with; continuing the same study")
        study.set_user_attr(ATTR_SWEEP, spec.to_attr())
        parent_run_id = _parent_run(spec, study, tracking_uri, storage_url)
    lock = _run_lock(storage_url, spec.name)
    with _alone(lock) as alone:
        if alone:  # no other sweep process of this study is alive: its RUNNING trials are stale
            fail_running_trials(study, storage)
    counts = trial_counts(study)
    target = spec.trials + counts["interrupted"]  # interrupted trials are made up
    remaining = spec.trials - counts["counted"] - counts["running"]  # queued trials are run by these workers
    n_workers = max(0, min(workers, remaining))
    print(f"[sweep {spec.name}] study in {redact(storage_url)}: {counts['counted']} finished, {counts['running']} running, "
          f"{counts['interrupted']} interrupted; target {spec.trials} total -> running {max(0, remaining)} now "
          f"with {n_workers} worker(s)", flush=True)
    threads = threads or spec.base_config.get("threads") or (max(1, (os.cpu_count() or 1) // n_workers) if n_workers > 1 else None)
    args = (spec, storage_url, tracking_uri, parent_run_id, target)
    seed_offset = 1009 * len(study.get_trials(deepcopy=False))
    status, errors = "FINISHED", []
    try:
        with lock.read_lock() if lock else contextlib.nullcontext():
            if n_workers == 1:
                _worker(*args, 0, seed_offset, threads)
            elif n_workers > 1:
                ctx = mp.get_context("spawn")
                procs = [ctx.Process(target=_worker, args=(*args, w, seed_offset, threads), name=f"sweep-worker-{w}")
                         for w in range(n_workers)]
                for p in procs:
                    p.start()
                for p in procs:
                    p.join()
                errors = [f"{p.name} exited with code {p.exitcode}" for p in procs if p.exitcode]
        with _alone(lock) as alone:  # our workers are gone; a dead one left its trial RUNNING
            lost = fail_running_trials(study, storage) if alone and errors else []
        if errors:
            status = "FAILED"
            reason = "; ".join(errors) + (f"; interrupted trial(s) {lost}" if lost else "") + "; rerun the same command to make them up"
            tracking.set_tags(tracking_uri, parent_run_id, {keys.TAG_FAILURE: reason})
            print(f"[sweep {spec.name}] warning: {reason}", file=sys.stderr)
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except BaseException as e:
        status = "FAILED"
        tracking.set_tags(tracking_uri, parent_run_id, {keys.TAG_FAILURE: f"{type(e).__name__}: {e}"[:500]})
        raise
    finally:
        counts = trial_counts(study)
        best = next(iter(study.best_trials), None)  # the best COMPLETE trial, if any
        metrics = {f"sweep/n_{k}": v for k, v in counts.items()}
        if best:
            metrics[keys.SWEEP_OBJECTIVE] = best.value
            tracking.set_tags(tracking_uri, parent_run_id, {"harness.best_trial": str(best.number), "harness.best_params": json.dumps(best.params)[:5000]})
        tracking.MetricLogger(tracking_uri, parent_run_id).log(metrics, step=len(study.get_trials(deepcopy=False)))
        tracking.end_run(tracking_uri, parent_run_id, status=status)
    return {"counts": counts, "best": best, "parent_run_id": parent_run_id, "worker_errors": errors,
            "storage_url": storage_url, "tracking_uri": tracking_uri}


def plots_command(spec: SweepSpec, storage_url: str, tracking_uri: str) -> str:
    """The command that draws the sweep's plots and tables (passwords masked: give them again)."""
    cmd = f"python -m analysis.sweep_plots {spec.name}"
    if tracking_uri != from_dict({}).logging.tracking_uri:
        cmd += f" --tracking-uri {redact(tracking_uri)}"
    if storage_url != default_storage_url(tracking_uri):
        cmd += f" --storage {redact(storage_url)}"
    return cmd


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def file_format() -> str:
    """The sweep file format, from the sections' docstrings."""
    dims = schema.help_text(Dimension).replace("[top level]", "[search_space.<TrainConfig key>]")
    return "Sweep file (YAML):\n" + schema.help_text(SweepFile) + "\n" + dims


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.sweep", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description=__doc__, epilog=file_format())
    p.add_argument("file", help="sweep YAML, e.g. ablations/sweep_delta_eta.yaml")
    p.add_argument("--trials", type=int, default=None, help="TOTAL trials the study should hold (overrides `trials:`); rerun with a larger N to continue")
    p.add_argument("--workers", type=int, default=1, help="worker processes sharing the storage (torch threads split between them)")
    p.add_argument("--storage", default=None, help="Optuna RDB URL (default: optuna.db next to the MLflow sqlite store), e.g. postgresql://user:pw@host/db")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the train config's logging.tracking_uri)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per trial (default: the config's `threads`, else CPUs split between workers)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="train-config override for every trial (ppo.steps=50), or sweep.<field>=v for the sweep file (sweep.seeds=2, sweep.pruner.name=none); repeatable")
    p.add_argument("--validate", action="store_true", help="only validate the sweep file and print the resolved search space")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for flag, v in (("--workers", args.workers), ("--threads", args.threads)):
            if v is not None and v < 1:
                raise ConfigError([f"{flag}: got {v}; allowed: an integer >= 1"])
        spec = load_sweep(args.file, args.overrides, trials=args.trials, tracking_uri=args.tracking_uri)
        if args.validate:
            print(f"sweep {spec.name}: {spec.trials} trials x {len(spec.seeds)} seed(s) x {spec.steps} steps, "
                  f"objective {spec.metric} ({spec.direction})")
            for k, v in spec.to_attr()["search_space"].items():
                print(f"  {k}: {json.dumps(v)}")
            return 0
        result = run_sweep(spec, workers=args.workers, storage_url=args.storage, threads=args.threads)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; rerun the same command to continue the study", file=sys.stderr)
        return 130
    c, best = result["counts"], result["best"]
    print(f"\n== sweep {spec.name}: {c['counted']} trials finished, {c['interrupted']} interrupted, {c['running']} running elsewhere ==")
    if best:
        print(f"best trial {best.number}: {spec.metric} = {best.value:.6g} ({spec.direction})" + (" (collapsed)" if best.user_attrs.get("collapsed") else ""))
        for k, v in best.params.items():
            print(f"  {k} = {_fmt(v)}")
    else:
        print("no completed trial yet")
    print(f"MLflow parent run {result['parent_run_id']} in {redact(result['tracking_uri'])}")
    print(f"plots and tables: {plots_command(spec, result['storage_url'], result['tracking_uri'])}")
    # Failed, pruned and collapsed trials are results (exit 0); a dead worker process is not.
    return 1 if result["worker_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
