"""The registries' names, read from the files that register them, without importing torch.

An advantage estimator or a policy loss is added in one place: its function, decorated with
`@register_adv_est("name")` in `estimators.py` or `@register_policy_loss("name")` in `losses.py`.
`harness.config` must know the names (its allowed values, `--help`) and which estimators need a
critic or groups, but loading a config must not import torch (every runner and every reader of a
store would pay for it). So this module reads the decorators from the source text (`ast`); the
decorators themselves check, at import, that what registers is what this module read, so the two
can never disagree.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

HERE = Path(__file__).resolve().parent


def registered(module: str, decorator: str) -> dict[str, tuple[str, ...]]:
    """{name: the function's parameter names} for every `@decorator("name")` in harness/algorithms/<module>.py, in file order."""
    path = HERE / f"{module}.py"
    out: dict[str, tuple[str, ...]] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Name) and dec.func.id == decorator:
                if len(dec.args) != 1 or not isinstance(dec.args[0], ast.Constant) or not isinstance(dec.args[0].value, str):
                    raise ValueError(f"{path}:{dec.lineno}: @{decorator} takes one literal name (it is read without importing the module)")
                a = node.args  # in inspect.signature's order
                params = (*a.posonlyargs, *a.args, *filter(None, [a.vararg]), *a.kwonlyargs, *filter(None, [a.kwarg]))
                out[dec.args[0].value] = tuple(x.arg for x in params)
    return out


ESTIMATOR_INPUTS = registered("estimators", "register_adv_est")
"""Each advantage estimator's keyword inputs: the trainer offers them all, each takes what it declares."""
ADV_ESTIMATORS = tuple(ESTIMATOR_INPUTS)
NEEDS_CRITIC = frozenset(n for n, args in ESTIMATOR_INPUTS.items() if "values" in args)
"""Estimators that read the critic's values: only they build and train a critic."""
NEEDS_GROUPS = frozenset(n for n, args in ESTIMATOR_INPUTS.items() if "group" in args)
"""Estimators that compare the samples of one prompt (generation.samples_per_prompt >= 2)."""
NEEDS_GREEDY = frozenset(n for n, args in ESTIMATOR_INPUTS.items() if "baseline" in args)
"""Estimators that need one greedy response per prompt (ReMax)."""
POLICY_LOSS_INPUTS = registered("losses", "register_policy_loss")
POLICY_LOSSES = tuple(POLICY_LOSS_INPUTS)
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
"""`estimators.aggregate`'s modes."""


def registrar(kind: str, table: dict[str, Callable], read: dict[str, tuple[str, ...]]) -> Callable[[str], Callable]:
    """The decorator `@register("name")` that puts a function into `table`. It refuses a name twice,
    and a registration this module did not read the same way (a name built at run time, a decorator
    applied by hand): config would allow what the registry lacks, or the reverse."""
    def register(name: str) -> Callable[[F], F]:
        def wrap(fn: F) -> F:
            if name in table:
                raise ValueError(f"{kind} {name!r} registered twice")
            params = tuple(inspect.signature(fn).parameters)
            if read.get(name) != params:
                raise ValueError(f"{kind} {name!r}: registered with inputs {params}, but harness.algorithms.names read "
                                 f"{read.get(name)}; register it with a literal name on a function defined at module level")
            table[name] = fn
            return fn
        return wrap
    return register
