"""The learning-rate schedule of the policy and the critic: a factor of the configured rate per update.

    warmup (update u < W):   (u + 1) / W
    constant:                1
    linear:                  1 - f
    cosine:                  (1 + cos(pi f)) / 2,    f = min(1, (u - W) / max(1, U - W))

with W = ppo.warmup_steps updates of linear warm-up and U the run's total updates (steps x epochs x minibatches).
"""
from __future__ import annotations

import math
from typing import Callable


def lr_lambda(warmup: int, kind: str, total_updates: int) -> Callable[[int], float]:
    """The factor of update `u` (torch's LambdaLR), for `kind` in constant | linear | cosine."""

    def f(update: int) -> float:
        if warmup and update < warmup:
            return (update + 1) / warmup
        if kind == "constant":
            return 1.0
        frac = min(1.0, (update - warmup) / max(1, total_updates - warmup))
        return 1.0 - frac if kind == "linear" else 0.5 * (1 + math.cos(math.pi * frac))

    return f
