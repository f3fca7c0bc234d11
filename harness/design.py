"""A design over choices (harness.sweep's search space): dependencies, groups, the design index and
the low-discrepancy (Sobol) design.

- A choice with `when: {parent: value(s)}` is drawn only in trials where every parent took one of
  those values (define-by-run: Optuna's `suggest_*` is called for it only then), and the run's
  config gets the choice's `otherwise` value otherwise: no run carries a value it would ignore.
- A group is a choice whose values are named sets of settings (a policy loss with the advantage
  estimator and sampling it needs); its key is its own name, not a config key.
- The design index of a trial: 0, 1, 2, ... over the trials the design itself draws, in trial-number
  order, skipping enqueued trials (the first points of a sweep file, and the make-ups of interrupted
  trials, which repeat the values of the trial they replace). Trial numbers are unique in a storage,
  so the index is too, and whatever the number of runners and interruptions, the configurations of
  a finished study of N trials are the design's points 0..N-1 (each interrupted one made up once).
- `Sobol`: point i of a scrambled Sobol sequence (scipy.stats.qmc, seeded) per design index i; each
  coordinate of the first 2^m points hits each of 2^m equal strata once, so a choice of k <= 2^m
  values meets every value within the first 2^m trials (a uniform random design only on average).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable, Iterable

import optuna
from optuna.distributions import CategoricalDistribution, IntDistribution

ENQUEUED = ("retry_of", "first_trial")
"""User attributes of enqueued trials (their values are fixed, not the design's)."""
ATTR_DESIGN_INDEX = "design_index"
"""User attribute of a trial: its design index (absent on enqueued trials)."""


def same(a: Any, b: Any) -> bool:
    """Equal as values of one config field: true is not 1, 0 is 0.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def conditions(dim: Any) -> dict[str, list[Any]]:
    """A choice's `when` (a Dimension, or its dict as the study stores it), each parent with the values it must take."""
    when = dim.get("when") if isinstance(dim, dict) else dim.when
    return {k: v if isinstance(v, list) else [v] for k, v in (when or {}).items()}


def is_active(dim: Any, params: dict[str, Any]) -> bool:
    """Whether a choice is drawn, given the choices drawn before it."""
    return all(p in params and any(same(params[p], v) for v in vs) for p, vs in conditions(dim).items())


def order(space: dict[str, Any]) -> list[str]:
    """The choices with every parent before its children, else in file order (the space is checked acyclic)."""
    out: list[str] = []

    def visit(key: str, seen: tuple[str, ...]) -> None:
        if key in out or key in seen or key not in space:
            return
        for parent in conditions(space[key]):
            visit(parent, (*seen, key))
        out.append(key)

    for key in space:
        visit(key, ())
    return out


def suggest(space: dict[str, Any], trial: Any) -> dict[str, Any]:
    """Draw a trial's choices, define-by-run: a dependent choice only where its parents allow it."""
    params: dict[str, Any] = {}
    for key in order(space):
        if is_active(space[key], params):
            params[key] = space[key].suggest(trial, key)
    return params


def settings(space: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Dotted config key -> value of a trial: each drawn choice's value (a group's settings), each
    choice not drawn its `otherwise` value (a group's `otherwise` settings, none for null)."""
    out: dict[str, Any] = {}
    for key, dim in space.items():
        if key not in params and dim.when is None:
            continue  # an enqueued point that leaves a choice out is drawn; nothing to do here
        value = params[key] if key in params else dim.otherwise
        if dim.group is not None:
            out.update(dim.group.get(value) or {} if value is not None else {})
        else:
            out[key] = value
    return out


def dependency_problems(space: dict[str, Any], known: set[str] = frozenset(), where: str = "search_space") -> list[str]:
    """What is wrong with the `when`s of resolved choices: unknown parents, values a parent never takes,
    cycles (`known`: choices of the file that did not resolve, reported already). Each dependent
    choice's `otherwise` is checked as a value of its field by the caller."""
    from .schema import closest

    problems = []
    for key, dim in space.items():
        for parent, values in conditions(dim).items():
            at = f"{where}.{key}.when.{parent}"
            if parent == key:
                problems.append(f"{at}: a choice cannot depend on itself")
            elif parent in known and parent not in space:
                continue
            elif parent not in space:
                hit = closest(parent, [k for k in space if k != key])
                problems.append(f"{at}: not a choice of this study" + (f"; did you mean {hit!r}?" if hit else
                                                                       f"; allowed: one of {list(space)}"))
            elif space[parent].type != "categorical":
                problems.append(f"{at}: {parent} is a range; allowed: a dependency on a categorical choice "
                                "(give it `choices: [...]`)")
            else:
                choices = space[parent].choices
                problems += [f"{at}: got {v!r}; allowed: values {parent} takes, one of {choices}"
                             for v in values if not any(same(v, c) for c in choices)]
                if not values:
                    problems.append(f"{at}: got []; allowed: one value or a non-empty list")
    for key in space:  # a cycle: a choice reachable from itself
        stack, seen = list(conditions(space[key])), set()
        while stack:
            k = stack.pop()
            if k == key:
                problems.append(f"{where}.{key}.when: a cycle of dependencies leads back to {key}")
                break
            if k in space and k not in seen:
                seen.add(k)
                stack += list(conditions(space[k]))
    return list(dict.fromkeys(problems))


# ------------------------------------------------------------------ the design index
def _enqueued(trial: Any) -> bool:
    return any(a in trial.user_attrs for a in ENQUEUED)


def design_index(study: Any, trial: Any) -> int | None:
    """The trial's design index (module doc); None for an enqueued trial."""
    if _enqueued(trial):
        return None
    earlier = study.get_trials(deepcopy=False)
    return trial.number - sum(_enqueued(t) for t in earlier if t.number < trial.number)


def from_unit(u: float, dist: Any) -> Any:
    """A value of an Optuna distribution from u in [0, 1): equal strata of a categorical's choices or of
    an integer or stepped range, else the linear or log scale."""
    if isinstance(dist, CategoricalDistribution):
        return dist.choices[min(int(u * len(dist.choices)), len(dist.choices) - 1)]
    lo, hi = dist.low, dist.high
    if dist.log:
        x = math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
        return min(max(round(x), lo), hi) if isinstance(dist, IntDistribution) else min(max(x, lo), hi)
    step = dist.step if isinstance(dist, IntDistribution) or dist.step is not None else None
    if step is None:
        return lo + u * (hi - lo)
    n = int(round((hi - lo) / step)) + 1
    x = lo + min(int(u * n), n - 1) * step
    return int(x) if isinstance(dist, IntDistribution) else float(x)


class Sobol(optuna.samplers.BaseSampler):
    """The low-discrepancy design: trial with design index i takes point i of a scrambled Sobol
    sequence over the choices (one coordinate per choice, in file order; a dependent choice's
    coordinate is unused where it is not drawn). Enqueued trials draw what they leave out at random.

    Choices `added` to a design that already ran take the next dimensions of the sequence, scrambled with
    seed + 1: scipy draws every dimension's scrambling from one stream, so a longer sequence under the same
    seed is another sequence in its first dimensions too and would move every trial's draws. Scrambling is
    per dimension, so the first design's dimensions (seed) and the added ones (the dimensions after them,
    seed + 1) are together a scrambled Sobol sequence of them all: the added choices are balanced with the
    others, not aligned with them (a second sequence over the added choices alone would reuse the first
    dimensions' direction numbers and repeat their values)."""

    def __init__(self, names: Iterable[str], seed: int, added: Iterable[str] = ()):
        names, added = list(names), set(added)
        self.blocks = [[n for n in names if n not in added], [n for n in names if n in added]]
        self.names, self.seed = names, seed
        self._points: dict[int, dict[str, float]] = {}
        self._index: dict[int, int | None] = {}  # trial number -> design index (one read of the trials per trial)
        self._fallback = optuna.samplers.RandomSampler(seed=seed)

    def point(self, index: int) -> dict[str, float]:
        """Point `index` of the design, choice -> coordinate in [0, 1) (the same for every runner: a
        function of seed and index)."""
        from scipy.stats import qmc

        if index not in self._points:
            point: dict[str, float] = {}
            done = 0  # dimensions before the block
            for offset, block in enumerate(self.blocks):
                if not block:
                    continue
                engine = qmc.Sobol(done + len(block), scramble=True, rng=self.seed + offset)
                if index:
                    engine.fast_forward(index)
                point.update(zip(block, map(float, engine.random(1)[0][done:])))
                done += len(block)
            self._points[index] = point
        return self._points[index]

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
        return {}

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: Any, trial: Any, param_name: str, param_distribution: Any) -> Any:
        if trial.number not in self._index:
            self._index[trial.number] = design_index(study, trial)
        index = self._index[trial.number]
        if index is None or param_name not in self.names:
            return self._fallback.sample_independent(study, trial, param_name, param_distribution)
        return from_unit(self.point(index)[param_name], param_distribution)


# ------------------------------------------------------------------ the design ahead of time
def simulate(space: dict[str, Any], make_sampler: Callable[[], Any], n: int, direction: str = "maximize") -> list[dict]:
    """The params of a fresh study's first n trials under this sampler, without a run: what a design
    (random or Sobol: functions of the design index alone) will draw; for --dry-run and checks."""
    with _quiet():
        study = optuna.create_study(sampler=make_sampler(), direction=direction)
        out = []
        for _ in range(n):
            trial = study.ask()
            out.append(suggest(space, trial))
            study.tell(trial, 0.0)
    return out


class _quiet:
    """Optuna's INFO lines (a study created in memory) off for a moment."""

    def __enter__(self) -> None:
        self.level = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)

    def __exit__(self, *exc: Any) -> None:
        optuna.logging.set_verbosity(self.level)


def coverage(space: dict[str, Any], points: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per choice, how many of the points draw each of its values (a value never drawn counts 0)."""
    out = {}
    for key, dim in space.items():
        counts = Counter(label(p[key]) for p in points if key in p)
        out[key] = {**{label(c): counts.get(label(c), 0) for c in (dim.choices or [])}, **counts}  # zeros kept
    return out


def label(v: Any) -> str:
    """A choice value as a table shows it: null, true, 0.8, a group's name."""
    return "null" if v is None else ("true" if v is True else "false" if v is False else str(v))
