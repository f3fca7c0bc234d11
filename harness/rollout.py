"""Sampling with a KV cache, and the teacher-forced passes that score a rollout.

Layout of a rollout batch: prompts left-padded to P tokens, responses right-padded to R tokens,
`sequences = [prompt | response]`. Position ids come from the attention mask, so padding never
shifts a token's position. The response token at index t is predicted from position P-1+t.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .algorithms.losses import entropy_from_logits


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    response_ids: torch.Tensor  # [B, R] right-padded with pad
    response_mask: torch.Tensor  # [B, R] 1 up to and including EOS
    sample_logprobs: torch.Tensor  # [B, R] log pi(token) during sampling (temperature applied)
    ended: torch.Tensor  # [B] bool, response ended with EOS

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
def _cache_arg(model_cls: type) -> str:
    """Name of the KV-cache argument/output: `cache` in newer transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(1) - 1).clamp(min=0)


def left_pad(token_lists: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), P), dtype=torch.long)
    for i, t in enumerate(token_lists):
        if t:
            ids[i, P - len(t):] = torch.tensor(t)
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


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_at_eos: bool = True,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Autoregressive sampling with the model's KV cache, one token per row per forward."""
    B = prompt_ids.shape[0]
    device = prompt_ids.device
    cache_arg = _cache_arg(type(model))
    pos = position_ids(prompt_mask)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos, use_cache=True)
    past, logits = getattr(out, cache_arg), out.logits[:, -1, :]
    next_pos = pos[:, -1] + 1
    attn = prompt_mask
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    tokens, logps = [], []
    for t in range(max_new_tokens):
        scaled = logits.float() / temperature
        logp_all = torch.log_softmax(scaled, -1)
        probs = torch.softmax(filter_logits(scaled, top_k, top_p), -1)
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        tok = torch.where(finished, torch.full_like(tok, pad_id), tok)
        tokens.append(tok)
        logps.append(logp_all.gather(1, tok[:, None]).squeeze(1))
        if stop_at_eos:
            finished = finished | (tok == eos_id)
            if bool(finished.all()):
                break
        if t == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype, device=device)], 1)
        out = model(
            input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None],
            use_cache=True, **{cache_arg: past},
        )
        past, logits = getattr(out, cache_arg), out.logits[:, -1, :]
        next_pos = next_pos + 1
    response = torch.stack(tokens, 1)
    is_eos = (response == eos_id) if stop_at_eos else torch.zeros_like(response, dtype=torch.bool)
    # a token is in the response if no EOS came strictly before it
    eos_before = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    mask = (~eos_before).long()
    ended = is_eos.any(1)
    sample_logprobs = torch.stack(logps, 1) * mask
    response = torch.where(mask.bool(), response, torch.full_like(response, pad_id))
    return Rollout(prompt_ids, prompt_mask, response, mask, sample_logprobs, ended)


def response_logits(model: torch.nn.Module, seq: torch.Tensor, attn: torch.Tensor, P: int, temperature: float) -> torch.Tensor:
    """Logits that predict each response token: positions P-1 .. end-1, divided by temperature."""
    out = model(input_ids=seq, attention_mask=attn, position_ids=position_ids(attn), use_cache=False)
    return out.logits[:, P - 1 : -1, :].float() / temperature


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def logprobs_and_entropy(model, seq, attn, P, tokens, temperature) -> tuple[torch.Tensor, torch.Tensor]:
    logits = response_logits(model, seq, attn, P, temperature)
    return logprobs_of(logits, tokens), entropy_from_logits(logits)


def critic_values(critic, seq: torch.Tensor, attn: torch.Tensor, P: int) -> torch.Tensor:
    """V(s_t) for each response token t: the critic read at the position before the token."""
    return critic(seq, attn, position_ids(attn))[:, P - 1 : -1]


def lm_loss(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token NLL over real tokens (PPO-ptx)."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    m = mask[:, 1:].flatten().float()
    return (loss * m).sum() / m.sum().clamp(min=1)
