"""Pure tensor functions for every trick: unit-tested against hand-computed numbers.

Importing the package imports no torch: `harness.config` reads the registries' names from
`harness.algorithms.names`, and the functions below load with their module on first use (PEP 562).
"""
from __future__ import annotations

import importlib

_WHERE = {
    "compute_gae": "estimators",
    "POLICY_LOSSES": "losses", "entropy_from_logits": "losses", "entropy_term": "losses", "value_loss": "losses",
    "KLController": "rewards", "kl_per_token": "rewards", "process_scores": "rewards", "token_rewards": "rewards",
    "RunningMeanStd": "stats", "masked_mean": "stats", "masked_var": "stats", "masked_whiten": "stats", "perplexity": "stats",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
