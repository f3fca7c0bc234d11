"""Generalized advantage estimation over response tokens (trick 10)."""
from __future__ import annotations

import torch


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns for [B, T] per-token rewards and values.

    The value after the last response token is 0 (the episode ends there), and masked positions
    (after a response ended) contribute nothing. returns = advantages + values.
    """
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    last_gae = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(T)):
        next_mask = mask[:, t + 1] if t + 1 < T else torch.zeros_like(last_gae)
        next_value = values[:, t + 1] * next_mask if t + 1 < T else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * next_mask * last_gae
        adv[:, t] = last_gae
    adv = adv * mask
    returns = (adv + values) * mask
    return adv, returns
