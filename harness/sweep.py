"""Hyperparameter sweeps: an Optuna study over any TrainConfig keys, every trial an MLflow run.

    python -m harness.sweep ablations/sweep_delta_eta.yaml --trials 16 --workers 2

Sweep file (YAML, usually under ablations/):

    name: sweep_delta_eta           # Optuna study name = MLflow experiment = reports/<name>/
    kind: sweep                     # optional (a `search_space` key already marks a sweep)
    title: "..."                    # optional, for reports (also `figure`, `description`)
    base: bases/ppo_max.yaml        # optional train config, path relative to this file
    set: {collapse.stop_on_collapse: true}   # overrides for every trial (dotted keys)
    steps: 150                      # optional shorthand for ppo.steps (beats `set`; --set beats both)
    seeds: [0]                      # seeds per trial: a list, or a count n (cfg.seed + 0..n-1);
                                    #   the trial's objective is the mean over its seeds
    trials: 16                      # TOTAL trials the study should hold (see "Trial counting")
    direction: maximize             # or minimize
    search_space:                   # any leaf key of TrainConfig (python -m harness.train --help)
      reward.clip:  {low: 0.1, high: 10, log: true}     # type inferred from the config field
      ppo.kl_coef:  {low: 0.001, high: 0.5, log: true, grid: [0.01, 0.05, 0.2]}
      ppo.ppo_epochs: {type: int, low: 1, high: 4}
      ppo.adv_normalize: {choices: [true, false]}       # categorical (bool/Literal: all by default)
    first_trials:                   # optional: points to try first (enqueued when the study is new;
      - {reward.clip: 0.8, ppo.kl_coef: 0.05}           #   keys left out are sampled)
    objective:
      metric: auto                  # auto = objective/gold_score on the embedded world,
                                    #        objective/rm_score for other prompt sources
      last_steps: 10                # objective = mean of the metric over the last 10 logged steps
      collapsed: penalty            # how a collapsed run scores: penalty | worst | ignore
      collapse_penalty: 1.0         # in metric units
    sampler: {name: tpe, seed: 0, n_startup_trials: 5, multivariate: true}   # tpe | random | grid
    pruner:  {name: median, n_startup_trials: 4, n_warmup_steps: 30}         # median | threshold | none
    plots: {pair: [reward.clip, ppo.kl_coef]}   # optional: the two keys of the 2-D plot

Everything is validated before the first trial: an unknown key names the closest valid keys; a bad
type, range or value names the field, the value and what is allowed (each search-space bound,
grid value and choice is checked by building the full TrainConfig with it).

Objective. The score of one training run is the mean of `objective.metric` over its last
`last_steps` logged steps (read back from MLflow). A collapsed run (RunResult.collapsed) scores:
  - penalty (default): the mean over the `last_steps` steps up to and including the collapse
    step, made worse by `collapse_penalty` (minus when maximizing, plus when minimizing);
  - worst: the worst value among the study's completed trials so far (the penalty score when it
    is worse, or when nothing has completed yet);
  - ignore: scored like any other run.
A trial's value is the mean of its seeds' scores. Collapsed trials stay COMPLETE (the sampler
learns to avoid them) with user attr `collapsed=True` and MLflow tag harness.trial_outcome=collapsed.

Failures. A run that ends FAILED (NaN/inf loss or an exception inside training) fails its trial:
Optuna state FAIL, user attrs `outcome=failed` and `failure_reason`, MLflow tags
harness.trial_state=FAIL. The study goes on; TPE ignores FAIL trials when sampling.

Pruning. After every training step the trial reports the running objective (mean over the last
`last_steps` steps so far) at step `seed_index * steps + step`, and the trainer's on_step callback
returns `trial.should_prune()`; a pruned trial ends the run early (tag harness.stopped_by=callback)
and is stored PRUNED (user attr `pruned_at_step`).

Trial counting. `trials` / `--trials N` is the TOTAL number of trials the study should hold. A
trial counts once it reached an outcome (COMPLETE, PRUNED, or FAIL with an `outcome` user attr);
trials cut off by Ctrl-C or a killed process do not count and are made up by the next run.
Rerunning the same command continues the same study (load_if_exists) and runs only the trials
still missing, so "rerunning with more trials" simply raises N. With --workers N, trial slots are
handed out by a shared counter, so no trial is lost or duplicated; several machines sharing one
PostgreSQL storage also re-check the study's count before every trial (concurrent starts on
different machines can overshoot N by at most one trial per extra machine).

Storage. Default: `optuna.db` next to the MLflow sqlite file (sqlite:///optuna.db for other
tracking URIs); any Optuna RDB URL works (postgresql://user:pw@host/db). The study name is the
sweep name. Heartbeats (every 20 s) let a later run mark trials of a killed process as FAIL.

MLflow. One parent run per study in experiment <name> (tag harness.role=parent; reused when the
study is continued against the same tracking store); every trial seed is a child run with tags
harness.sweep, harness.trial, harness.seed, harness.trial_state, harness.trial_outcome, the trial's
sampled values as params `trial.<key>` and its score as metric `sweep/objective`. At the end the
parent gets the plots, trials.csv and best.json from analysis.sweep_plots.sweep_summary().
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from harness import keys
from harness.config import (
    ConfigError,
    TrainConfig,
    _is_optional,
    _unwrap,
    describe_type,
    from_dict,
    iter_fields,
    merge,
    parse_value,
    read_yaml,
)

# -- MLflow names used by sweeps (shared ones live in harness/keys.py) ---------------------------
TAG_SWEEP = keys.TAG_SWEEP
TAG_TRIAL = keys.TAG_TRIAL
TAG_TRIAL_STATE = keys.TAG_TRIAL_STATE  # COMPLETE | PRUNED | FAIL (the Optuna state)
TAG_TRIAL_OUTCOME = keys.TAG_TRIAL_OUTCOME  # complete | collapsed | pruned | failed | error
TAG_STUDY = "harness.optuna_study"
TAG_STORAGE = "harness.optuna_storage"  # password hidden
TAG_SWEEP_FILE = "harness.sweep_file"
METRIC_OBJECTIVE = keys.SWEEP_OBJECTIVE  # a seed run's score; on the parent: best value so far
TRIAL_PARAM_PREFIX = "trial."

# Optuna user attrs
ATTR_OUTCOME = "outcome"
ATTR_PARENT_RUNS = "mlflow_parent_runs"  # study attr: {tracking_uri: parent run id}

SWEEP_FIELDS = (
    "name", "kind", "figure", "title", "description", "base", "set", "steps", "seeds", "trials",
    "direction", "search_space", "first_trials", "objective", "sampler", "pruner", "plots",
)
OBJECTIVE_FIELDS = ("metric", "last_steps", "collapsed", "collapse_penalty")
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "threshold", "none")
# Keys that say where a run is logged, not what it computes, or that the sweep sets itself.
NOT_SEARCHABLE = ("logging.", "device", "threads", "seed", "distributed.", "ppo.steps")
HEARTBEAT_INTERVAL_S = 20
HEARTBEAT_GRACE_S = 120
SQLITE_TIMEOUT_S = 600


class SweepError(ConfigError):
    """Bad sweep input; lists every problem found, one per line."""

    def __init__(self, problems: list[str], source: str = "sweep"):
        self.problems = problems
        ValueError.__init__(self, f"invalid {source}:\n  - " + "\n  - ".join(problems))


class TrialFailed(Exception):
    """A trial whose training run ended FAILED (stored as an Optuna FAIL trial)."""


# ----------------------------------------------------------------------------------------------
# The sweep spec
# ----------------------------------------------------------------------------------------------
@dataclass
class Dimension:
    """One search-space axis: a TrainConfig key and how to sample it."""

    key: str
    kind: Literal["float", "int", "categorical"]
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: list[Any] | None = None
    grid: list[Any] | None = None
    """Values the grid sampler uses (from `grid:`, or spaced between low and high, or `choices`)."""

    def suggest(self, trial: Any) -> Any:
        if self.kind == "float":
            return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high, log=self.log, step=self.step or 1)
        return trial.suggest_categorical(self.key, self.choices)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k != "key"}

    @property
    def numeric(self) -> bool:
        return self.kind in ("float", "int")


@dataclass
class ObjectiveSpec:
    metric: str = "auto"
    """Resolved metric key (never "auto" after load_sweep)."""
    last_steps: int = 10
    collapsed: Literal["penalty", "worst", "ignore"] = "penalty"
    collapse_penalty: float = 1.0


@dataclass
class SweepSpec:
    name: str
    path: Path | None
    base_config: dict[str, Any]
    """Train config dict (base file + set + --set + steps), validated; no search values yet."""
    search_space: list[Dimension]
    objective: ObjectiveSpec
    direction: Literal["maximize", "minimize"] = "maximize"
    trials: int = 16
    seeds: list[int] = field(default_factory=lambda: [0])
    steps: int = 0
    sampler: dict[str, Any] = field(default_factory=lambda: {"name": "tpe"})
    pruner: dict[str, Any] = field(default_factory=lambda: {"name": "median"})
    plot_pair: list[str] = field(default_factory=list)
    first_trials: list[dict[str, Any]] = field(default_factory=list)
    """Points enqueued (optuna enqueue_trial) when the study is created."""
    title: str = ""
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return [d.key for d in self.search_space]

    def grid_size(self) -> int:
        return math.prod(len(d.grid or []) for d in self.search_space)

    def train_config(self) -> TrainConfig:
        return from_dict(self.base_config)

    def search_space_json(self) -> dict[str, Any]:
        return {d.key: d.to_json() for d in self.search_space}


def _config_fields() -> dict[str, tuple[Any, Any]]:
    return {k: (tp, default) for k, tp, default, _doc in iter_fields()}


def _closest(word: str, options: list[str], n: int = 3) -> str:
    close = difflib.get_close_matches(word, options, n=n, cutoff=0.5)
    if not close:  # dotted keys: also try the last part against every field's last part
        tail = word.rsplit(".", 1)[-1]
        close = [o for o in options if o.rsplit(".", 1)[-1] in difflib.get_close_matches(tail, [x.rsplit(".", 1)[-1] for x in options], n=n, cutoff=0.6)][:n]
    return f"did you mean {' or '.join(close)}?" if close else ""


def _field_kind(tp: Any) -> tuple[str, list[Any] | None]:
    """('float'|'int'|'bool'|'literal'|'other', literal choices) of a config field annotation."""
    base, _rng = _unwrap(tp)
    _opt, inner = _is_optional(base)
    if get_origin(inner) is Literal:
        return "literal", list(get_args(inner))
    if inner is bool:
        return "bool", [True, False]
    if inner is float:
        return "float", None
    if inner is int:
        return "int", None
    return "other", None


def _spaced(low: float, high: float, n: int, log: bool, integer: bool) -> list[Any]:
    if n == 1:
        vals = [low]
    elif log:
        vals = [math.exp(math.log(low) + i * (math.log(high) - math.log(low)) / (n - 1)) for i in range(n)]
    else:
        vals = [low + i * (high - low) / (n - 1) for i in range(n)]
    if integer:
        return sorted({int(round(v)) for v in vals})
    return [float(f"{v:.6g}") for v in vals]


def _parse_dimension(key: str, spec: Any, base_config: dict[str, Any], problems: list[str]) -> Dimension | None:
    fields = _config_fields()
    where = f"search_space.{key}"
    if key not in fields:
        sections = sorted({k.split(".")[0] for k in fields if "." in k})
        if key in sections:
            hint = f"{key} is a section; its keys: {', '.join(k for k in fields if k.startswith(key + '.'))}"
        else:
            hint = _closest(key, list(fields)) or f"keys start with one of: {', '.join(sections)}"
        problems.append(f"{where}: unknown config key; {hint}")
        return None
    if key.startswith(NOT_SEARCHABLE) or key in NOT_SEARCHABLE:
        extra = {"seed": " (use `seeds:` for several seeds per trial)", "ppo.steps": " (set `steps:`; the pruner compares trials step by step)"}.get(key, "")
        problems.append(f"{where}: not searchable; allowed: keys that change what a run computes, not logging/device/threads/seed/distributed/ppo.steps{extra}")
        return None
    if spec is None:
        spec = {}
    if isinstance(spec, list):  # shorthand: a list of choices
        spec = {"choices": spec}
    if not isinstance(spec, dict):
        problems.append(f"{where}: got {spec!r}; allowed: a mapping like {{low: 0.1, high: 10, log: true}} or {{choices: [...]}}")
        return None
    allowed_keys = DIMENSION_FIELDS
    for k in spec:
        if k not in allowed_keys:
            hint = _closest(str(k), list(allowed_keys)) or f"allowed: {', '.join(allowed_keys)}"
            problems.append(f"{where}.{k}: unknown; {hint}")
    tp, _default = fields[key]
    field_kind, literal_choices = _field_kind(tp)
    kind = spec.get("type")
    if kind is None:
        if "choices" in spec or field_kind in ("bool", "literal"):
            kind = "categorical"
        elif field_kind in ("float", "int"):
            kind = field_kind
        else:
            problems.append(f"{where}: field type is {describe_type(tp)}; allowed: give `choices: [...]`")
            return None
    if kind not in ("float", "int", "categorical"):
        problems.append(f"{where}.type: got {kind!r}; allowed: float, int, categorical")
        return None
    n_problems = len(problems)

    def check_value(value: Any, label: str) -> None:
        """Build the full TrainConfig with this value: config validation names field/value/allowed."""
        try:
            from_dict(merge(base_config, {key: value}))
        except ConfigError as e:
            for p in e.problems:
                problems.append(f"{where}.{label}: {p}")

    if kind == "categorical":
        choices = spec.get("choices", literal_choices)
        if not isinstance(choices, list) or not choices:
            problems.append(f"{where}.choices: got {choices!r}; allowed: a non-empty list of values for {describe_type(tp)}")
            return None
        for c in choices:
            if not (c is None or isinstance(c, (bool, int, float, str))):
                problems.append(f"{where}.choices: got {c!r}; allowed: numbers, strings, true/false or null")
            else:
                check_value(c, "choices")
        if len(set(map(repr, choices))) != len(choices):
            problems.append(f"{where}.choices: got {choices!r}; allowed: distinct values")
        if "grid" in spec and spec["grid"] != choices:
            problems.append(f"{where}.grid: a categorical axis uses its choices as grid")
        if len(problems) > n_problems:
            return None
        return Dimension(key, "categorical", choices=list(choices), grid=list(choices))

    # numeric
    if field_kind not in ("float", "int"):
        problems.append(f"{where}.type: got {kind!r} but {key} is {describe_type(tp)}; allowed: categorical with choices")
        return None
    if kind == "float" and field_kind == "int":
        problems.append(f"{where}.type: got 'float' but {key} is {describe_type(tp)}; allowed: int")
        return None
    low, high, log, step = spec.get("low"), spec.get("high"), spec.get("log", False), spec.get("step")
    for label, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
            problems.append(f"{where}.{label}: got {v!r}; allowed: a finite number")
        elif kind == "int" and not float(v).is_integer():
            problems.append(f"{where}.{label}: got {v!r}; allowed: an integer")
    if not isinstance(log, bool):
        problems.append(f"{where}.log: got {log!r}; allowed: true or false")
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float)) or step <= 0):
        problems.append(f"{where}.step: got {step!r}; allowed: a number > 0")
    if len(problems) > n_problems:
        return None
    if kind == "int":
        low, high = int(low), int(high)
        step = int(step) if step is not None else None
    else:
        low, high = float(low), float(high)
        step = float(step) if step is not None else None
    if not low < high:
        problems.append(f"{where}: got low={low:g}, high={high:g}; allowed: low < high")
    if log and low <= 0:
        problems.append(f"{where}.low: got {low:g} with log: true; allowed: a number > 0 (log scale)")
    if log and step is not None:
        problems.append(f"{where}.step: got {step:g} with log: true; allowed: step only on a linear scale")
    if len(problems) > n_problems:
        return None
    check_value(low, "low")
    check_value(high, "high")
    grid = spec.get("grid")
    if grid is not None:
        if not isinstance(grid, list) or not grid:
            problems.append(f"{where}.grid: got {grid!r}; allowed: a non-empty list of numbers in [{low:g}, {high:g}]")
            grid = None
        else:
            for g in grid:
                if isinstance(g, bool) or not isinstance(g, (int, float)) or not low <= g <= high:
                    problems.append(f"{where}.grid: got {g!r}; allowed: numbers in [{low:g}, {high:g}]")
    else:
        points = spec.get("grid_points")
        if points is None:
            points = 3 if kind == "float" or high - low + 1 > 5 else high - low + 1
        if isinstance(points, bool) or not isinstance(points, int) or points < 1:
            problems.append(f"{where}.grid_points: got {points!r}; allowed: an integer >= 1")
        else:
            grid = _spaced(low, high, points, log, kind == "int")
    if len(problems) > n_problems:
        return None
    grid = [int(g) if kind == "int" else float(g) for g in grid]
    return Dimension(key, kind, low=low, high=high, log=log, step=step, grid=grid)


def _known_metrics() -> list[str]:
    return list(dict.fromkeys(keys.STEP_METRICS + keys.GOLD_METRICS + keys.EVAL_METRICS))


def split_overrides(items: list[str] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """--set items -> (sweep-level overrides `sweep.<field>=...`, train-config overrides)."""
    sweep_over: dict[str, Any] = {}
    train_over: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise SweepError([f"--set {item!r}: expected KEY=VALUE, e.g. ppo.kl_coef=0.1 or sweep.seeds=2"], "--set")
        k, v = (s.strip() for s in item.split("=", 1))
        (sweep_over if k.startswith("sweep.") else train_over)[k.removeprefix("sweep.") if k.startswith("sweep.") else k] = parse_value(v)
    return sweep_over, train_over


DIMENSION_FIELDS = ("type", "low", "high", "log", "step", "choices", "grid", "grid_points")


def _merge_sweep_overrides(raw: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Apply `sweep.<field>=v` overrides. Search-space keys are dotted config keys themselves:
    `search_space.ppo.kl_coef.low=0.01` sets one bound, `search_space.ppo.kl_coef={...}` the axis."""
    out = merge(raw, {k: v for k, v in over.items() if not k.startswith("search_space.")})
    space = dict(out.get("search_space") or {}) if isinstance(out.get("search_space"), dict) else out.get("search_space")
    for k, v in over.items():
        if not k.startswith("search_space.") or not isinstance(space, dict):
            continue
        rest = k[len("search_space."):]
        key, _, attr = rest.rpartition(".")
        if attr in DIMENSION_FIELDS and key:
            dim = space.get(key)
            space[key] = {**(dim if isinstance(dim, dict) else {}), attr: v}
        else:
            space[rest] = v
    if space is not None:
        out["search_space"] = space
    return out


def load_sweep(
    path: str | Path | dict[str, Any],
    overrides: list[str] | None = None,
    *,
    trials: int | None = None,
    tracking_uri: str | None = None,
    check_data: bool = True,
) -> SweepSpec:
    """Read and validate a sweep file (or dict) completely; raises SweepError listing every problem.

    `overrides`: `--set` items; `sweep.<field>=v` changes the sweep file (e.g. sweep.seeds=2,
    sweep.pruner.name=none), any other key the train config of every trial. `check_data=False`
    skips the checks that the world dir / HH-RLHF file exist (for drawing reports later).
    """
    if isinstance(path, dict):
        raw, src, here = dict(path), "sweep", Path.cwd()
        path = None
    else:
        path = Path(path)
        src, here = f"sweep file {str(path)!r}", path.resolve().parent
        try:
            raw = read_yaml(path)
        except ConfigError as e:
            raise SweepError(e.problems, src) from None
    sweep_over, train_over = split_overrides(overrides)
    raw = _merge_sweep_overrides(raw, sweep_over)
    problems: list[str] = []

    for k in raw:
        if k not in SWEEP_FIELDS:
            problems.append(f"{k}: unknown sweep field; {_closest(str(k), list(SWEEP_FIELDS)) or 'allowed: ' + ', '.join(SWEEP_FIELDS)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip() or any(c in name for c in "/\\ "):
        problems.append(f"name: got {name!r}; allowed: a non-empty string without spaces or slashes (study, experiment and reports/<name>)")
        name = "sweep"
    if raw.get("kind", "sweep") != "sweep":
        problems.append(f"kind: got {raw.get('kind')!r}; allowed: 'sweep' (train/world files are ablations: python -m harness.ablate)")

    # train config: base file + set + --set + steps
    base_data: dict[str, Any] = {}
    if raw.get("base") is not None:
        if not isinstance(raw["base"], str):
            problems.append(f"base: got {raw['base']!r}; allowed: a path to a train config YAML, relative to the sweep file")
        else:
            try:
                base_data = read_yaml(here / raw["base"])
            except ConfigError as e:
                problems += [f"base: {p}" for p in e.problems]
    set_over = raw.get("set") or {}
    if not isinstance(set_over, dict):
        problems.append(f"set: got {set_over!r}; allowed: a mapping of config keys to values")
        set_over = {}
    steps = raw.get("steps")
    step_over: dict[str, Any] = {}
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            problems.append(f"steps: got {steps!r}; allowed: an integer >= 1 (sets ppo.steps)")
        else:
            step_over = {"ppo.steps": steps}
    uri_over = {"logging.tracking_uri": tracking_uri} if tracking_uri else {}
    # precedence: base file < set < steps < --set < --tracking-uri
    config_data = merge(merge(merge(merge(base_data, set_over), step_over), train_over), uri_over)
    config_data = merge(config_data, {"logging.experiment": name})
    try:
        cfg = from_dict(config_data)
    except ConfigError as e:
        problems += [f"train config: {p}" for p in e.problems]
        cfg = None

    # search space
    dims: list[Dimension] = []
    space = raw.get("search_space")
    if not isinstance(space, dict) or not space:
        problems.append(f"search_space: got {space!r}; allowed: a mapping of config keys to ranges, e.g. {{reward.clip: {{low: 0.1, high: 10, log: true}}}}")
    elif cfg is not None:
        for key, spec in space.items():
            d = _parse_dimension(str(key), spec, config_data, problems)
            if d is not None:
                dims.append(d)

    # objective
    obj_raw = raw.get("objective") or {}
    objective = ObjectiveSpec()
    if not isinstance(obj_raw, dict):
        problems.append(f"objective: got {obj_raw!r}; allowed: a mapping with {', '.join(OBJECTIVE_FIELDS)}")
        obj_raw = {}
    for k in obj_raw:
        if k not in OBJECTIVE_FIELDS:
            problems.append(f"objective.{k}: unknown; {_closest(str(k), list(OBJECTIVE_FIELDS)) or 'allowed: ' + ', '.join(OBJECTIVE_FIELDS)}")
    metric = obj_raw.get("metric", "auto")
    source = cfg.data.source if cfg is not None else "world"
    has_gold = source == "world"
    if metric == "auto":
        metric = keys.GOLD_SCORE if has_gold else keys.RM_SCORE
    elif metric not in _known_metrics():
        problems.append(f"objective.metric: got {metric!r}; allowed: auto or a metric key from harness/keys.py; {_closest(str(metric), _known_metrics())}".rstrip("; "))
    elif not has_gold and metric in (keys.GOLD_SCORE, keys.GOLD_SCORE_STD, keys.EVAL_GOLD, keys.EVAL_WIN_RATE):
        problems.append(f"objective.metric: got {metric!r} with data.source={source}; allowed: a metric the source logs (gold needs the embedded world), e.g. {keys.RM_SCORE}")
    objective.metric = metric
    last_steps = obj_raw.get("last_steps", 10)
    if isinstance(last_steps, bool) or not isinstance(last_steps, int) or last_steps < 1:
        problems.append(f"objective.last_steps: got {last_steps!r}; allowed: an integer >= 1")
    else:
        objective.last_steps = last_steps
    collapsed = obj_raw.get("collapsed", "penalty")
    if collapsed not in ("penalty", "worst", "ignore"):
        problems.append(f"objective.collapsed: got {collapsed!r}; allowed: one of 'penalty', 'worst', 'ignore'")
    else:
        objective.collapsed = collapsed
    penalty = obj_raw.get("collapse_penalty", 1.0)
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty) or penalty < 0:
        problems.append(f"objective.collapse_penalty: got {penalty!r}; allowed: a number >= 0 (metric units)")
    else:
        objective.collapse_penalty = float(penalty)

    direction = raw.get("direction", "maximize")
    if direction not in ("maximize", "minimize"):
        problems.append(f"direction: got {direction!r}; allowed: 'maximize' or 'minimize'")
        direction = "maximize"

    # seeds
    seeds_raw = raw.get("seeds", 1)
    base_seed = cfg.seed if cfg is not None else 0
    if isinstance(seeds_raw, int) and not isinstance(seeds_raw, bool) and seeds_raw >= 1:
        seeds = [base_seed + i for i in range(seeds_raw)]
    elif isinstance(seeds_raw, list) and seeds_raw and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds_raw) and len(set(seeds_raw)) == len(seeds_raw):
        seeds = list(seeds_raw)
    else:
        problems.append(f"seeds: got {seeds_raw!r}; allowed: a count >= 1 or a list of distinct integers")
        seeds = [base_seed]

    sampler = _parse_choice_section(raw.get("sampler"), "sampler", SAMPLERS, "tpe", {
        "tpe": {"seed": (int, type(None)), "n_startup_trials": int, "multivariate": bool},
        "random": {"seed": (int, type(None))},
        "grid": {"seed": (int, type(None))},
    }, problems)
    pruner = _parse_choice_section(raw.get("pruner"), "pruner", PRUNERS, "median", {
        "median": {"n_startup_trials": int, "n_warmup_steps": int, "interval_steps": int},
        "threshold": {"lower": (int, float, type(None)), "upper": (int, float, type(None)), "n_warmup_steps": int, "interval_steps": int},
        "none": {},
    }, problems)
    if pruner.get("name") == "threshold" and pruner.get("lower") is None and pruner.get("upper") is None:
        problems.append("pruner: threshold needs `lower` or `upper` (a trial is pruned when its running objective leaves [lower, upper])")

    # trials
    n_steps = cfg.ppo.steps if cfg is not None else 0
    trials_raw = trials if trials is not None else raw.get("trials")
    grid_size = math.prod(len(d.grid or []) for d in dims) if dims else 0
    if trials_raw is None:
        trials_raw = grid_size if sampler.get("name") == "grid" and dims else 16
    if isinstance(trials_raw, bool) or not isinstance(trials_raw, int) or trials_raw < 1:
        problems.append(f"trials: got {trials_raw!r}; allowed: an integer >= 1 (total trials in the study)")
        trials_raw = 1
    elif sampler.get("name") == "grid" and dims and trials_raw > grid_size:
        problems.append(f"trials: got {trials_raw} with sampler grid; allowed: at most the grid size {grid_size} ({' x '.join(str(len(d.grid or [])) for d in dims)} values)")
    if cfg is not None and n_steps < 1:
        problems.append("ppo.steps: got 0; allowed: an integer >= 1 for a sweep (set `steps:`)")
    if check_data and cfg is not None and cfg.data.source == "world" and not Path(cfg.data.world_dir).exists():
        problems.append(f"data.world_dir: {cfg.data.world_dir!r} holds no built world; build it with "
                        f"`python -m harness.world build --out {cfg.data.world_dir}` or --set data.world_dir=...")
    if check_data and cfg is not None and cfg.data.source == "hh_rlhf" and cfg.data.hh_path and not Path(cfg.data.hh_path).exists():
        problems.append(f"data.hh_path: {cfg.data.hh_path!r} not found")

    first_trials = _parse_first_trials(raw.get("first_trials"), dims, sampler.get("name"), problems) if dims or not space else []

    plots = raw.get("plots") or {}
    pair: list[str] = []
    if not isinstance(plots, dict):
        problems.append(f"plots: got {plots!r}; allowed: {{pair: [key1, key2]}}")
    else:
        for k in plots:
            if k != "pair":
                problems.append(f"plots.{k}: unknown; allowed: pair")
        pair = plots.get("pair") or []
        if pair and isinstance(space, dict) and len(dims) == len(space) and (not isinstance(pair, list) or len(pair) != 2 or any(p not in [d.key for d in dims] for p in pair)):
            problems.append(f"plots.pair: got {pair!r}; allowed: two numeric search-space keys from {[d.key for d in dims if d.numeric]}")
            pair = []
    if not pair:
        pair = [d.key for d in dims if d.numeric][:2]

    title = raw.get("title", "")
    if problems:
        raise SweepError(problems, src)
    return SweepSpec(
        name=name, path=path, base_config=config_data, search_space=dims, objective=objective,
        direction=direction, trials=trials_raw, seeds=seeds, steps=n_steps, sampler=sampler,
        pruner=pruner, plot_pair=pair, first_trials=first_trials, title=str(title or ""), raw=raw,
    )


def _parse_first_trials(value: Any, dims: list[Dimension], sampler: str | None, problems: list[str]) -> list[dict[str, Any]]:
    """`first_trials: [{key: value, ...}, ...]`, each value inside its search-space axis."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(p, dict) and p for p in value):
        problems.append(f"first_trials: got {value!r}; allowed: a list of mappings {{search-space key: value}}")
        return []
    by_key = {d.key: d for d in dims}
    out = []
    for i, point in enumerate(value):
        where = f"first_trials[{i}]"
        for k, v in point.items():
            d = by_key.get(k)
            if d is None:
                problems.append(f"{where}.{k}: not a search-space key; allowed: {', '.join(by_key)}")
            elif sampler == "grid" and v not in (d.grid or []):
                problems.append(f"{where}.{k}: got {v!r}; allowed with sampler grid: a grid value of {d.grid}")
            elif d.kind == "categorical":
                if v not in (d.choices or []) or type(v) is not type(d.choices[d.choices.index(v)]):
                    problems.append(f"{where}.{k}: got {v!r}; allowed: one of {d.choices}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not d.low <= v <= d.high or (d.kind == "int" and not float(v).is_integer()):
                problems.append(f"{where}.{k}: got {v!r}; allowed: {'an integer' if d.kind == 'int' else 'a number'} in [{d.low:g}, {d.high:g}]")
        out.append(dict(point))
    return out


def _parse_choice_section(value: Any, label: str, names: tuple[str, ...], default: str,
                          options: dict[str, dict[str, Any]], problems: list[str]) -> dict[str, Any]:
    """`sampler: tpe` or `sampler: {name: tpe, seed: 0}` -> {'name': 'tpe', 'seed': 0}."""
    if value is None:
        value = {"name": default}
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict):
        problems.append(f"{label}: got {value!r}; allowed: one of {', '.join(names)} or a mapping with `name`")
        return {"name": default}
    name = value.get("name", default)
    if name not in names:
        close = difflib.get_close_matches(str(name), names, n=1)
        problems.append(f"{label}.name: got {name!r}; allowed: one of {', '.join(names)}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return {"name": default}
    allowed = options[name]
    for k, v in value.items():
        if k == "name":
            continue
        if k not in allowed:
            if any(k in opts for opts in options.values()):
                continue  # an option of another choice (e.g. left over after --set sweep.pruner.name=none)
            everything = sorted({o for opts in options.values() for o in opts})
            problems.append(f"{label}.{k}: not an option of {label} {name}; allowed: {', '.join(allowed) or 'none'}"
                            + (f" ({_closest(str(k), everything)})" if _closest(str(k), everything) else ""))
            continue
        types_ = allowed[k] if isinstance(allowed[k], tuple) else (allowed[k],)
        ok = isinstance(v, types_) and not (isinstance(v, bool) and bool not in types_)
        if ok and isinstance(v, int) and not isinstance(v, bool) and v < 0:
            ok = k in ("lower", "upper")
        if not ok:
            problems.append(f"{label}.{k}: got {v!r}; allowed: {' or '.join('null' if t is type(None) else t.__name__ for t in types_)}" + ("" if k in ("lower", "upper") else " >= 0"))
    return dict(value, name=name)


# ----------------------------------------------------------------------------------------------
# Storage, sampler, pruner
# ----------------------------------------------------------------------------------------------
def default_storage_url(tracking_uri: str) -> str:
    """optuna.db next to the MLflow sqlite file; sqlite:///optuna.db for other tracking URIs."""
    if tracking_uri.startswith("sqlite:///"):
        db = tracking_uri[len("sqlite:///"):]
        parent = os.path.dirname(db)
        return "sqlite:///" + (os.path.join(parent, "optuna.db") if parent else "optuna.db")
    return "sqlite:///optuna.db"


def display_url(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def make_storage(url: str):
    """RDBStorage with a generous sqlite lock timeout and heartbeats for killed workers."""
    import optuna

    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
        engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    elif url.startswith("sqlite"):
        engine_kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(
            url, engine_kwargs=engine_kwargs,
            heartbeat_interval=HEARTBEAT_INTERVAL_S, grace_period=HEARTBEAT_GRACE_S,
        )


def make_sampler(spec: SweepSpec, seed_offset: int = 0):
    """The sweep's sampler; `seed_offset` keeps workers and continued runs from repeating draws."""
    import optuna

    s = spec.sampler
    seed = s.get("seed", 0)
    seed = None if seed is None else seed + seed_offset
    if s["name"] == "grid":
        return optuna.samplers.GridSampler({d.key: d.grid for d in spec.search_space}, seed=seed)
    if s["name"] == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=s.get("n_startup_trials", 5),
            multivariate=s.get("multivariate", True), constant_liar=True,
        )


def make_pruner(spec: SweepSpec):
    import optuna

    p = spec.pruner
    if p["name"] == "none":
        return optuna.pruners.NopPruner()
    if p["name"] == "threshold":
        return optuna.pruners.ThresholdPruner(
            lower=p.get("lower"), upper=p.get("upper"),
            n_warmup_steps=p.get("n_warmup_steps", 0), interval_steps=p.get("interval_steps", 1),
        )
    return optuna.pruners.MedianPruner(
        n_startup_trials=p.get("n_startup_trials", 4),
        n_warmup_steps=p.get("n_warmup_steps", max(1, spec.steps // 5)),
        interval_steps=p.get("interval_steps", 1),
    )


def open_study(spec: SweepSpec, storage_url: str, seed_offset: int = 0):
    """Create the study or load it to continue (same name = sweep name)."""
    import optuna

    study = optuna.create_study(
        storage=make_storage(storage_url), study_name=spec.name, direction=spec.direction,
        load_if_exists=True, sampler=make_sampler(spec, seed_offset), pruner=make_pruner(spec),
    )
    stored = study.direction.name.lower()
    if stored != spec.direction:
        raise SweepError([f"direction: got {spec.direction!r} but study {spec.name!r} in {display_url(storage_url)} was created with {stored!r}; allowed: {stored!r} (or a new sweep name)"])
    return study


def trial_counts(study) -> dict[str, int]:
    """How many trials count toward the total (see module doc), and how many are running."""
    from optuna.trial import TrialState

    counts = {"counted": 0, "running": 0, "interrupted": 0}
    for t in study.get_trials(deepcopy=False):
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            counts["counted"] += 1
        elif t.state == TrialState.FAIL:
            counts["counted" if ATTR_OUTCOME in t.user_attrs else "interrupted"] += 1
        elif t.state == TrialState.RUNNING:
            counts["running"] += 1
    return counts


# ----------------------------------------------------------------------------------------------
# One trial
# ----------------------------------------------------------------------------------------------
def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


class IntermediateReporter:
    """The trainer's on_step callback: report the running objective, return should_prune()."""

    def __init__(self, trial: Any, metric: str, window: int, step_offset: int):
        self.trial = trial
        self.metric = metric
        self.window = window
        self.step_offset = step_offset
        self.values: list[float] = []
        self.last_reported: float | None = None
        self.pruned_at: int | None = None

    def __call__(self, step: int, metrics: dict[str, float]) -> bool:
        value = metrics.get(self.metric)
        if value is None or not math.isfinite(float(value)):
            return False
        self.values.append(float(value))
        running = _mean(self.values[-self.window:])
        self.last_reported = running
        self.trial.report(running, self.step_offset + step)
        if self.trial.should_prune():
            self.pruned_at = step
            return True
        return False


def score_run(history: list[tuple[int, float]], objective: ObjectiveSpec, direction: str,
              collapse_step: int | None) -> tuple[float, float]:
    """(score, raw) of one run from its metric history; raw ignores the collapse rule."""
    history = sorted((s, v) for s, v in history if math.isfinite(v))
    if not history:
        raise TrialFailed(f"{objective.metric} was never logged (finite) in this run")
    raw = _mean([v for _, v in history[-objective.last_steps:]])
    if collapse_step is None or objective.collapsed == "ignore":
        return raw, raw
    upto = [v for s, v in history if s <= collapse_step] or [history[0][1]]
    at_collapse = _mean(upto[-objective.last_steps:])
    worse = -1.0 if direction == "maximize" else 1.0
    return at_collapse + worse * objective.collapse_penalty, raw


class TrialObjective:
    """Runs one trial: every seed trained with the sampled values, scored, recorded everywhere."""

    def __init__(self, spec: SweepSpec, parent_run_id: str | None, tracking_uri: str,
                 threads: int | None = None, worker: int = 0, progress: bool | None = None,
                 log=print):
        self.spec = spec
        self.parent_run_id = parent_run_id
        self.tracking_uri = tracking_uri
        self.threads = threads
        self.worker = worker
        self.progress = progress
        self.log = log

    def trial_config(self, params: dict[str, Any], seed: int, number: int) -> TrainConfig:
        base = self.spec.base_config
        tags = dict((base.get("logging") or {}).get("tags") or {})
        tags.update({
            TAG_SWEEP: self.spec.name, TAG_TRIAL: str(number), keys.TAG_SEED: str(seed),
        })
        over: dict[str, Any] = dict(params)
        over.update({
            "seed": seed,
            "logging.tracking_uri": self.tracking_uri,
            "logging.experiment": self.spec.name,
            "logging.run_name": f"{self.spec.name}-t{number:04d}-s{seed}",
            "logging.parent_run_id": self.parent_run_id,
            "logging.tags": tags,
        })
        if self.threads:
            over["threads"] = self.threads
        if self.progress is not None:
            over["logging.progress"] = self.progress
        return from_dict(merge(base, over))

    def __call__(self, trial: Any) -> float:
        import optuna
        from harness import tracking
        from harness.train import train  # lazy: torch is only needed inside a trial

        spec, obj = self.spec, self.spec.objective
        t0 = time.time()
        params = {d.key: d.suggest(trial) for d in spec.search_space}
        trial.set_user_attr("worker", self.worker)
        trial.set_user_attr("objective_metric", obj.metric)
        run_ids: list[str] = []
        scores: list[float] = []
        raws: list[float] = []
        collapse_steps: dict[str, int | None] = {}

        def finish_runs(state: str, outcome: str, extra_tags: dict[str, str] | None = None) -> None:
            for rid in run_ids:
                try:
                    tracking.set_tags(self.tracking_uri, rid, {TAG_TRIAL_STATE: state, TAG_TRIAL_OUTCOME: outcome, **(extra_tags or {})})
                except Exception as e:  # MLflow trouble must not lose the Optuna record
                    self.log(f"  warning: could not tag MLflow run {rid}: {e}")
            trial.set_user_attr("mlflow_run_ids", run_ids)
            trial.set_user_attr(ATTR_OUTCOME, outcome)
            trial.set_user_attr("duration_s", round(time.time() - t0, 2))

        def say(text: str) -> None:
            shown = ", ".join(f"{k}={_fmt(v)}" for k, v in params.items())
            self.log(f"[sweep {spec.name}] trial {trial.number} (worker {self.worker}) {shown}: {text} [{time.time() - t0:.1f}s]")

        try:
            for i, seed in enumerate(spec.seeds):
                try:
                    cfg = self.trial_config(params, seed, trial.number)
                except ConfigError as e:
                    raise TrialFailed(f"config with the sampled values is invalid: {e}") from None
                reporter = IntermediateReporter(trial, obj.metric, obj.last_steps, i * spec.steps)
                result = train(cfg, on_step=reporter)
                if result.run_id:
                    run_ids.append(result.run_id)
                    tracking.log_params(self.tracking_uri, result.run_id, {f"{TRIAL_PARAM_PREFIX}{k}": v for k, v in params.items()})
                if result.status == "FAILED":
                    reason = result.error or "training run ended FAILED"
                    trial.set_user_attr("failure_reason", str(reason)[:2000])
                    trial.set_user_attr("failed_seed", seed)
                    raise TrialFailed(str(reason))
                if reporter.pruned_at is not None:
                    trial.set_user_attr("pruned_at_step", reporter.pruned_at)
                    trial.set_user_attr("pruned_seed", seed)
                    finish_runs("PRUNED", "pruned")
                    say(f"pruned at step {reporter.pruned_at} of seed {seed} (running {obj.metric} {_fmt(reporter.last_reported)})")
                    raise optuna.TrialPruned(f"running objective {reporter.last_reported} at step {reporter.pruned_at}")
                collapse_step = result.collapse_step if result.collapsed else None
                if result.collapsed and collapse_step is None:
                    collapse_step = result.steps_done
                history = tracking.metric_history(self.tracking_uri, result.run_id, obj.metric) if result.run_id else []
                if not history:  # fall back to what on_step saw
                    history = list(enumerate(reporter.values, start=1))
                score, raw = score_run(history, obj, spec.direction, collapse_step)
                if result.collapsed and obj.collapsed == "worst":
                    score = self._worst_so_far(trial, score)
                collapse_steps[str(seed)] = collapse_step
                scores.append(score)
                raws.append(raw)
                if result.run_id:
                    tracking.MetricLogger(self.tracking_uri, result.run_id).log({METRIC_OBJECTIVE: score}, step=result.steps_done)
        except optuna.TrialPruned:
            raise
        except TrialFailed as e:
            trial.set_user_attr("failure_reason", str(e)[:2000])
            finish_runs("FAIL", "failed", {keys.TAG_FAILURE: str(e)[:500]})
            say(f"FAILED: {str(e)[:200]}")
            raise
        except Exception as e:  # a bug or an infrastructure error: record it, let the study go on
            trial.set_user_attr("failure_reason", f"{type(e).__name__}: {e}"[:2000])
            finish_runs("FAIL", "error")
            say(f"ERROR {type(e).__name__}: {str(e)[:200]}\n{traceback.format_exc()}")
            raise

        value = _mean(scores)
        collapsed_seeds = [int(s) for s, c in collapse_steps.items() if c is not None]
        trial.set_user_attr("seed_scores", scores)
        trial.set_user_attr("seed_raw_scores", raws)
        trial.set_user_attr("collapsed", bool(collapsed_seeds))
        trial.set_user_attr("collapsed_seeds", collapsed_seeds)
        trial.set_user_attr("collapse_steps", collapse_steps)
        outcome = "collapsed" if collapsed_seeds else "complete"
        finish_runs("COMPLETE", outcome)
        say(f"{obj.metric}={_fmt(value)}" + (f" (collapsed seeds {collapsed_seeds}, raw {_fmt(_mean(raws))})" if collapsed_seeds else ""))
        return value

    def _worst_so_far(self, trial: Any, fallback: float) -> float:
        from optuna.trial import TrialState

        values = [t.value for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
        if not values:
            return fallback
        worst = min(values) if self.spec.direction == "maximize" else max(values)
        return min(worst, fallback) if self.spec.direction == "maximize" else max(worst, fallback)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ----------------------------------------------------------------------------------------------
# Running a study
# ----------------------------------------------------------------------------------------------
def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run_trials(spec: SweepSpec, storage_url: str, tracking_uri: str, parent_run_id: str | None,
               slots: Any, worker: int, seed_offset: int, threads: int | None,
               progress: bool | None) -> int:
    """A worker's loop: claim a slot from the shared counter, run one trial, repeat. Returns trials run."""
    import optuna

    # Every trial's outcome is printed by TrialObjective (with a traceback for real errors);
    # Optuna's own warning + traceback for each FAIL trial would only repeat it.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = open_study(spec, storage_url, seed_offset=seed_offset + worker)
    objective = TrialObjective(spec, parent_run_id, tracking_uri, threads=threads, worker=worker, progress=progress)
    from optuna.storages._heartbeat import get_heartbeat_thread
    from optuna.trial import TrialState

    done = 0
    while True:
        with slots.get_lock():
            if slots.value <= 0:
                break
            slots.value -= 1
            counts = trial_counts(study)  # other machines sharing the storage
            if counts["counted"] + counts["running"] >= spec.trials:
                print(f"[sweep {spec.name}] worker {worker}: study already holds {counts['counted']} finished + {counts['running']} running trials of {spec.trials}; stopping")
                break
            # Ask under the workers' lock: Optuna pops an enqueued (WAITING) trial with SELECT ... FOR
            # UPDATE, which sqlite ignores, so two workers could otherwise both run the same first trial.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Heartbeat of storage")  # we beat below
                trial = study.ask()
        try:
            try:
                # the heartbeat Study.optimize would keep: a killed worker's trial is failed as stale later
                with get_heartbeat_thread(trial._trial_id, study._storage):
                    value = objective(trial)
            except optuna.TrialPruned:
                study.tell(trial, state=TrialState.PRUNED)
            except Exception:  # recorded (and printed) by the objective; the study goes on
                study.tell(trial, state=TrialState.FAIL)
            else:
                if value is None or not math.isfinite(value):
                    study.tell(trial, state=TrialState.FAIL)
                else:
                    study.tell(trial, value)
        except optuna.exceptions.UpdateFinishedTrialError as e:  # failed as stale by another process
            print(f"[sweep {spec.name}] worker {worker}: {e}")
        done += 1
    return done


def _worker_main(spec: SweepSpec, storage_url: str, tracking_uri: str, parent_run_id: str | None,
                 slots: Any, worker: int, seed_offset: int, threads: int | None) -> None:
    """Entry point of a spawned worker process."""
    if threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(threads)
    try:
        run_trials(spec, storage_url, tracking_uri, parent_run_id, slots, worker, seed_offset, threads, progress=False)
    except KeyboardInterrupt:
        sys.exit(130)


def _parent_run(spec: SweepSpec, study: Any, tracking_uri: str, storage_url: str) -> str:
    """The study's MLflow parent run in this tracking store (reopened when continuing)."""
    from harness import tracking

    runs = dict(study.user_attrs.get(ATTR_PARENT_RUNS) or {})
    run_id = runs.get(tracking_uri)
    if run_id:
        try:
            tracking.reopen_run(tracking_uri, run_id)
            return run_id
        except Exception:
            run_id = None
    run_id = tracking.start_run(
        tracking_uri, spec.name, run_name=f"sweep {spec.name}",
        tags={
            keys.TAG_ROLE: "parent", TAG_SWEEP: spec.name, TAG_STUDY: spec.name,
            TAG_STORAGE: display_url(storage_url), keys.TAG_COMMIT: tracking.git_commit(),
            TAG_SWEEP_FILE: str(spec.path) if spec.path else "",
        },
    )
    tracking.log_params(tracking_uri, run_id, {
        "sweep.direction": spec.direction, "sweep.objective": spec.objective.metric,
        "sweep.last_steps": spec.objective.last_steps, "sweep.collapsed": spec.objective.collapsed,
        "sweep.collapse_penalty": spec.objective.collapse_penalty,
        "sweep.search_space": spec.search_space_json(), "sweep.sampler": spec.sampler,
        "sweep.pruner": spec.pruner, "sweep.seeds": spec.seeds, "sweep.steps": spec.steps,
    })
    from harness.config import to_yaml

    tracking.log_text_artifact(tracking_uri, run_id, to_yaml(spec.train_config()), keys.ARTIFACT_CONFIG)
    if spec.path:
        tracking.log_text_artifact(tracking_uri, run_id, Path(spec.path).read_text(), "sweep.yaml")
    runs[tracking_uri] = run_id
    study.set_user_attr(ATTR_PARENT_RUNS, runs)
    return run_id


def run_sweep(spec: SweepSpec, *, workers: int = 1, storage_url: str | None = None,
              tracking_uri: str | None = None, reports_dir: str | Path = "reports",
              threads: int | None = None, summarize: bool = True) -> dict[str, Any]:
    """Run the study up to spec.trials total trials; returns sweep_summary()'s dict (+ counts).

    Torch threads per trial: `threads`, else the config's `threads` when set, else (with several
    workers) the CPU count split evenly between the workers."""
    import optuna
    from harness import tracking

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if workers < 1:
        raise SweepError([f"--workers: got {workers}; allowed: an integer >= 1"], "arguments")
    tracking_uri = tracking_uri or spec.train_config().logging.tracking_uri
    storage_url = storage_url or default_storage_url(tracking_uri)
    study = open_study(spec, storage_url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    space = spec.search_space_json()
    stored_space = study.user_attrs.get("search_space")
    if stored_space is None:
        if not study.get_trials(deepcopy=False):
            for point in spec.first_trials:
                study.enqueue_trial(point, skip_if_exists=True)
        study.set_user_attr("search_space", space)
        study.set_user_attr("objective_metric", spec.objective.metric)
        study.set_user_attr("sweep_file", str(spec.path) if spec.path else "")
    elif json.loads(json.dumps(stored_space)) != json.loads(json.dumps(space)):
        print(f"[sweep {spec.name}] warning: the search space differs from the one this study was started with; continuing the same study")
    counts = trial_counts(study)
    remaining = spec.trials - counts["counted"] - counts["running"]
    print(f"[sweep {spec.name}] study {spec.name!r} in {display_url(storage_url)}: "
          f"{counts['counted']} finished, {counts['running']} running, {counts['interrupted']} interrupted; "
          f"target {spec.trials} total -> running {max(0, remaining)} now with {workers} worker(s)")
    parent_run_id = _parent_run(spec, study, tracking_uri, storage_url)
    seed_offset = 1009 * len(study.get_trials(deepcopy=False))
    cfg_threads = threads or spec.train_config().threads
    status = "FINISHED"
    worker_errors: list[str] = []
    try:
        if remaining > 0:
            if workers == 1:
                slots = mp.get_context("spawn").Value("i", remaining)
                run_trials(spec, storage_url, tracking_uri, parent_run_id, slots, 0, seed_offset,
                           threads=cfg_threads or None, progress=None)
            else:
                threads = cfg_threads or max(1, _cpu_count() // workers)
                ctx = mp.get_context("spawn")
                slots = ctx.Value("i", remaining)
                procs = [
                    ctx.Process(target=_worker_main, name=f"sweep-worker-{w}",
                                args=(spec, storage_url, tracking_uri, parent_run_id, slots, w, seed_offset, threads))
                    for w in range(min(workers, remaining))
                ]
                for p in procs:
                    p.start()
                for p in procs:
                    p.join()
                worker_errors = [f"{p.name} exit code {p.exitcode}" for p in procs if p.exitcode != 0]
                if worker_errors:
                    print(f"[sweep {spec.name}] warning: {', '.join(worker_errors)}; rerun the same command to make up missing trials")
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        study = open_study(spec, storage_url)
        counts = trial_counts(study)
        summary: dict[str, Any] = {"counts": counts, "parent_run_id": parent_run_id, "worker_errors": worker_errors,
                                   "storage_url": storage_url, "tracking_uri": tracking_uri}
        if status == "FINISHED" and summarize:
            summary.update(_summarize(spec, study, storage_url, tracking_uri, parent_run_id, reports_dir))
        tracking.end_run(tracking_uri, parent_run_id, status=status)
    return summary


def _summarize(spec: SweepSpec, study: Any, storage_url: str, tracking_uri: str,
               parent_run_id: str, reports_dir: str | Path) -> dict[str, Any]:
    from analysis.sweep_plots import summary_for_study
    from harness import tracking

    out_dir = Path(reports_dir) / spec.name
    summary = summary_for_study(spec, study, tracking_uri, out_dir)
    summary["parent_run_id"] = parent_run_id
    files = list(summary["figures"]) + [p for p in (summary.get("table_csv"), summary.get("best_json")) if p]
    try:
        tracking.log_file_artifacts(tracking_uri, parent_run_id, files, artifact_path="sweep")
        best = summary["best"]
        metrics = {f"sweep/n_{k}": v for k, v in summary["n_by_outcome"].items()}
        if best:
            metrics[METRIC_OBJECTIVE] = best["value"]
        tracking.MetricLogger(tracking_uri, parent_run_id).log(metrics, step=len(study.trials))
        if best:
            tracking.set_tags(tracking_uri, parent_run_id, {"harness.best_trial": str(best["number"]), "harness.best_params": json.dumps(best["params"])[:5000]})
    except Exception as e:
        print(f"[sweep {spec.name}] warning: could not log the summary to MLflow: {e}")
    return summary


def print_summary(spec: SweepSpec, summary: dict[str, Any]) -> None:
    import pandas as pd

    if "table" not in summary:  # --no-summary
        c = summary.get("counts", {})
        print(f"[sweep {spec.name}] study holds {c.get('counted', 0)} finished trials ({c.get('running', 0)} running elsewhere); "
              f"draw the summary with: python -m harness.sweep {spec.path or '<file>'} --summary")
        return
    print(f"\n== sweep {spec.name}: {spec.objective.metric} ({spec.direction}) ==")
    table = summary.get("table")
    if isinstance(table, pd.DataFrame) and len(table):
        cols = [c for c in ["number", "state", "outcome", "value", *spec.keys, "collapse_step", "pruned_at_step", "duration_s", "failure_reason"] if c in table.columns]
        with pd.option_context("display.width", 200, "display.max_columns", 30, "display.max_rows", 200):
            print(table[cols].to_string(index=False))
    best = summary.get("best") or {}
    if best:
        print(f"\nbest trial {best['number']}: {spec.objective.metric} = {best['value']:.6g}" + (" (collapsed)" if best.get("collapsed") else ""))
        for k, v in best["params"].items():
            print(f"  {k} = {_fmt(v)}")
    else:
        print("\nno completed trial yet")
    imp = summary.get("importances") or {}
    if imp:
        print("\nparameter importances: " + ", ".join(f"{k} {v:.2f}" for k, v in imp.items()))
    for note in summary.get("notes", []):
        print(f"note: {note}")
    if summary.get("figures"):
        print("\nfigures:\n  " + "\n  ".join(str(f) for f in summary["figures"]))
    print(f"\nMLflow parent run {summary.get('parent_run_id')} in {summary.get('tracking_uri')}; "
          f"optuna-dashboard {display_url(summary.get('storage_url', ''))}")


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        prog="python -m harness.sweep",
        description="Optuna hyperparameter sweep over TrainConfig keys; every trial is an MLflow child run.",
        epilog=doc[doc.index("Sweep file"):],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", help="sweep YAML, e.g. ablations/sweep_delta_eta.yaml")
    p.add_argument("--trials", type=int, default=None, help="TOTAL trials the study should hold (overrides `trials:`); rerun with a larger N to continue the same study")
    p.add_argument("--workers", type=int, default=1, help="parallel worker processes sharing the storage (torch threads split between them)")
    p.add_argument("--storage", default=None, help="Optuna RDB URL (default: optuna.db next to the MLflow sqlite store), e.g. postgresql://user:pw@host/db")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the train config's logging.tracking_uri)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per trial (default: the config's `threads`, else CPUs split between workers)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="train-config override for every trial (ppo.steps=50), or sweep.<field>=v for the sweep file (sweep.seeds=2, sweep.pruner.name=none); repeatable")
    p.add_argument("--reports-dir", default="reports", help="figures and tables go to REPORTS_DIR/<name>/ (default: reports)")
    p.add_argument("--validate", action="store_true", help="only validate the sweep file and print the resolved search space")
    p.add_argument("--summary", action="store_true", help="run no trials; redraw the summary of the stored study")
    p.add_argument("--no-summary", action="store_true", help="skip the plots/tables at the end (e.g. on the extra machines of a shared study)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = load_sweep(args.file, args.overrides, trials=args.trials, tracking_uri=args.tracking_uri)
        if args.workers < 1:
            raise SweepError([f"--workers: got {args.workers}; allowed: an integer >= 1"], "arguments")
        if args.threads is not None and args.threads < 1:
            raise SweepError([f"--threads: got {args.threads}; allowed: an integer >= 1"], "arguments")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.validate:
        print(f"sweep {spec.name}: {spec.trials} trials x {len(spec.seeds)} seed(s) x {spec.steps} steps, "
              f"objective {spec.objective.metric} ({spec.direction}), sampler {spec.sampler}, pruner {spec.pruner}")
        for d in spec.search_space:
            print(f"  {d.key}: {json.dumps(d.to_json())}")
        return 0
    tracking_uri = args.tracking_uri or spec.train_config().logging.tracking_uri
    if args.summary:
        from analysis.sweep_plots import sweep_summary

        summary = sweep_summary(args.file, tracking_uri, args.storage, out_dir=Path(args.reports_dir) / spec.name, overrides=args.overrides)
        summary.update(storage_url=args.storage or default_storage_url(tracking_uri), tracking_uri=tracking_uri)
        print_summary(spec, summary)
        return 0
    try:
        summary = run_sweep(spec, workers=args.workers, storage_url=args.storage, threads=args.threads,
                            tracking_uri=tracking_uri, reports_dir=args.reports_dir,
                            summarize=not args.no_summary)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; rerun the same command to continue the study", file=sys.stderr)
        return 130
    print_summary(spec, summary)
    # Failed, pruned and collapsed trials are results (exit 0); a crashed worker process is not.
    return 1 if summary.get("worker_errors") else 0


if __name__ == "__main__":
    sys.exit(main())
