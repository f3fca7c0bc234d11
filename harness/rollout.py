"""Sampling with a KV cache, and the teacher-forced passes that score a rollout.

Rollout layout: prompts left-padded to P tokens, responses right-padded to R, `sequences = [prompt |
response]`; position ids come from the attention mask, and response token t is predicted from
position P-1+t. Sampling is keyed: row i's token at step t inverts the CDF of its (filtered)
distribution at u = hash(key_i, t), key_i = hash(seed, stream, counter, global row index), so a row
samples the same tokens on any rank beside any neighbours (W ranks sample what one rank does).
"""
from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers.activations import NewGELUActivation

from .algorithms.losses import entropy_from_logits
from .gpt2 import StaticGPT2Decoder, packed_hidden, supports
from .parallel import NonFiniteLoss


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    response_ids: torch.Tensor  # [B, R] right-padded with pad
    response_mask: torch.Tensor  # [B, R] 1 up to and including EOS
    sample_logprobs: torch.Tensor  # [B, R] log pi(token) during sampling (temperature applied)
    ended: torch.Tensor  # [B] bool, response ended with EOS
    sample_entropy: torch.Tensor | None = None  # [B, R] policy entropy at each sampling step (when asked for)

    @property
    def sequences(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], 1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], 1)

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(1)


@functools.lru_cache(maxsize=None)
def _forward_args(model_cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_cls.forward).parameters)


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(1) - 1).clamp(min=0)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors; the multipliers are < 2^31 so no product
    leaves int64. Same bits on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x046CA68B) & _M32
    return x ^ (x >> 16)


def counter_hash(*parts: int | torch.Tensor) -> torch.Tensor:
    """32-bit keys from integers or int64 tensors (broadcast), e.g. (seed, stream, counter, rows)."""
    h = torch.tensor(0x2545F491, dtype=torch.int64)
    for v in parts:
        h = _mix32(h ^ (torch.as_tensor(v, dtype=torch.int64) & _M32))
        h = (h * 0x0019660D + 0x3C6EF35F) & _M32
    return h


STREAM_ROLLOUT, STREAM_EVAL = 1, 2
"""Counter-hash streams: training rollouts (counter = rollout number) and eval (counter = chunk start)."""


def keyed_uniform(row_keys: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1), 24 random bits: a pure function of (row key, step), broadcast."""
    return ((counter_hash(row_keys, step) >> 8).double() + 0.5) / float(1 << 24)


def left_pad(token_lists: list[list[int]], pad_id: int, device: torch.device, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad to `width` (default: the longest list)."""
    P = width or max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), P), dtype=torch.long)
    for i, t in enumerate(token_lists):
        ids[i, P - len(t):] = torch.tensor(t, dtype=torch.long)
        mask[i, P - len(t):] = 1
    return ids.to(device), mask.to(device)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the mass before it already exceeds top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row, the first token whose cumulative probability exceeds u (float64
    in (0, 1), at most 1 - 2^-25) times the row's total. In float64 that product stays below the
    total and a zero-probability token never crosses it, so such a token is never drawn. A row of
    NaN probabilities (a diverged policy, which `sample` reports) would give the index past the last
    token: it is held at the last, so no out-of-range index reaches the model (on CUDA, a device assert)."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    row_keys: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_at_eos: bool = True,
    with_entropy: bool = False,
    greedy: bool = False,
    fast: bool = True,
    all_finished: Callable[[bool], bool] = bool,
) -> Rollout:
    """Autoregressive sampling with a KV cache, one token per row per forward, each row's noise
    from its key (`row_keys` [B], see the module doc).

    GPT-2 models run through `StaticGPT2Decoder`, other models (or `fast=False`) through `CachedDecoder`.
    `with_entropy` also returns the policy entropy at each step (as `entropy_from_logits` of the
    temperature-scaled logits), so the teacher-forced policy pass can be skipped when the old
    log-probs come from sampling. `greedy` takes the argmax instead of drawing (ReMax's baseline
    response; the keys are then unused). `all_finished(local_done)` lets every rank keep decoding until
    all ranks' rows have ended (ZeRO-3 forwards are collective, and shapes must agree).
    Raises NonFiniteLoss when the logits were non-finite at any token (the weights diverged).
    """
    B, device = prompt_ids.shape[0], prompt_ids.device
    pos = position_ids(prompt_mask)
    keys = row_keys.to(device=device, dtype=torch.int64)
    if fast and StaticGPT2Decoder.supports(model):
        dec = StaticGPT2Decoder(model, prompt_mask, max_new_tokens)
    else:
        dec = CachedDecoder(model, prompt_mask)
    logits = dec.prefill(prompt_ids, pos)
    first_pos = pos[:, -1] + 1  # of the first response token
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    tokens, logps, ents = [], [], []
    u = keyed_uniform(keys[:, None], torch.arange(max_new_tokens, device=device))  # [B, steps]: all at once
    for t in range(max_new_tokens):
        scaled = logits.float() / temperature
        logp_all = torch.log_softmax(scaled, -1)
        if greedy:
            tok = scaled.argmax(-1)
        else:
            tok = draw(torch.softmax(filter_logits(scaled, top_k, top_p), -1), u[:, t])
        if stop_at_eos:
            tok = torch.where(finished, pad_id, tok)
        tokens.append(tok)
        logps.append(logp_all.gather(1, tok[:, None]).squeeze(1))
        if with_entropy:
            ents.append(-(logp_all.exp() * logp_all).sum(-1))
        if stop_at_eos:
            finished = finished | (tok == eos_id)
            if all_finished(bool(finished.all())):
                break
        if t < max_new_tokens - 1:
            logits = dec.step(tok, first_pos + t)
    # NaN (or all -inf) logits anywhere in a row make its whole log-softmax NaN, the drawn token's too:
    # one check of the drawn tokens' log-probs at the end finds a diverged policy (not one per token)
    sampled_logps = torch.stack(logps, 1)
    diverged = ~torch.isfinite(sampled_logps).all(1)
    if bool(diverged.any()):
        raise NonFiniteLoss(f"the policy's weights/logits became non-finite (logits of {int(diverged.sum())} of {B} "
                            "rows while sampling): the run diverged, e.g. the learning rate is too high")
    response = torch.stack(tokens, 1)
    is_eos = (response == eos_id) if stop_at_eos else torch.zeros_like(response, dtype=torch.bool)
    # a token is in the response if no EOS came strictly before it
    eos_before = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    mask = (~eos_before).long()
    entropy = torch.stack(ents, 1) * mask if with_entropy else None
    response = torch.where(mask.bool(), response, torch.full_like(response, pad_id))
    return Rollout(prompt_ids, prompt_mask, response, mask, sampled_logps * mask, is_eos.any(1), entropy)


class CachedDecoder:
    """Decoding through the model's own forward and KV cache (any causal LM)."""

    def __init__(self, model: torch.nn.Module, prompt_mask: torch.Tensor):
        self.model, self.attn, self.cache = model, prompt_mask, None
        # the KV-cache argument/output: `cache` in newer transformers, `past_key_values` before
        self.cache_arg = "cache" if "cache" in _forward_args(type(model)) else "past_key_values"

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, **kw) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=self.attn, position_ids=pos, use_cache=True, **kw)
        self.cache = getattr(out, self.cache_arg)
        return out.logits[:, -1, :]

    def prefill(self, prompt_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self._run(prompt_ids, pos, **_keep_last(self.model))

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.attn = torch.cat([self.attn, self.attn.new_ones(len(tok), 1)], 1)
        return self._run(tok[:, None], pos[:, None], **{self.cache_arg: self.cache})


def _keep_last(model: torch.nn.Module, n: int = 1) -> dict:
    """`logits_to_keep=n` where the model (or the one a `parallel.Engine` holds) supports it (the
    LM head then runs on the last n positions only)."""
    return {"logits_to_keep": n} if "logits_to_keep" in _forward_args(type(getattr(model, "module", model))) else {}


def predictors(attn: torch.Tensor, P: int) -> torch.Tensor:
    """[B, P+R] bool: the positions whose next token is a real response token (P-1+t for each real t)."""
    out = torch.zeros_like(attn, dtype=torch.bool)
    out[:, P - 1 : -1] = attn[:, P:].bool()
    return out


def _spread(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """values [M] into a zero tensor shaped like the bool mask `where` (row-major), differentiably."""
    return torch.zeros(where.shape, dtype=values.dtype, device=values.device).masked_scatter(where, values)


def logprobs_and_entropy(model, seq, attn, P, tokens, temperature, with_entropy: bool = True,
                         pack: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response `tokens` [B, R] and (unless with_entropy=False: None) the full-vocab
    entropy per position, from the logits at positions P-1 .. end-1 divided by temperature.

    `pack` with a GPT-2 LM: only real tokens are computed (`gpt2.packed_hidden`), the LM head runs
    at the positions predicting real response tokens, and padded response positions hold 0.
    Otherwise the model's own forward, its LM head only on the last R+1 positions where it takes
    `logits_to_keep` (padded positions then hold numbers that callers mask)."""
    net = getattr(model, "module", model)
    if pack and supports(net, lm=True):
        real = attn[:, P:].bool()
        logits = net.lm_head(packed_hidden(net.transformer, seq, attn, position_ids(attn), predictors(attn, P)))
        logits = logits.float() / temperature
        logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[real][:, None]).squeeze(-1)
        return _spread(logprobs, real), (_spread(entropy_from_logits(logits), real) if with_entropy else None)
    R = seq.shape[1] - P
    out = model(input_ids=seq, attention_mask=attn, position_ids=position_ids(attn), use_cache=False, **_keep_last(model, R + 1))
    logits = out.logits[:, -(R + 1) : -1, :].float() / temperature
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    return logprobs, (entropy_from_logits(logits) if with_entropy else None)


_C = 2.0 * math.sqrt(2.0 / math.pi)  # 0.5 * (1 + tanh(u)) = sigmoid(2u)


def gelu_tanh_cpu(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's gelu_new, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as x * sigmoid(2 u): the
    same function (0.5 (1 + tanh u) = sigmoid(2u)), ~2.2x faster forward than aten's tanh-GELU kernel on CPU,
    whose tanh is the slow part (`bench/gelu.py`); equal up to float round-off."""
    u = x * x
    return u.mul_(0.044715 * _C).add_(_C).mul_(x).sigmoid_().mul_(x)


class _GELUTanh(torch.autograd.Function):
    """Forward by `gelu_tanh_cpu`; backward by aten's own tanh-GELU derivative (as fast as any
    elementwise form, and the gradient is then exactly the fused kernel's)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return gelu_tanh_cpu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


class GELUTanh(torch.nn.Module):
    """gelu_new as one fused kernel on accelerators and in half precision (it computes in fp32
    inside), as `_GELUTanh` for fp32/fp64 on CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
            return F.gelu(x, approximate="tanh")
        return _GELUTanh.apply(x) if torch.is_grad_enabled() and x.requires_grad else gelu_tanh_cpu(x)


def fuse_activations(model: torch.nn.Module) -> None:
    """Swap transformers' `NewGELUActivation` (GPT-2's gelu_new: five elementwise ops forward and
    more backward) for `GELUTanh`: the same function, computed in one fused kernel on accelerators
    and in the sigmoid form on CPU (it differs by float round-off only).
    Parameters and state dicts are untouched."""
    for mod in model.modules():
        for name, child in list(mod.named_children()):
            if type(child) is NewGELUActivation:
                setattr(mod, name, GELUTanh())


def scalar_at(model, seq: torch.Tensor, attn: torch.Tensor, at: torch.Tensor, pack: bool = False) -> torch.Tensor:
    """A `models.ScalarHeadModel`'s scalar at the positions `at` ([B, T] bool) as [M] (row-major);
    `pack` with a GPT-2 trunk computes only the real tokens (`gpt2.packed_hidden`)."""
    net = getattr(model, "module", model)
    if pack and supports(net.trunk, lm=False):
        return net.head(packed_hidden(net.trunk, seq, attn, position_ids(attn), at)).squeeze(-1).float()
    return model(seq, attn, position_ids(attn))[at]


def critic_values(critic, seq: torch.Tensor, attn: torch.Tensor, P: int, pack: bool = False) -> torch.Tensor:
    """V(s_t) for each response token t [B, R]: the critic read at the position before the token
    (0 at padded response positions)."""
    return _spread(scalar_at(critic, seq, attn, predictors(attn, P), pack), attn[:, P:].bool())


def last_scores(rm, seq: torch.Tensor, attn: torch.Tensor, pack: bool = False) -> torch.Tensor:
    """The reward model's score [B] at each row's last real token (the end of the response): we pick
    the position ourselves, so padded rows are scored at exactly the token we mean."""
    last = torch.zeros_like(attn, dtype=torch.bool)
    last[torch.arange(attn.shape[0], device=attn.device), attn.shape[1] - 1 - attn.flip(1).float().argmax(1)] = True
    return scalar_at(rm, seq, attn, last, pack)


def lm_loss(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token NLL over real tokens (PPO-ptx)."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    m = mask[:, 1:].flatten().float()
    return (loss * m).sum() / m.sum().clamp(min=1)
