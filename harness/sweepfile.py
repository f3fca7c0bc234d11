"""The sweep file (harness.sweep, analysis.sweep_plots, analysis.tricks): its format (SweepFile and its
sections, from which `python -m harness.sweep --help` is written), its validation against TrainConfig
(`load_sweep` -> SweepSpec, every problem named with file, field, value and what is allowed), each trial's
config (`trial_config`), and the design engine that draws trials (`make_sampler`: TrialSeeded, Sobol; the
design made ahead of time and checked). No runner: reading a study back needs this, never harness.sweep."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, get_args, get_origin

import numpy as np
import optuna
from pydantic import Field, model_validator

from harness import config, design, keys, schema, tracking
from harness.config import TrainConfig, from_dict, merge
from harness.registry import resolve_file, world_dirs, world_problems
from harness.schema import Bool, ConfigError, Count, Float, Int, NonNeg, Pos, PosCount, Seed, section
from harness.summary import REDUCTIONS

# Keys that say where a run is logged, or that the sweep sets itself, are not searched.
NOT_SEARCHABLE = (*config.BOOKKEEPING, "seed", "distributed.", "ppo.steps")
Scalar = bool | int | float | str | None


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
    added: list[str] = dataclasses.field(default_factory=list)
    """sobol: choices added to the search space after the study's first design ran, drawn from a second
    scrambled Sobol sequence (seed + 1) of their own, so the other choices keep the points they had: trial i
    draws the first design's values for them whatever is added (harness.design.Sobol)."""
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


def build_config(data: dict[str, Any]) -> tuple[TrainConfig | None, list[str]]:
    """TrainConfig from data, or the problems config validation found."""
    try:
        return from_dict(data), []
    except ConfigError as e:
        return None, list(e.problems)


def _resolve(key: str, dim: Dimension, tp: Any, base: dict[str, Any],
             drawn: list[dict[str, Any]] | None = None) -> tuple[Dimension | None, list[str]]:
    """The axis with type, choices and grid filled in, each bound checked as a value of the field where it is
    drawn (`drawn`: the base with its parents' values, `when_contexts`), its `otherwise` on the base."""
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
    problems = [f"{where}.{label}: {p}" for label, v in checks for at in (drawn if drawn is not None else [base])
                for p in build_config(merge(at, {key: v}))[1]]
    if dim.when is not None:  # the value its runs get where it is not drawn
        problems += [f"{where}.otherwise: {p}" for p in build_config(merge(base, {key: dim.otherwise}))[1]]
    return (None if problems else out), list(dict.fromkeys(problems))


def when_contexts(dim: Dimension, space: dict[str, Dimension], base: dict[str, Any],
                  seen: frozenset[str] = frozenset()) -> list[dict[str, Any]] | None:
    """The base configs where a dependent choice is drawn: its parents (resolved before it) at every
    combination of the values its `when` allows (a group's settings), each parent's own parents at their
    first; None for a choice drawn everywhere; [] (nothing to check) where a parent did not resolve, takes
    none of those values or leads back to itself (dependency_problems reports the `when`)."""
    if dim.when is None:
        return None
    outs = [base]
    for parent, values in design.conditions(dim).items():
        pd = space.get(parent)
        values = [v for v in values if pd is not None and any(design.same(v, c) for c in pd.choices or [])]
        if parent in seen or not values:  # or a value the parent never takes: dependency_problems says so
            return []
        sets = [(pd.group or {}).get(v) or {} if pd.group is not None else {parent: v} for v in values]
        outs = [merge((when_contexts(pd, space, o, seen | {parent}) or [o])[0], s) for o in outs for s in sets]
    return outs


GROUP_NAME = r"^[A-Za-z][A-Za-z0-9_]{0,63}$"
"""A group's key and its values' names: one word, so it never reads as a dotted config key."""


def _resolve_group(key: str, dim: Dimension, base: dict[str, Any], types_: dict[str, Any],
                   drawn: list[dict[str, Any]] | None = None) -> tuple[Dimension | None, list[str]]:
    """A group: its names as the choices, each name's settings flat, known, searchable and valid on the base config
    with its parents' values (`drawn`, `when_contexts`)."""
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
        problems += [f"{at}.{p}" for ctx in (drawn if drawn is not None else [base])
                     for p in build_config(merge(ctx, flat))[1]]  # ...group.<name>.<key>: got ...
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
    _, in_file = build_config(functools.reduce(merge, layers, base))
    if in_file:  # the file's own settings are wrong
        raise ConfigError([f"{path}: train config: {p}" for p in in_file])
    data = merge(functools.reduce(merge, layers, base), train_over)
    cfg, problems = build_config(data)
    if cfg is None:  # what the file has is valid: the command line's --set is not
        raise ConfigError([f"--set: {p}" for p in problems])

    types_ = {key: tp for key, tp, *_ in schema.iter_fields(TrainConfig)}
    space: dict[str, Dimension] = {}
    for key in design.order(f.search_space):  # parents first: a dependent choice is checked where it is drawn
        dim = f.search_space[key]
        drawn = when_contexts(dim, space, data)
        if dim.group is not None:
            d, p = _resolve_group(key, dim, data, types_, drawn)
            problems += p
            if d is not None:
                space[key] = d
        elif key not in types_:
            problems.append(f"search_space.{key}: not a TrainConfig key" + schema.did_you_mean(key, types_))
        elif key.startswith(NOT_SEARCHABLE):
            problems.append(f"search_space.{key}: not searchable; allowed: keys that change what a run computes, "
                            f"not {', '.join(NOT_SEARCHABLE)} (several seeds per trial: `seeds:`; steps: `steps:`)")
        else:
            d, p = _resolve(key, dim, types_[key], data, drawn)
            problems += p
            if d is not None:
                space[key] = d
    space = {k: space[k] for k in f.search_space if k in space}  # file order: the Sobol design's coordinates

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
    if f.sampler.added and f.sampler.name != "sobol":
        problems.append(f"sampler.added: got {f.sampler.added} with sampler {f.sampler.name}; allowed: [] (only a sobol "
                        "design keeps its first choices' points when choices are added)")
    for k in f.sampler.added:
        if k not in f.search_space:
            problems.append(f"sampler.added: got {k!r}; allowed: choices of search_space, one of {list(f.search_space)}")
    if f.sampler.added and len(set(f.sampler.added)) < len(f.sampler.added):
        problems.append(f"sampler.added: got {f.sampler.added}; a choice is listed twice")
    if f.sampler.added and set(f.search_space) <= set(f.sampler.added):
        problems.append("sampler.added: names every choice; allowed: choices added to a design that has others")
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
        for p in build_config(trial_config(spec, params))[1]:
            bad.setdefault(p, f"trial {i} ({', '.join(f'{k}={fmt_value(v)}' for k, v in params.items())})")
    if bad:
        raise ConfigError([f"{spec.path}: search_space: the design's {where} makes no valid config: {p}"
                           for p, where in list(bad.items())[:5]])
    never = [f"{k}={v}" for k, counts in design.coverage(spec.space, points).items() for v, n in counts.items() if not n]
    return [f"the design's {spec.trials} trials never draw {len(never)} value(s): {', '.join(never)}; raise `trials` "
            "(or --trials) to meet them"] if never else []


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
        return design.Sobol(spec.space, s.seed, added=s.added)
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


def fmt_value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
