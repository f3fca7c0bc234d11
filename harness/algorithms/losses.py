"""Policy objectives, registered by name (verl's `register_policy_loss` style), the clipped value
loss and the entropy term.

Each policy loss returns (per-token loss [B, T], stats): the trainer aggregates the tokens
(`estimators.aggregate`, `ppo.loss_aggregation`); stats holds detached per-token tensors for
logging: `clipped` (1 where the clip, weight cap or token selection bit), `ratio`, `log_ratio`, and
any metric key of `harness.keys` (a per-token quantity the trainer averages over the minibatch's
tokens, e.g. `policy/dual_clipfrac`), only when the trick that has it is on. Every loss takes the
trainer's keyword inputs and ignores the ones it does not use (`**_`). Registering is all it takes
to add one: `harness.algorithms.names` reads the name, so the config allows it.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import keys
from .names import POLICY_LOSS_INPUTS, registrar
from .stats import masked_mean

Stats = dict[str, torch.Tensor]
PolicyLoss = Callable[..., tuple[torch.Tensor, Stats]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


register_policy_loss = registrar("policy loss", POLICY_LOSSES, POLICY_LOSS_INPUTS)


def clip_bounds(clip_eps: float, clip_eps_high: float | None) -> tuple[float, float]:
    """[1 - eps_low, 1 + eps_high]: DAPO's clip-higher (Yu et al. 2025, Sec. 3.1) decouples the two
    ranges (eps_low 0.2, eps_high 0.28) so that a low-probability token with a positive advantage may
    grow further before the clip stops it; eps_high = None keeps PPO's symmetric range."""
    return 1.0 - clip_eps, 1.0 + (clip_eps if clip_eps_high is None else clip_eps_high)


def dual_clip(loss_tok: torch.Tensor, advantages: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", dual-clip PPO):
    for A < 0 the clipped surrogate's loss -min(r*A, clip(r)*A) grows without bound in the ratio r, so
    one stale token with a huge ratio can dominate a minibatch; it is capped at -c*A (c > 1):

        L = min(-min(r*A, clip(r)*A), -c*A)  if A < 0,   -min(r*A, clip(r)*A)  otherwise.

    Returns (loss, 1 where the cap bit)."""
    bound = -c * advantages
    hit = (advantages < 0) & (loss_tok > bound)
    return torch.where(hit, bound, loss_tok), hit.float()


@register_policy_loss("ppo")
def ppo_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *, clip_eps: float | None,
    importance_sampling: str = "rollout", ref_logprobs: torch.Tensor | None = None, clip_eps_high: float | None = None,
    dual_clip_c: float | None = None, **_: object,
) -> tuple[torch.Tensor, Stats]:
    """Clipped surrogate -min(ratio*A, clip(ratio, 1-eps, 1+eps_high)*A) (`clip_bounds`; eps_high
    = eps unless clip-higher sets it), capped at -c*A for A < 0 with `dual_clip_c` (`dual_clip`), with the ratio chosen by
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
    extra: Stats = {}
    if importance_sampling == "off":
        loss_tok = -advantages * logprobs
    elif clip_eps is None:
        loss_tok = -ratio * advantages
    else:
        lo, hi = clip_bounds(clip_eps, clip_eps_high)
        surr, surr_clip = ratio * advantages, torch.clamp(ratio, lo, hi) * advantages
        loss_tok = -torch.min(surr, surr_clip)
        clipped = (surr_clip < surr).float()
        if clip_eps_high is not None:  # clip-higher's own quantity: how often the (wider) upper side bites
            extra[keys.POLICY_CLIPFRAC_HIGH] = (clipped * (ratio > 1)).detach()
    if dual_clip_c is not None:
        loss_tok, hit = dual_clip(loss_tok, advantages, dual_clip_c)
        extra[keys.POLICY_DUAL_CLIPFRAC] = hit
    return loss_tok, {"clipped": clipped.detach(), "ratio": ratio.detach(), "log_ratio": log_ratio.detach(), **extra}


def _rollout_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, clipped: torch.Tensor) -> Stats:
    log_ratio = (logprobs - old_logprobs).detach()
    return {"clipped": clipped.detach(), "ratio": log_ratio.exp(), "log_ratio": log_ratio}


@register_policy_loss("apa")
def apa_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *, ref_logprobs: torch.Tensor,
    apa_lambda: float, **_: object,
) -> tuple[torch.Tensor, Stats]:
    """APA: (log pi - A/lambda - log pi_init)^2 per token; pi_init = the reference (SFT) model."""
    loss_tok = (logprobs - advantages / apa_lambda - ref_logprobs) ** 2
    return loss_tok, _rollout_ratio(logprobs, old_logprobs, torch.zeros_like(logprobs))


@register_policy_loss("awr")
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


@register_policy_loss("gspo")
def gspo_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *, mask: torch.Tensor,
    clip_eps: float, clip_eps_high: float | None = None, **_: object,
) -> tuple[torch.Tensor, Stats]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", Sec. 4, GSPO-token form):
    one length-normalised importance ratio per response instead of one per token,

        s_i = exp( (1/|y_i|) * sum_t log(pi_theta(y_i,t) / pi_rollout(y_i,t)) ),
        s_i,t = sg[s_i] * pi_theta(y_i,t) / sg[pi_theta(y_i,t)]   (value s_i; gradient s_i * grad log pi),
        loss_i,t = -min(s_i,t * A_i,t, clip(s_i,t, 1-eps, 1+eps_high) * A_i,t),

    so the clip keeps or drops whole responses. Averaged per response (ppo.loss_aggregation =
    seq_mean_token_mean, which config requires) with one advantage per response, this is the
    sequence-level objective -min(s_i A_i, clip(s_i) A_i) exactly. The paper's ranges are far
    narrower than PPO's (3e-4 / 4e-4), since s_i is a geometric mean of token ratios. The logged
    ratio statistics are those of s_i (per token, so one per response token)."""
    m = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    seq_log_ratio = (log_ratio * m).sum(1) / m.sum(1).clamp(min=1)
    # value sg[s_i], gradient through log pi_theta only; exp capped as verl does (a ratio of e^10 is already absurd)
    log_s = (logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10.0)
    s = torch.exp(log_s)
    lo, hi = clip_bounds(clip_eps, clip_eps_high)
    surr, surr_clip = s * advantages, torch.clamp(s, lo, hi) * advantages
    clipped = (surr_clip < surr).float()
    return -torch.min(surr, surr_clip), {"clipped": clipped.detach(), "ratio": s.detach(), "log_ratio": log_s.detach()}


@register_policy_loss("cispo")
def cispo_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *, clip_eps: float,
    clip_eps_high: float | None = None, **_: object,
) -> tuple[torch.Tensor, Stats]:
    """CISPO (MiniMax-M1 technical report 2025, Sec. 3.1): clip the importance weight, not the
    update, and keep every token's gradient,

        loss_t = -sg[clip(r_t, 1-eps, 1+eps_high)] * A_t * log pi_theta(y_t),   r_t = pi_theta / pi_rollout.

    PPO's clip zeroes the gradient of a token whose ratio left the range (with rare "fork" tokens
    that is often the token that matters); here such a token still pushes, with a bounded weight.
    The report sets no lower bound in practice (eps = 1 here gives weights >= 0) and tunes eps_high.
    `clipped` marks truncated weights."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    lo, hi = clip_bounds(clip_eps, clip_eps_high)
    weight = ratio.clamp(lo, hi).detach()
    clipped = ((ratio < lo) | (ratio > hi)).float()
    return -weight * advantages * logprobs, {"clipped": clipped.detach(), "ratio": ratio.detach(), "log_ratio": log_ratio.detach()}


def logp_adv_cov(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token centred covariance of log-prob and advantage, (log pi_t - mean log pi)(A_t - mean A)
    over the masked tokens (0 elsewhere; detached). Cui et al. 2025 ("The Entropy Mechanism of RL for
    Reasoning LMs", Sec. 3) show the entropy change of a policy-gradient step is driven by this
    covariance: a few high-covariance tokens (confident and rewarded) collapse the entropy."""
    lp, a = logprobs.detach(), advantages.detach()
    return (lp - masked_mean(lp, mask)) * (a - masked_mean(a, mask)) * mask


@register_policy_loss("clip_cov")
def clip_cov_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *, mask: torch.Tensor,
    clip_eps: float, clip_eps_high: float | None = None, clip_cov_ratio: float, clip_cov_lb: float,
    clip_cov_ub: float, generator: torch.Generator | None = None, **_: object,
) -> tuple[torch.Tensor, Stats]:
    """Clip-Cov (Cui et al. 2025, Sec. 4; verl's `clip_cov`, their reference code): the
    PPO clipped surrogate, except that max(1, round_down(ratio * N)) tokens drawn at random among the
    N tokens whose `logp_adv_cov` lies in (lb, ub), and which the PPO clip has not already cut, lose
    their gradient (their loss term is 0):

        loss_t = 0 if t in I_clip else -min(r_t A_t, clip(r_t) A_t).

    `clipped` marks the tokens in I_clip; the logged covariance is that of all tokens."""
    base, st = ppo_loss(logprobs, old_logprobs, advantages, clip_eps=clip_eps, clip_eps_high=clip_eps_high)
    m = mask > 0
    cov = logp_adv_cov(logprobs, advantages, mask)
    eligible = ((cov > clip_cov_lb) & (cov < clip_cov_ub) & m & (st["clipped"] == 0)).flatten().nonzero().squeeze(1)
    n = min(max(int(clip_cov_ratio * int(m.sum())), 1), len(eligible))
    pick = eligible[torch.randperm(len(eligible), generator=generator)[:n].to(eligible.device)]
    selected = torch.zeros(logprobs.numel(), device=logprobs.device)
    selected[pick] = 1.0
    selected = selected.view_as(logprobs)
    return base * (1 - selected), {**st, "clipped": selected, keys.POLICY_LOGP_ADV_COV: cov}


@register_policy_loss("kl_cov")
def kl_cov_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *, mask: torch.Tensor,
    kl_cov_ratio: float, kl_cov_coef: float, **_: object,
) -> tuple[torch.Tensor, Stats]:
    """KL-Cov (Cui et al. 2025, Sec. 4; verl's `kl_cov`): the unclipped surrogate, plus a
    KL penalty on the max(1, round_down(ratio * N)) tokens of largest `logp_adv_cov`:

        loss_t = -r_t A_t + beta * |log r_t|  if t in I_KL,   -r_t A_t  otherwise   (r_t = pi_theta / pi_rollout).

    `clipped` marks the tokens in I_KL; the logged covariance is that of all tokens."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    m = mask > 0
    cov = logp_adv_cov(logprobs, advantages, mask)
    valid = m.flatten().nonzero().squeeze(1)
    n = min(max(int(kl_cov_ratio * len(valid)), 1), len(valid))
    top = valid[cov.flatten()[valid].topk(n).indices] if n else valid[:0]
    selected = torch.zeros(logprobs.numel(), device=logprobs.device)
    selected[top] = 1.0
    selected = selected.view_as(logprobs)
    loss_tok = -ratio * advantages + kl_cov_coef * log_ratio.abs() * selected
    return loss_tok, {"clipped": selected, "ratio": ratio.detach(), "log_ratio": log_ratio.detach(), keys.POLICY_LOGP_ADV_COV: cov}


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
