"""From reward-model scores and log-probs to per-token rewards (paper section 1, tricks 1, 4, 5)."""
from __future__ import annotations

import torch

from .stats import RunningMeanStd

EPS = 1e-8


def process_scores(
    scores: torch.Tensor, stats: RunningMeanStd, *, scale: bool, normalize: bool, clip: float | None,
    update_stats: bool = True,
) -> torch.Tensor:
    """Reward scaling / normalization / clipping of raw RM scores (one per sample).

    normalize: (r - mean) / std with running stats (trick 5); else scale: r / std (trick 4);
    then clip to +-clip (delta_r). Stats are updated with this batch first, so they include it.
    Normalization does not require scaling (the reference code's quirk is not copied).
    """
    if update_stats and (scale or normalize):
        stats.update(scores)
    out = scores.float()
    if normalize:
        out = (out - stats.mean) / (stats.std + EPS)
    elif scale:
        out = out / (stats.std + EPS)
    if clip is not None:
        out = out.clamp(-clip, clip)
    return out


def overlong_penalty(lengths: torch.Tensor, cap: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, Sec. 3.4), per response of |y| tokens
    under a length cap L_max with a buffer of L_cache tokens before it:

        R_length(y) = 0                                  if |y| <= L_max - L_cache,
                      ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max,
                      -1                                 if |y| > L_max,

    times `factor` (verl's overlong_buffer.penalty_factor), added to the processed score: a response
    is pushed back from the cap gradually instead of by a truncated, meaningless score. Here no
    response exceeds the cap (generation stops there), so the worst is -factor at |y| = L_max."""
    start = cap - buffer
    over = (lengths.float() - start).clamp(min=0)
    return -factor * (over / buffer).clamp(max=1.0)


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = logprobs - ref_logprobs  # log pi/ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        # r = ref/pi; (r - 1) - log r >= 0
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl estimator: got {estimator!r}; allowed: k1, k2, k3")


def token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """r_t = -kl_coef * kl_t at every response token, plus the processed score at the last one.
    Returns (rewards [B, T], non_score_rewards [B, T]); masked-out positions are 0."""
    non_score = -kl_coef * kl * mask
    rewards = non_score.clone()
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rows = torch.arange(mask.shape[0])
    rewards[rows, last] += scores.to(rewards.dtype) * (mask.sum(1) > 0)
    return rewards, non_score


class KLController:
    """eta, fixed (no target) or adaptive (Ziegler et al. 2019): moved so the observed KL tracks
    the target, eta *= 1 + clip(kl/target - 1, +-0.2) * n_samples/horizon."""

    def __init__(self, kl_coef: float, target: float | None = None, horizon: int = 1):
        self.value, self.target, self.horizon = kl_coef, target, horizon

    def update(self, current_kl: float, n_samples: int) -> None:
        if self.target is not None:
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_samples / self.horizon
