"""Small GPT-2 models: construction, a plain training loop, and a seeded sampler.

Kept deliberately plain (no Trainer, no generate()) so a build is deterministic from its seed:
every random draw goes through an explicit torch.Generator or a seeded init.
"""
from __future__ import annotations

import inspect
import math
from functools import lru_cache
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

from harness.world.config import ModelArchConfig


def gpt2_config(arch: ModelArchConfig, vocab_size: int, pad_id: int, eos_id: int) -> GPT2Config:
    """GPT-2 config with dropout off: PPO's log-prob ratios must not be noise."""
    return GPT2Config(
        vocab_size=vocab_size, n_positions=arch.n_positions, n_embd=arch.n_embd,
        n_layer=arch.n_layer, n_head=arch.n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
    )


def new_lm(config: GPT2Config, seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)  # weight init draws from the global generator
    return GPT2LMHeadModel(config)


@lru_cache(maxsize=None)
def _cache_kw(cls: type) -> str:
    """Name of the KV-cache argument: `cache` in transformers >= 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def forward_cached(model: Any, input_ids: torch.Tensor, cache: Any = None) -> tuple[torch.Tensor, Any]:
    """Last-position logits and the updated KV cache."""
    kw = _cache_kw(type(model))
    kwargs = {kw: cache} if cache is not None else {}
    res = model(input_ids=input_ids, use_cache=True, **kwargs)
    return res.logits[:, -1], getattr(res, kw)


def token_nll(model: Any, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token NLL of `labels` (-100 = not predicted); labels[t] is predicted from position t-1."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    tgt = labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1),
                                             ignore_index=-100, reduction=reduction)


def loss_labels(batch: Sequence[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, labels) for examples (ids, loss_start): tokens before loss_start are context."""
    ids, mask = pad_right([e[0] for e in batch], pad_id)
    labels = ids.masked_fill(mask == 0, -100)
    for row, (_, start) in enumerate(batch):
        labels[row, :start] = -100
    return ids, mask, labels


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), right-padded to the longest sequence."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to 10% of the peak."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def make_optimizer(model: nn.Module, lr: float, warmup: int, steps: int):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, steps))
    return opt, sched


def epoch_batches(n: int, batch_size: int, generator: torch.Generator,
                  lengths: Sequence[int] | None = None, pool: int = 32) -> Iterator[list[int]]:
    """Endless index batches: a fresh permutation every epoch, short last batches dropped.

    With `lengths`, each run of `pool` batches is sorted by length before it is cut into batches
    (and the batches are then shuffled), so a batch pads to a similar length: about half the
    compute of padding random mixes of short and long sequences.
    """
    batch_size = min(batch_size, n)
    while True:
        perm = torch.randperm(n, generator=generator).tolist()
        if lengths is None:
            batches = [perm[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]
        else:
            batches = []
            for i in range(0, n, batch_size * pool):
                chunk = sorted(perm[i : i + batch_size * pool], key=lambda j: lengths[j])
                batches += [chunk[k : k + batch_size] for k in range(0, len(chunk) - batch_size + 1, batch_size)]
            order = torch.randperm(len(batches), generator=generator).tolist()
            batches = [batches[o] for o in order]
        yield from batches


def train_causal_lm(
    model: GPT2LMHeadModel,
    examples: Sequence[tuple[list[int], int]],
    *, steps: int, batch_size: int, lr: float, warmup: int, seed: int, pad_id: int,
    desc: str, progress: bool = True,
) -> list[float]:
    """Next-token training; each example is (ids, loss_start): tokens before loss_start are
    context only (the prompt in SFT), the rest are predicted. Returns the loss per step."""
    gen = torch.Generator().manual_seed(seed)
    opt, sched = make_optimizer(model, lr, warmup, steps)
    batches = epoch_batches(len(examples), batch_size, gen, lengths=[len(e[0]) for e in examples])
    losses: list[float] = []
    model.train()
    bar = tqdm(range(steps), desc=desc, disable=None if progress else True, leave=False)  # None: no bar frames in logs
    for _ in bar:
        ids, mask, labels = loss_labels([examples[i] for i in next(batches)], pad_id)
        loss = token_nll(model, ids, mask, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses


@torch.no_grad()
def sample(
    model: GPT2LMHeadModel,
    prompts: Sequence[list[int]],
    *, max_new_tokens: int, temperature: float, eos_id: int, banned: Sequence[int] = (),
    generator: torch.Generator, batch_size: int = 256, desc: str = "sample", progress: bool = True,
) -> list[tuple[list[int], bool]]:
    """Sample one response per prompt: (response ids without EOS, ended with EOS?).

    Prompts are batched by length, so no padding (and no position bookkeeping) is needed.
    `banned` ids (pad, unk) are never sampled: they are not words.
    """
    model.eval()
    out: list[tuple[list[int], bool] | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    chunks = [idx[j : j + batch_size] for _, idx in sorted(by_len.items()) for j in range(0, len(idx), batch_size)]
    for idx in tqdm(chunks, desc=desc, disable=None if progress else True, leave=False):  # None: no bar frames in logs
        x = torch.tensor([prompts[i] for i in idx], dtype=torch.long)
        logits, cache = forward_cached(model, x)
        done = torch.zeros(len(idx), dtype=torch.bool)
        steps: list[torch.Tensor] = []
        for t in range(max_new_tokens):
            logits = logits.float() / temperature
            if banned:
                logits[:, list(banned)] = -float("inf")
            tok = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)
            tok = torch.where(done, torch.full_like(tok, eos_id), tok)
            steps.append(tok)
            done |= tok == eos_id
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            logits, cache = forward_cached(model, tok[:, None], cache)
        gen = torch.stack(steps, 1).tolist()
        for row, i in enumerate(idx):
            seq = gen[row]
            if eos_id in seq:
                out[i] = (seq[: seq.index(eos_id)], True)
            else:
                out[i] = (seq, False)
    return out  # type: ignore[return-value]


@torch.no_grad()
def mean_response_nll(model: GPT2LMHeadModel, examples: Sequence[tuple[list[int], int]], pad_id: int, batch_size: int = 256) -> float:
    """Mean per-token NLL of the predicted part of `examples` (an eval number for the build log)."""
    model.eval()
    total = count = 0.0
    examples = sorted(examples, key=lambda e: len(e[0]))  # similar lengths pad less
    for j in range(0, len(examples), batch_size):
        ids, mask, labels = loss_labels(examples[j : j + batch_size], pad_id)
        total += token_nll(model, ids, mask, labels, reduction="sum").item()
        count += (labels[:, 1:] != -100).sum().item()
    return total / max(count, 1)
