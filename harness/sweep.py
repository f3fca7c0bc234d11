"""Hyperparameter sweeps: an Optuna study over TrainConfig keys, every trial an MLflow child run.

    python -m harness.sweep ablations/sweep_delta_eta.yaml --trials 16 --workers 2
    python -m analysis.sweep_plots sweep_delta_eta      # plots, trials table, best trial

A sweep file becomes tasks here (Optuna's ask/tell on a shared RDB storage: every runner asks the
next trial, each seed of it is a task); the study layer (harness.study) runs them on any executor
(`--executor slurm` as for grids). A trial scores the mean over its seeds (score_run); collapsed
trials stay COMPLETE, a FAILED run fails its trial, the pruner stops weak ones. `--trials` is the
study's TOTAL of trials with an outcome: rerunning continues the study and makes up trials cut off
by Ctrl-C, a dead worker or a dead runner; several runners may share one study. A run is found by
its configuration (not trained again once FINISHED, resumed when KILLED). A sweep with a design
sampler (random, sobol), choices drawn only `when` others allow them, `group`s, `worlds` and
`objectives` is a study over many choices at once (harness.design; ablations/study_tricks.yaml;
analysis.tricks reads it).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from statistics import fmean
from typing import Annotated, Any, Callable, Literal, get_args, get_origin

import numpy as np
import optuna
import sqlalchemy
from optuna.trial import TrialState
from pydantic import Field, model_validator

from harness import config, design, keys, prog, schema, tracking
from harness.config import TrainConfig, config_hash, from_dict, merge
from harness.registry import resolve_file, world_dirs, world_problems
from harness.summary import REDUCTIONS, by_step, reduce_run
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
    group: dict[str, dict[str, Any]] | None = None
    """A choice that is no single config key: its values are named sets of settings, e.g. `{ppo: {ppo.policy_loss:
    ppo}, grpo: {ppo.adv_estimator: grpo, generation.samples_per_prompt: 4}}`; the search-space key is then the
    choice's own name (letters, digits and _, no dots). Each value's settings must make a valid config."""
    when: dict[str, Scalar | list[Scalar]] | None = None
    """Draw this choice only where each named choice took one of the given values, e.g. `{reward.normalize: true}`
    or `{algorithm: [ppo, apa]}` (harness.design: define-by-run, so no run carries a value it ignores); elsewhere
    the config gets `otherwise`. Not with sampler grid."""
    otherwise: Scalar = None
    """With `when` (and required then): the value the config gets where this choice is not drawn, e.g. null for
    reward.clip or 0 for ppo.critic_pretrain_steps; for a group, one of its names or null (no settings)."""

    @model_validator(mode="after")
    def check_bounds(self) -> "Dimension":
        if self.group is not None and (self.choices not in (None, list(self.group)) or self.low is not None
                                       or self.high is not None or self.type not in (None, "categorical")):
            raise ValueError("allowed: a group's values are its names (no choices, low, high or numeric type)")
        if self.group is not None and not self.group:
            raise ValueError("allowed: a group with at least one named set of settings")
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

    name: Literal["tpe", "random", "grid", "sobol"] = "tpe"
    """tpe (multivariate TPE, constant liar for parallel workers) | random (uniform) | grid (every axis's grid
    values) | sobol (a scrambled Sobol sequence: a low-discrepancy design that meets every value of a choice of k
    values within the first 2^m >= k trials). random and sobol are designs: their draws depend on the seed and the
    trial's design index alone (harness.design), so a study reproduces whatever the runners and interruptions."""
    seed: Seed | None = 0
    """Base seed; trials are seeded by their design index, so no two runners draw the same values (null = random;
    not with sobol)."""
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


ObjectiveStat = Literal[(*REDUCTIONS, "collapsed")]  # type: ignore[valid-type]
"""How a run's curve becomes one number (harness.summary.REDUCTIONS), or `collapsed` (the run's collapse flag)."""


@section
class StudyObjective:
    """One number per run for the analysis (logged on the run as study/<name>, the trial's mean in its `runs`
    attribute): `stat` of `metric` over the run's logged steps (harness.summary), e.g. final gold = final of
    objective/gold_score, gold AUC = mean of it; `stat: collapsed` (no metric) is 1 for a collapsed run (on the
    world: the gold truth, tag harness.collapsed), else 0. The first objective is the study's score."""

    name: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,39}$")]
    """The objective's name (lower case, digits, _): the metric study/<name> and the analysis's column."""
    stat: ObjectiveStat = "final"
    """final | initial | rise | peak | min | mean | volatility | last (harness.summary), or collapsed."""
    metric: str | None = None
    """A step metric every run logs (harness/keys.py; gold metrics only on the world); none with `stat: collapsed`."""


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
    worlds: Annotated[list[Seed], Field(min_length=1)] | None = None
    """World seeds each trial's configuration runs on, every seed on every world (the trial's value: the mean over
    them): each world is built once by the runner, as a figure file's `worlds:` (cached by its config hash under
    .harness/worlds/), its runs tagged harness.world_seed; null: the one world at the base's data.world_dir."""
    world_set: dict[str, Any] = dataclasses.field(default_factory=dict)
    """WorldConfig overrides for every world of `worlds` (e.g. {model.n_layer: 4})."""
    objectives: list[StudyObjective] = dataclasses.field(default_factory=list)
    """Numbers recorded per run for the analysis of a design (analysis.tricks); the first is the study's score.
    Beside `objective` (what the sampler and the pruner see), not instead of it."""


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
    worlds: dict[int, tuple[Any, Path]] = dataclasses.field(default_factory=dict)
    """`worlds:` world seed -> (its WorldConfig, the folder its runs read); empty: the base's world."""
    objectives: list[StudyObjective] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    """What a runner prints before it starts (values the design never draws)."""
    design: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """A design's (random, sobol) params of its first `trials` trials, made ahead of time (harness.design.simulate)."""

    @property
    def units(self) -> list[tuple[int, int | None]]:
        """(seed, world) of each run of a trial: every seed on every world (world None: the base's)."""
        return [(s, w) for w in (sorted(self.worlds) or [None]) for s in self.seeds]

    def to_attr(self) -> dict[str, Any]:
        """What analysis.sweep_plots and analysis.tricks need, stored as the study's ATTR_SWEEP user attr."""
        space = {k: {a: v for a, v in dataclasses.asdict(d).items() if v is not None or (a == "otherwise" and d.when)}
                 for k, d in self.space.items()}
        return {"name": self.name, "title": self.file.title, "direction": self.direction, "metric": self.metric,
                "plot_pair": self.plot_pair,
                "search_space": space, "sweep_file": str(self.path), "seeds": self.seeds, "worlds": sorted(self.worlds),
                "steps": self.steps,
                "objectives": [dataclasses.asdict(o) for o in self.objectives]}


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
        if dim.low is None and dim.high is None:  # neither a range nor values
            return None, [f"{where}.choices: got None and no low, high; allowed: a list of values of {key}, or both "
                          "bounds of a range"]
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
    checks += [("otherwise", dim.otherwise)] if dim.when is not None else []  # the value its runs get where it is not drawn
    problems = [f"{where}.{label}: {p}" for label, v in checks for p in _build_config(merge(base, {key: v}))[1]]
    return (None if problems else out), list(dict.fromkeys(problems))


GROUP_NAME = r"^[A-Za-z][A-Za-z0-9_]{0,63}$"
"""A group's key and its values' names: one word, so it never reads as a dotted config key."""


def _resolve_group(key: str, dim: Dimension, base: dict[str, Any], types_: dict[str, Any]) -> tuple[Dimension | None, list[str]]:
    """A group: its names as the choices, each name's settings flat, known, searchable and valid on the base config."""
    from harness.registry import flat_settings

    where, problems = f"search_space.{key}", []
    if not re.match(GROUP_NAME, key):
        problems.append(f"{where}: got a group under the key {key!r}; allowed: a name of letters, digits and _ "
                        "(no dots: a dotted key is a config key)")
    if key in types_:
        problems.append(f"{where}: {key} is a config key; allowed: a group under a name of its own")
    groups = {}
    for name, sets in (dim.group or {}).items():
        at = f"{where}.group.{name}"
        if not re.match(GROUP_NAME, str(name)):
            problems.append(f"{at}: got the name {name!r}; allowed: letters, digits and _")
        flat = flat_settings(sets if isinstance(sets, dict) else {}, list(types_), at, problems)
        problems += [f"{at}.{k}: not searchable; allowed: keys that change what a run computes, not "
                     f"{', '.join(NOT_SEARCHABLE)}" for k in flat if k.startswith(NOT_SEARCHABLE)]
        problems += [f"{at}.{p}" for p in _build_config(merge(base, flat))[1]]  # ...group.<name>.<key>: got ...
        groups[name] = flat
    if dim.when is not None and dim.otherwise is not None and dim.otherwise not in groups:
        problems.append(f"{where}.otherwise: got {dim.otherwise!r}; allowed: null (no settings) or one of {list(groups)}")
    names = list(groups)
    out = dataclasses.replace(dim, type="categorical", choices=names, grid=names, group=groups)
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
    for k, v in (raw.get("search_space") or {}).items():  # `otherwise: null` is a value: given or not is in the YAML only
        if isinstance(v, dict) and ("when" in v) != ("otherwise" in v):
            problems.append(f"{path}: search_space.{k}.otherwise: missing; allowed: a choice drawn only `when` names the "
                            "value its runs get elsewhere (e.g. otherwise: null)" if "when" in v else
                            f"{path}: search_space.{k}.otherwise: given without `when`; allowed: otherwise with when")
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
        if dim.group is not None:
            d, p = _resolve_group(key, dim, data, types_)
            problems += p
            if d is not None:
                space[key] = d
        elif key not in types_:
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
    problems += design.dependency_problems(space, known=set(f.search_space))
    owners: dict[str, list[str]] = {}  # config key -> the choices that set it
    for key, d in space.items():
        for k in ({k for sets in d.group.values() for k in sets} if d.group is not None else {key}):
            owners.setdefault(k, []).append(key)
    problems += [f"search_space.{ks[1]}: sets {k}, which search_space.{ks[0]} sets too; allowed: each config key "
                 "set by one choice" for k, ks in owners.items() if len(ks) > 1]
    if f.sampler.name == "grid" and any(d.when for d in f.search_space.values()):
        problems.append("sampler.name: got 'grid' with a choice drawn only `when`; allowed: random, sobol or tpe")
    if f.sampler.name == "sobol" and f.sampler.seed is None:
        problems.append("sampler.seed: got None with sampler sobol; allowed: an integer (the design's seed)")
    worlds = _worlds(f, cfg, problems)
    found = preflight(cfg)
    if worlds:  # the runner builds them: what the base's world_dir holds does not matter
        found = [p for p in found if not ("no built world" in p or "world:" in p)]
    problems += found + _point_problems(f, space) + _objective_problems(f, cfg)
    numeric = [k for k, d in space.items() if d.type != "categorical"]
    pair = list(f.plots.pair) or numeric[:2]
    if f.plots.pair and (len(pair) != 2 or not set(pair) <= set(numeric) | (set(f.search_space) - set(space))):
        problems.append(f"plots.pair: got {pair!r}; allowed: two numeric search-space keys from {numeric}")
    if problems:
        raise ConfigError([p if p.startswith(f"{path}: ") else f"{path}: {p}" for p in problems])
    spec = SweepSpec(file=f, path=path, name=f.name, direction=f.direction, base_config=data, space=space,
                     metric=metric, tracking_uri=tracking.resolve_uri(tracking_uri, cfg.logging.tracking_uri),
                     seeds=seeds, trials=n_trials, steps=cfg.ppo.steps, plot_pair=pair, worlds=worlds,
                     objectives=list(f.objectives))
    if f.sampler.name in DESIGNS:  # the design is known ahead: every configuration it will run must be valid
        spec.warnings += _design_problems(spec)
    return spec


DESIGNS = ("random", "sobol")
"""Samplers whose draws are a function of the seed and the design index alone (harness.design)."""


def _worlds(f: SweepFile, cfg: TrainConfig, problems: list[str]) -> dict[int, tuple[Any, Path]]:
    """`worlds:` -> world seed -> (WorldConfig, folder), as a figure file's (harness.registry.world_dirs)."""
    problems += world_problems(f, "")
    if f.worlds is None:
        return {}
    if cfg.data.source != "world":
        problems.append(f"worlds: got {f.worlds} with data.source={cfg.data.source}; allowed: only on the world")
        return {}
    return world_dirs(f, "", problems)


def logged_metrics(cfg: TrainConfig) -> list[str]:
    """The metrics every run of this config logs at every step (or every eval step), in harness/keys.py."""
    gold = keys.GOLD_METRICS if cfg.data.source == "world" else []
    evals = [k for k in keys.EVAL_METRICS if k in (keys.EVAL_RM, keys.EVAL_LENGTH) or gold] \
        if cfg.logging.eval_every else []
    return [*keys.STEP_METRICS, keys.PPL_TOKENS, *gold, *evals]


def _objective_problems(f: SweepFile, cfg: TrainConfig) -> list[str]:
    """Each objective names a metric every run logs (none for `collapsed`); names are distinct."""
    problems, logged, names = [], logged_metrics(cfg), [o.name for o in f.objectives]
    problems += [f"objectives.{i}.name: got {n!r}; a name is listed twice" for i, n in enumerate(names)
                 if n in names[:i]]
    for i, o in enumerate(f.objectives):
        at = f"objectives.{i}.metric"
        if o.stat == "collapsed" and o.metric is not None:
            problems.append(f"{at}: got {o.metric!r} with stat collapsed; allowed: no metric (the run's collapse flag)")
        elif o.stat != "collapsed" and o.metric not in logged:
            gold_only = [*keys.GOLD_METRICS, keys.EVAL_GOLD, keys.EVAL_WIN_RATE]
            why = (f" (data.source={cfg.data.source} has no gold reward)" if o.metric in gold_only
                   and cfg.data.source != "world" else " (logging.eval_every is 0)" if o.metric in keys.EVAL_METRICS
                   and not cfg.logging.eval_every else schema.did_you_mean(o.metric, logged) if o.metric else "")
            problems.append(f"{at}: got {o.metric!r}; allowed: a metric every run logs (harness/keys.py){why}")
    return problems


def trial_config(spec: SweepSpec, params: dict[str, Any], world: int | None = None) -> dict[str, Any]:
    """The train config data of a trial's run on a world (before its seed and logging): the base, the trial's
    settings (harness.design.settings: drawn values, groups, `otherwise` values), the world's folder."""
    on_world = {} if world is None else {"data.world_dir": str(spec.worlds[world][1])}
    return merge(spec.base_config, {**design.settings(spec.space, params), **on_world})


def _design_problems(spec: SweepSpec) -> list[str]:
    """The design's first `trials` points made ahead of time: a configuration that is no valid config is an
    error (ConfigError, before any run); a value no trial draws is a warning (returned)."""
    points = spec.design = design.simulate(spec.space, lambda: make_sampler(spec), spec.trials, spec.direction)
    bad: dict[str, str] = {}
    for i, params in enumerate(points):
        for p in _build_config(trial_config(spec, params))[1]:
            bad.setdefault(p, f"trial {i} ({', '.join(f'{k}={_fmt(v)}' for k, v in params.items())})")
    if bad:
        raise ConfigError([f"{spec.path}: search_space: the design's {where} makes no valid config: {p}"
                           for p, where in list(bad.items())[:5]])
    never = [f"{k}={v}" for k, counts in design.coverage(spec.space, points).items() for v, n in counts.items() if not n]
    return [f"the design's {spec.trials} trials never draw {len(never)} value(s): {', '.join(never)}; raise `trials` "
            "(or --trials) to meet them"] if never else []


def default_storage_url(tracking_uri: str) -> str:
    """optuna.db next to the MLflow sqlite file; sqlite:///optuna.db (here) for other tracking URIs."""
    db = tracking.sqlite_path(tracking_uri)
    return f"sqlite:///{(db.parent if db else Path()) / 'optuna.db'}"


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
    """A sampler whose draws for a trial of design index i come from `make(seed + 1009 i)` (Optuna's
    user-defined sampler interface; harness.design.design_index: 0, 1, ... over the trials the sampler
    draws, enqueued trials skipped, which take `make(seed + 1009 n + 17)` for what they leave out). Design
    indices are unique in a storage, so runners started at once on one study never draw the same values
    (each seeded the same would), and a random design reproduces exactly however many runners, resumes
    and made-up trials it took."""

    def __init__(self, make: Callable[[int | None], Any], seed: int | None):
        self.make, self.seed = make, seed
        self._by_trial: dict[int, Any] = {}

    def _of(self, study: Any, trial: Any) -> Any:
        if trial.number not in self._by_trial:
            index = design.design_index(study, trial)
            seed = None if self.seed is None else self.seed + (1009 * trial.number + 17 if index is None else 1009 * index)
            self._by_trial[trial.number] = self.make(seed)
        return self._by_trial[trial.number]

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
        return self._of(study, trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        return self._of(study, trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study: Any, trial: Any, param_name: str, param_distribution: Any) -> Any:
        return self._of(study, trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: Any, trial: Any) -> None:
        self._of(study, trial).before_trial(study, trial)

    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        sampler = self._by_trial.pop(trial.number, None) or self.make(None)  # the trial's (another runner's: a fresh one)
        sampler.after_trial(study, trial, state, values)


def make_sampler(spec: SweepSpec) -> Any:
    """The sweep's sampler: grid as Optuna's GridSampler (which already hands out each point once
    across runners); tpe and random seeded per design index (TrialSeeded); sobol (harness.design.Sobol)."""
    s = spec.file.sampler
    if s.name == "grid":
        return optuna.samplers.GridSampler({k: d.grid for k, d in spec.space.items()}, seed=s.seed)
    if s.name == "sobol":
        return design.Sobol(spec.space, s.seed)
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
    with tracking.sqlite_lock(storage_url), quiet:  # multivariate TPE is experimental in Optuna
        study = optuna.create_study(storage=make_storage(storage_url), study_name=spec.name, direction=spec.direction,
                                    sampler=make_sampler(spec), pruner=make_pruner(spec), load_if_exists=True)
    stored = study.direction.name.lower()
    if stored != spec.direction:
        raise ConfigError([f"{spec.path}: direction: got {spec.direction!r} but study {spec.name!r} in "
                           f"{tracking.redact(storage_url)} was created with {stored!r}; allowed: {stored!r} "
                           "(or a new sweep name)"])
    return study


def stored_study(sweep: str | Path, tracking_uri: str | None = None,
                 storage_url: str | None = None) -> tuple[Any, dict[str, Any], str, str]:
    """A sweep's stored study, by name or sweep YAML, for reading it back (analysis): (the Optuna study, what
    harness.sweep stored of the sweep (ATTR_SWEEP), the tracking URI (harness.tracking.resolve_uri), the storage
    URL (default: optuna.db beside a sqlite store)); KeyError / ValueError naming what is missing."""
    name = str(schema.read_yaml(sweep, "sweep file").get("name")) if Path(sweep).suffix in (".yaml", ".yml") \
        else str(sweep)
    tracking_uri = tracking.resolve_uri(tracking_uri)
    storage_url = storage_url or default_storage_url(tracking_uri)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=name, storage=storage_url)
    except KeyError:
        raise KeyError(f"no Optuna study named {name!r} in {tracking.redact(storage_url)}; "
                       "run `python -m harness.sweep` on its sweep file first") from None
    attr = study.user_attrs.get(ATTR_SWEEP)
    if not attr:
        raise ValueError(f"study {name!r} holds no `{ATTR_SWEEP}` attribute: it was not run by harness.sweep")
    return study, attr, tracking_uri, storage_url


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


Unit = tuple[int, "int | None"]
"""(seed, world) of one run of a trial (world None: the base's world)."""
REUSED = "finished earlier"  # the note of a run a trial takes from the store instead of training it


@dataclasses.dataclass
class OpenTrial:
    """A trial asked from the study whose runs (one per seed x world) are in flight (this runner's)."""

    trial: Any
    params: dict[str, Any]
    tasks: dict[Unit, Task]
    """(seed, world) -> its task."""
    outcomes: dict[Unit, Outcome] = dataclasses.field(default_factory=dict)
    t0: float = dataclasses.field(default_factory=time.time)
    reported: int = 0
    """The last step reported to the pruner."""
    pruned_at: int | None = None

    def in_order(self, units: list[Unit]) -> list[tuple[Unit, Outcome]]:
        return [(u, self.outcomes[u]) for u in units if u in self.outcomes]


def unit_label(unit: Unit) -> str:
    """How user attrs key a run of a trial: its seed, with its world in a grid over worlds ('0', '0@w1')."""
    return str(unit[0]) if unit[1] is None else f"{unit[0]}@w{unit[1]}"


class TrialSource:
    """The study layer's tasks of a sweep: each trial asked from Optuna (ask/tell, on the shared
    storage) becomes one task per seed (x world); finished runs are scored and told; a pruner sees the
    running objective, read from the store while the runs train, and stops a weak trial's runs
    (a STOP file in each run folder: a step or two late).

    A run is found by its config (tags harness.sweep + harness.config_hash; named after the hash), not
    by its trial: a configuration already FINISHED in the store is not trained again (a made-up trial, a
    design that draws a configuration twice), one left KILLED (a runner or worker that died) resumes from
    its last checkpoint, one that FAILED starts over."""

    def __init__(self, spec: SweepSpec, study: Any, target: int, threads: int | None, nproc: int | None,
                 launcher: str, parent_run_id: str):
        self.spec, self.study, self.target, self.threads = spec, study, target, threads
        self.nproc, self.launcher, self.parent_run_id = nproc, launcher, parent_run_id
        self.open: dict[int, OpenTrial] = {}
        self.unit_of: dict[str, tuple[int, Unit]] = {}
        """Task key -> (trial number, unit)."""
        counts = trial_counts(study)
        self.total = len(spec.units) * max(0, target - counts["counted"] - counts["running"])
        self.worker_died: list[str] = []

    # -- asking
    def _wanted(self) -> bool:
        """The study holds fewer started trials than the target (every runner's trials count)."""
        return len(self.study.get_trials(deepcopy=False, states=COUNTED)) < self.target

    def take(self, free: int) -> list[Task]:
        out: list[Task] = []
        while free > len(out) and self._wanted():
            trial = self.study.ask()
            params = design.suggest(self.spec.space, trial)
            trial.set_user_attr("runner_pid", os.getpid())
            index = design.design_index(self.study, trial)
            if index is not None:
                trial.set_user_attr(design.ATTR_DESIGN_INDEX, index)
            ot = OpenTrial(trial, params, {u: self._task(trial, params, *u) for u in self.spec.units})
            self.open[trial.number] = ot
            for unit, task in ot.tasks.items():
                self.unit_of[task.key] = (trial.number, unit)
                earlier = self._plan(task)
                if earlier is None:
                    out.append(task)
                else:  # its run finished earlier: told with the others, not trained again
                    ot.outcomes[unit] = earlier
            if len(ot.outcomes) == len(ot.tasks):
                del self.open[trial.number]
                self._tell(ot)
        return out

    def _task(self, trial: Any, params: dict[str, Any], seed: int, world: int | None) -> Task:
        spec, uri = self.spec, self.spec.tracking_uri
        data = merge(trial_config(spec, params, world), {"seed": seed})
        cfg, _ = _build_config(data)  # values that make no valid config fail the trial in its worker (ConfigError)
        chash = config_hash(cfg) if cfg is not None else None
        where = f"-s{seed}" + ("" if world is None else f"-w{world}")
        name = f"{spec.name}-{chash}{where}" if chash else f"{spec.name}-t{trial.number:04d}{where}"
        tags = {keys.TAG_SWEEP: spec.name, keys.TAG_TRIAL: str(trial.number), keys.TAG_SEED: str(seed),
                **({} if world is None else {keys.TAG_WORLD_SEED: str(world)})}
        # the run folder pinned (default or the file's): a fresh start clears it, a pruned trial's STOP file goes there
        out_dir = (data.get("logging") or {}).get("output_dir", config.LoggingConfig.output_dir)
        over = {"logging.tracking_uri": uri, "logging.experiment": spec.name, "logging.output_dir": str(out_dir),
                "logging.progress": False,  # a line per finished run (the study's Progress), no bars from workers
                "logging.run_name": name, "logging.parent_run_id": self.parent_run_id,
                "logging.tags": {**((spec.base_config.get("logging") or {}).get("tags") or {}), **tags},
                **({"threads": self.threads} if self.threads else {})}
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in params.items())
        return Task(f"{name}@t{trial.number}", f"trial {trial.number} · seed {seed}"
                    + ("" if world is None else f" · world {world}") + f" ({shown})", merge(data, over),
                    tags={keys.TAG_SWEEP: spec.name, keys.TAG_CONFIG_HASH: chash} if chash else tags, steps=spec.steps,
                    nproc=self.nproc, launcher=self.launcher, parent_run_id=self.parent_run_id)

    def _plan(self, task: Task) -> Outcome | None:
        """What the store holds of the task's configuration: FINISHED -> its outcome (nothing to train);
        KILLED or RUNNING (its runner died) -> resume it; FAILED or none -> a fresh start."""
        run = _run_of(self.spec.tracking_uri, self.spec.name, task) if keys.TAG_CONFIG_HASH in task.tags else None
        status = run.info.status if run is not None else None
        if status == "FINISHED" and run.data.tags.get(keys.TAG_STOPPED) == "callback":
            status = "stopped early (pruned)"  # not the configuration's whole run
        if status == "FINISHED":
            m = run.data.metrics
            return Outcome(task.key, task.label, "FINISHED", run.info.run_id, self.spec.steps,
                           run.data.tags.get(keys.TAG_COLLAPSED) == "true",
                           int(m[keys.COLLAPSE_STEP]) if keys.COLLAPSE_STEP in m else None, note=REUSED)
        task.resume = status in ("KILLED", "RUNNING")
        task.note = "resume from its last checkpoint" if task.resume else f"rerun after {status}" if status else "new"
        if not task.resume:  # a fresh start must not pick up the checkpoint of a run the store no longer continues
            log = task.cfg["logging"]
            shutil.rmtree(Path(log["output_dir"]) / log["run_name"], ignore_errors=True)
        return None

    def exhausted(self) -> bool:
        return not self._wanted() and not self.open

    # -- while the runs train
    def poll(self, running: list[Task]) -> None:
        """Report each open trial's running objective to the pruner while its runs train."""
        for ot in list(self.open.values()):
            self._report(ot)

    def _report(self, ot: OpenTrial) -> None:
        """Report the steps not reported yet: at each step every run has logged, the mean over the
        runs of the last `last_steps` values of the objective; once the pruner says prune, STOP
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
        n, unit = self.unit_of.pop(task.key)
        ot = self.open[n]
        ot.outcomes[unit] = outcome
        if len(ot.outcomes) < len(ot.tasks):
            return
        del self.open[n]
        self._tell(ot)

    def _tell(self, ot: OpenTrial) -> None:
        spec, obj, uri, trial = self.spec, self.spec.file.objective, self.spec.tracking_uri, ot.trial
        for unit, o in ot.outcomes.items():  # a worker that died left no run id in its outcome: the store has it
            if o.run_id is None and (run := _run_of(uri, spec.name, ot.tasks[unit])) is not None:
                o.run_id = run.info.run_id
        if all(o.ok for o in ot.outcomes.values()):
            self._report(ot)  # the steps logged since the last poll (short runs end between two polls)
        ordered = ot.in_order(spec.units)
        run_ids = [o.run_id for _, o in ordered if o.run_id]
        for rid in run_ids:
            tracking.log_params(uri, rid, {f"trial.{k}": v for k, v in ot.params.items()})
        trial.set_user_attr("mlflow_run_ids", run_ids)
        trial.set_user_attr("duration_s", round(time.time() - ot.t0, 2))
        died = [o for o in ot.outcomes.values() if o.worker_died]
        failed = [(u, o) for u, o in ordered if not o.ok and not o.worker_died]
        if died or (not failed and any(o.status == "KILLED" for o in ot.outcomes.values())):
            # interrupted: it does not count, and is made up with the same values
            self.worker_died += [o.why for o in died]
            self._finish(ot, TrialState.FAIL, "interrupted", "interrupted: " + (died[0].why if died else "runs KILLED"),
                         run_status="KILLED")
            self.study.enqueue_trial(ot.params, user_attrs={"retry_of": trial.number})
            return
        if failed:
            (seed, world), why = failed[0][0], failed[0][1].why
            reason = f"seed {seed}" + ("" if world is None else f" world {world}") + f": {why}"
            trial.set_user_attr("failure_reason", reason[:2000])
            trial.set_user_attr("failed_seed", seed)
            self._finish(ot, TrialState.FAIL, "failed", f"FAILED: {reason[:200]}", tags={keys.TAG_FAILURE: reason[:500]})
            return
        if ot.pruned_at is not None:
            trial.set_user_attr("pruned_at_step", ot.pruned_at)
            self._finish(ot, TrialState.PRUNED, "pruned", f"pruned at step {ot.pruned_at}")
            return
        scores, raws, collapse_steps, runs = [], [], {}, []
        try:
            for unit, o in ordered:
                collapse_step = (o.collapse_step or o.steps_done) if o.collapsed else None
                score, raw = score_run(tracking.metric_history(uri, o.run_id, spec.metric), obj, spec.direction,
                                       collapse_step)
                if collapse_step is not None and obj.collapsed == "worst":
                    done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    score = (min if spec.direction == "maximize" else max)([t.value for t in done] + [score])
                collapse_steps[unit_label(unit)] = collapse_step
                scores.append(score)
                raws.append(raw)
                runs.append({"run_id": o.run_id, "seed": unit[0], "world": unit[1], "collapsed": bool(o.collapsed),
                             **run_objectives(uri, o, spec.objectives, log=o.note != REUSED)})
                if o.note != REUSED:
                    tracking.MetricLogger(uri, o.run_id).log({keys.SWEEP_OBJECTIVE: score}, step=o.steps_done)
        except TrialFailed as e:
            trial.set_user_attr("failure_reason", str(e)[:2000])
            self._finish(ot, TrialState.FAIL, "failed", f"FAILED: {e}", tags={keys.TAG_FAILURE: str(e)[:500]})
            return
        value = fmean(scores)
        collapsed = sorted({u[0] for u, o in ordered if collapse_steps[unit_label(u)] is not None})
        for k, v in {"seed_scores": scores, "seed_raw_scores": raws, "collapsed": bool(collapsed),
                     "collapsed_seeds": collapsed, "collapse_steps": collapse_steps, "runs": runs}.items():
            trial.set_user_attr(k, v)
        reused = sum(o.note == REUSED for _, o in ordered)
        self._finish(ot, TrialState.COMPLETE, "collapsed" if collapsed else "complete", f"{spec.metric}={_fmt(value)}"
                     + (f" (collapsed seeds {collapsed}, raw {_fmt(fmean(raws))})" if collapsed else "")
                     + (f" ({reused} of {len(ordered)} runs {REUSED}: not trained again)" if reused else ""), value=value)

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


def run_objectives(uri: str, outcome: Outcome, objectives: list[StudyObjective], *, log: bool) -> dict[str, float]:
    """A finished run's `objectives` (harness.summary over its logged steps; `collapsed` from its flag), NaN
    where it logged no value; with `log`, each also logged on the run as study/<name> at its last step."""
    values, histories = {}, {}
    for o in objectives:
        if o.stat == "collapsed":
            values[o.name] = float(outcome.collapsed)
            continue
        if o.metric not in histories:
            histories[o.metric] = by_step(tracking.metric_history(uri, outcome.run_id, o.metric))
        values[o.name] = reduce_run([v for v in histories[o.metric] if math.isfinite(v)], o.stat)
    finite = {f"{keys.STUDY_PREFIX}{k}": v for k, v in values.items() if math.isfinite(v)}
    if log and finite:
        tracking.MetricLogger(uri, outcome.run_id).log(finite, step=max(1, outcome.steps_done))
    return values


def _running(series: dict[int, float], step: int, last: int) -> float:
    values = [v for t, v in sorted(series.items()) if t <= step and math.isfinite(v)]
    return fmean(values[-last:]) if values else math.nan


def _run_of(uri: str, experiment: str, task: Task) -> Any:
    runs = find_runs(uri, experiment, task.tags)
    return runs[-1] if runs else None


def fail_orphans(st: Study, study: Any) -> list[int]:
    """With no other runner of the study alive (st.alone: Study calls this on entry, before any other
    runner can start), every RUNNING trial's runner is dead: tell them failed (interrupted: made up
    with the same values), end their MLflow runs KILLED."""
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
    for line in spec.warnings:
        print(f"[sweep {spec.name}] warning: {line}", flush=True)
    if spec.worlds:  # built once each (cached by config hash), as a grid over worlds does
        from harness.ablate import build_worlds

        build_worlds(spec.worlds, uri, max(1, workers))
    study = open_study(spec, storage_url)
    status, interrupted = "FINISHED", False
    with Study(uri, spec.name, ("sweep", spec.name, tracking.redact(storage_url)), runs_dir=runs_dir,
               exclusive=False, what="python -m harness.sweep", noun="sweep",
               recover=lambda st: fail_orphans(st, study)) as st:
        with st.creation_lock():  # one parent run and one set of first trials when two sweeps start at once
            stored = study.user_attrs.get(ATTR_SWEEP)
            if stored is None and not study.get_trials(deepcopy=False):
                for i, point in enumerate(spec.file.first_trials):  # enqueued: not the design's points (design_index)
                    study.enqueue_trial(point, user_attrs={"first_trial": i}, skip_if_exists=True)
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
        lost = st.recovered or []
        counts = trial_counts(study)
        target = spec.trials + counts["interrupted"]  # interrupted trials are made up
        remaining = max(0, spec.trials - counts["counted"] - counts["running"])  # queued ones are run here
        n_workers = max(0, min(workers, remaining * len(spec.units))) if workers else 0
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


def print_dry_run(spec: SweepSpec) -> None:
    """The plan: trials x runs each, the search space, the objectives, and for a design (random, sobol) how
    often the planned trials draw each value."""
    worlds = f" x {len(spec.worlds)} world(s) {sorted(spec.worlds)}" if spec.worlds else ""
    print(f"sweep {spec.name}: {spec.trials} trials x {len(spec.seeds)} seed(s){worlds} = "
          f"{spec.trials * len(spec.units)} runs x {spec.steps} steps, objective {spec.metric} ({spec.direction}), "
          f"sampler {spec.file.sampler.name}")
    for k, v in spec.to_attr()["search_space"].items():
        print(f"  {k}: {json.dumps(v)}")
    for o in spec.objectives:
        print(f"  objective {o.name}: " + ("collapsed (the run's collapse flag)" if o.stat == "collapsed"
                                            else f"{o.stat} of {o.metric}"))
    for w, (_, d) in sorted(spec.worlds.items()):
        print(f"  world {w}: {d}")
    if spec.design:
        print(f"the design's {spec.trials} trials draw (trials per value):")
        for k, counts in design.coverage(spec.space, spec.design).items():
            print(f"  {k}: " + ", ".join(f"{v} {n}" for v, n in counts.items()))
    for line in spec.warnings:
        print(f"warning: {line}")


DESIGN_HELP = """A design (sampler random or sobol, e.g. ablations/study_tricks.yaml): every trial's values are a
function of the seed and its design index, so --dry-run prints how often each value will be drawn, and every
configuration the design will run is checked before the first one. A run is found by its configuration (tags
harness.sweep + harness.config_hash): a configuration FINISHED in the store is not trained again, one left
KILLED resumes from its checkpoint. Analysis: python -m analysis.tricks NAME."""


def build_parser() -> argparse.ArgumentParser:
    dims = schema.help_text(Dimension).replace("[top level]", "[search_space.<TrainConfig key>]")
    objs = schema.help_text(StudyObjective).replace("[top level]", "[objectives: each item]")
    p = argparse.ArgumentParser(prog=prog("harness.sweep"), description=__doc__,
                                epilog=f"Sweep file (YAML):\n{schema.help_text(SweepFile)}\n{dims}\n{objs}\n{DESIGN_HELP}",
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
            print_dry_run(spec)
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
