"""Policy objectives (PPO, APA, AWR), the clipped value loss and the entropy term.

Each policy loss returns (per-token loss [B, T], stats): the trainer aggregates the tokens
(`estimators.aggregate`, `ppo.loss_aggregation`); stats holds detached per-token tensors for
logging: `clipped` (1 where the clip or weight cap bit), `ratio`, `log_ratio`.
"""
from __future__ import annotations

import torch

from .stats import masked_mean

Stats = dict[str, torch.Tensor]


def ppo_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *, clip_eps: float | None,
    importance_sampling: str = "rollout", ref_logprobs: torch.Tensor | None = None, **_: object,
) -> tuple[torch.Tensor, Stats]:
    """Clipped surrogate -min(ratio*A, clip(ratio, 1-eps, 1+eps)*A) with the ratio chosen by
    `importance_sampling` (paper-notes section 2, trick 2):

    - `rollout`: ratio = pi_theta / pi_rollout, standard PPO (every variant's baseline);
    - `reference`: ratio = pi_theta / pi_ref, the paper's importance sampling (Sec. 5.3.2): the
      behaviour distribution is fixed to the reference (SFT) model, "an infinite experience
      buffer"; the clip then bounds how far the policy may move from the reference itself;
    - `off`: no ratio, the gradient of -A*log pi (every epoch's data treated as fresh on-policy
      samples; nothing to clip).
    The logged ratio statistics are those of the ratio in use.
    """
    if importance_sampling not in ("rollout", "reference", "off"):
        raise ValueError(f"importance_sampling: got {importance_sampling!r}; allowed: rollout, reference, off")
    if importance_sampling == "reference" and ref_logprobs is None:
        raise ValueError("importance_sampling='reference' needs the reference model's log-probs")
    log_ratio = logprobs - (ref_logprobs if importance_sampling == "reference" else old_logprobs)
    ratio = torch.exp(log_ratio)
    clipped = torch.zeros_like(logprobs)
    if importance_sampling == "off":
        loss_tok = -advantages * logprobs
    elif clip_eps is None:
        loss_tok = -ratio * advantages
    else:
        surr, surr_clip = ratio * advantages, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
        loss_tok = -torch.min(surr, surr_clip)
        clipped = (surr_clip < surr).float()
    return loss_tok, {"clipped": clipped.detach(), "ratio": ratio.detach(), "log_ratio": log_ratio.detach()}


def _rollout_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, clipped: torch.Tensor) -> Stats:
    log_ratio = (logprobs - old_logprobs).detach()
    return {"clipped": clipped.detach(), "ratio": log_ratio.exp(), "log_ratio": log_ratio}


def apa_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *, ref_logprobs: torch.Tensor,
    apa_lambda: float, **_: object,
) -> tuple[torch.Tensor, Stats]:
    """APA: (log pi - A/lambda - log pi_init)^2 per token; pi_init = the reference (SFT) model."""
    loss_tok = (logprobs - advantages / apa_lambda - ref_logprobs) ** 2
    return loss_tok, _rollout_ratio(logprobs, old_logprobs, torch.zeros_like(logprobs))


def awr_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *, awr_beta: float,
    awr_max_weight: float | None = None, **_: object,
) -> tuple[torch.Tensor, Stats]:
    """AWR: -log pi * exp(A/beta) per token; weights optionally capped (`clipped` marks capped ones)."""
    weights = torch.exp(advantages / awr_beta)
    cap = float("inf") if awr_max_weight is None else awr_max_weight
    clipped = (weights > cap).float()
    loss_tok = -logprobs * weights.clamp(max=cap).detach()
    return loss_tok, _rollout_ratio(logprobs, old_logprobs, clipped)


POLICY_LOSSES = {"ppo": ppo_loss, "apa": apa_loss, "awr": awr_loss}


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, clip fraction): 0.5*max((V-R)^2, (clip(V, V_old-d, V_old+d)-R)^2), or 0.5*(V-R)^2 when clip is None."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * masked_mean(unclipped, mask), torch.zeros(())
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (v_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped, clipped), mask)
    # fraction of values the clip actually moved (comparing the two losses instead would count
    # rounding ties as clipped on the first minibatch, where V == V_old)
    clipfrac = masked_mean(((values - old_values).abs() > clip).float(), mask)
    return loss, clipfrac.detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy (nats) of softmax(logits)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def entropy_term(mean_entropy: torch.Tensor, coef: float, target: float | None) -> torch.Tensor:
    """Loss term: -coef*H (bonus), or coef*|H - target| (the paper's entropy clip variant)."""
    if target is None:
        return -coef * mean_entropy
    return coef * (mean_entropy - target).abs()
