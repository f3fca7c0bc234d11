"""Advantage estimators, registered by name (verl's `register_adv_est` style).

Each maps per-token rewards [B, T] (the processed RM score at the last response token, plus the KL
penalty at every token when KL is placed in the reward) to per-token (advantages, returns), taking
exactly the keyword inputs it needs (`ESTIMATOR_INPUTS`). Group estimators see `group` [B], the
prompt index of each row (G = `generation.samples_per_prompt` rows per prompt); their "outcome" is
the sequence reward R_i = sum_t r_{i,t}, as in verl and OpenRLHF. Only `gae` needs a critic.

Registering is all it takes to add one: `harness.algorithms.names` reads the decorator's name and
the function's inputs from this file, so the config allows it and the tests list it.
"""
from __future__ import annotations

from typing import Callable

import torch

from .names import ESTIMATOR_INPUTS, LOSS_AGGREGATIONS, NEEDS_CRITIC, NEEDS_GREEDY, NEEDS_GROUPS, registrar
from .stats import masked_whiten

__all__ = ["ADV_ESTIMATORS", "ESTIMATOR_INPUTS", "LOSS_AGGREGATIONS", "NEEDS_CRITIC", "NEEDS_GREEDY", "NEEDS_GROUPS",
           "aggregate", "estimate", "register_adv_est"]

EPS = 1e-6
Estimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: dict[str, Estimator] = {}


register_adv_est = registrar("advantage estimator", ADV_ESTIMATORS, ESTIMATOR_INPUTS)


@register_adv_est("gae")
def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (trick 10), the one estimator that needs the critic: A_t = sum_k (gamma*lam)^k delta_{t+k},
    delta_t = r_t + gamma V_{t+1} - V_t; returns = A + V.

    The value after the last response token is 0 (the episode ends there), and masked positions
    (after a response ended) contribute nothing.
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


def _group_stats(scores: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the mean, the sample std (ddof=1, 0 for a single row) and the size of its group."""
    _, inv, counts = torch.unique(group, return_inverse=True, return_counts=True)
    s = scores.double()
    zeros = torch.zeros(len(counts), dtype=s.dtype, device=s.device)
    mean = zeros.index_add(0, inv, s) / counts
    sq = zeros.index_add(0, inv, (s - mean[inv]) ** 2)
    std = (sq / (counts - 1).clamp(min=1)).sqrt() * (counts > 1)
    return mean[inv].to(scores.dtype), std[inv].to(scores.dtype), counts[inv]


def _outcome(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (rewards * mask).sum(1)


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = per_seq[:, None] * mask
    return adv, adv


def _reverse_cumsum(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k-t) r_k over the response tokens (0 after the response ends)."""
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] * mask[:, t] + gamma * running * mask[:, t]
        out[:, t] = running
    return out * mask


@register_adv_est("grpo")
def grpo(*, rewards: torch.Tensor, mask: torch.Tensor, group: torch.Tensor):
    """GRPO (Shao et al. 2024): A_i = (R_i - mean_g R) / (std_g R + eps) at every token of row i.

    A group whose G rewards are all equal gets advantage 0 (no signal, no division by zero)."""
    r = _outcome(rewards, mask)
    mean, std, _ = _group_stats(r, group)
    return _broadcast((r - mean) / (std + EPS), mask)


@register_adv_est("dr_grpo")
def dr_grpo(*, rewards: torch.Tensor, mask: torch.Tensor, group: torch.Tensor):
    """Dr. GRPO (Liu et al. 2025): A_i = R_i - mean_g R, without GRPO's std division (which
    up-weights groups of near-equal rewards). Its other half, no per-response length normalization,
    is the loss aggregation `seq_mean_token_sum` (a fixed normalizer)."""
    r = _outcome(rewards, mask)
    mean, _, _ = _group_stats(r, group)
    return _broadcast(r - mean, mask)


@register_adv_est("rloo")
def rloo(*, rewards: torch.Tensor, mask: torch.Tensor, group: torch.Tensor):
    """RLOO (Ahmadian et al. 2024): A_i = R_i - mean_{j != i in g} R_j = G/(G-1) * (R_i - mean_g R).

    A group of one has no leave-one-out baseline: its advantage is 0."""
    r = _outcome(rewards, mask)
    mean, _, n = _group_stats(r, group)
    loo = torch.where(n > 1, (mean * n - r) / (n - 1).clamp(min=1), r)
    return _broadcast(r - loo, mask)


@register_adv_est("reinforce_pp")
def reinforce_pp(*, rewards: torch.Tensor, mask: torch.Tensor, gamma: float):
    """REINFORCE++ (Hu 2025): returns G_t = sum_{k>=t} gamma^(k-t) r_k (the KL penalty stays per
    token), advantages = the returns whitened over the whole batch's response tokens."""
    returns = _reverse_cumsum(rewards, mask, gamma)
    return masked_whiten(returns, mask) * mask, returns


@register_adv_est("reinforce_pp_baseline")
def reinforce_pp_baseline(*, rewards: torch.Tensor, mask: torch.Tensor, group: torch.Tensor, gamma: float):
    """REINFORCE++ with a group baseline: the group's mean outcome is subtracted from each row's
    last-token reward first, then returns as in `reinforce_pp` and batch whitening."""
    r = _outcome(rewards, mask)
    mean, _, _ = _group_stats(r, group)
    last = (mask.sum(1).long() - 1).clamp(min=0)
    shifted = rewards.clone()
    shifted[torch.arange(len(r)), last] -= mean * (mask.sum(1) > 0)
    returns = _reverse_cumsum(shifted, mask, gamma)
    return masked_whiten(returns, mask) * mask, returns


@register_adv_est("remax")
def remax(*, rewards: torch.Tensor, mask: torch.Tensor, baseline: torch.Tensor):
    """ReMax (Li et al. 2024): A_t = G_t - b with G_t the (undiscounted) return-to-go and b the
    processed score of the greedy response to the same prompt (`baseline` [B])."""
    returns = _reverse_cumsum(rewards, mask, 1.0)
    return (returns - baseline[:, None]) * mask, returns


def group_mean_batch_std(advantages: torch.Tensor, mask: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """LitePPO's advantage normalization (Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for
    LLM Reasoning", Sec. 4.1; ROLL's norm_mean_type=group, norm_std_type=batch): centre by the prompt
    group's mean, scale by the whole batch's standard deviation,

        A'_i,t = (A_i,t - mean_{j in group(i)} a_j) / (std_{all rows j} a_j + eps),   a_j = mean_t A_j,t.

    The group mean removes each prompt's difficulty; the batch std (not GRPO's per-group std) keeps a
    group whose samples score almost alike from being blown up to unit scale. On an outcome
    estimator (one advantage per response, a_i = A_i) it is exactly (A_i - mean_group A) / std_batch A;
    on GAE's per-token advantages each token is shifted by its group's mean row advantage. Once per
    rollout batch, in place of ppo.adv_normalize's per-minibatch whitening."""
    m = mask.to(advantages.dtype)
    row = (advantages * m).sum(1) / m.sum(1).clamp(min=1)
    mean, _, _ = _group_stats(row, group)
    real = row[m.sum(1) > 0]  # a row without tokens (dropped by dynamic sampling) has no advantage to count
    std = real.std() if len(real) > 1 else torch.zeros((), dtype=row.dtype, device=row.device)
    return (advantages - mean[:, None]) / (std + EPS) * m


def informative_groups(scores: torch.Tensor, group: torch.Tensor, tol: float) -> torch.Tensor:
    """DAPO's dynamic sampling filter (Yu et al. 2025, Sec. 3.2: keep a group only if
    0 < |{correct samples}| < G): True for the rows of a prompt group whose scores differ by more than
    `tol` (max - min > tol). A group whose samples all score alike gives every group estimator a zero
    (or, divided by a tiny group std, a noise-blown) advantage: it carries no signal, only dilutes the
    batch. DAPO's scores are 0/1 answers, so "alike" is exact; a reward model's scores are real
    numbers, hence the tolerance."""
    _, inv = torch.unique(group, return_inverse=True)
    s = scores.double()
    empty = torch.zeros(int(inv.max()) + 1 if len(inv) else 0, dtype=s.dtype, device=s.device)
    hi = empty.scatter_reduce(0, inv, s, "amax", include_self=False)
    lo = empty.scatter_reduce(0, inv, s, "amin", include_self=False)
    return (hi - lo)[inv] > tol


def estimate(name: str, **inputs: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """Call estimator `name` with the inputs it declares (others are ignored on purpose: the trainer
    offers every input it has; a missing one is a TypeError naming it)."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"advantage estimator: got {name!r}; allowed: {', '.join(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name](**{k: inputs[k] for k in ESTIMATOR_INPUTS[name] if k in inputs})


# ------------------------------------------------------------------ loss aggregation (the length bias)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) of a per-token loss [B, T]; the loss is numerator / denominator.

    Returned as a pair so several ranks or micro-batches combine exactly: sum the numerators, sum
    the denominators, divide once.
    - token_mean: sum_i,t l / sum_i,t 1 - every token weighs the same, so long responses weigh more
      in total (PPO's usual choice);
    - seq_mean_token_mean: mean_i (sum_t l / |y_i|) - every response weighs the same, so a token of a
      short response weighs more than one of a long response (GRPO's original; biased toward
      lengthening wrong answers and shortening right ones);
    - seq_mean_token_sum: mean_i (sum_t l) / norm with a fixed normalizer (the length cap) - no
      per-response length normalization (Dr. GRPO), every token weighs the same within and across
      batches.
    """
    m = mask.to(loss.dtype)
    if mode == "token_mean":
        return (loss * m).sum(), m.sum()
    rows = (m.sum(1) > 0).to(loss.dtype)
    if mode == "seq_mean_token_mean":
        return ((loss * m).sum(1) / m.sum(1).clamp(min=1)).sum(), rows.sum()
    if mode == "seq_mean_token_sum":
        if not norm:
            raise ValueError("seq_mean_token_sum needs a fixed normalizer (the response length cap)")
        return (loss * m).sum() / norm, rows.sum()
    raise ValueError(f"loss aggregation: got {mode!r}; allowed: {', '.join(LOSS_AGGREGATIONS)}")
