"""Small GPT-2 models and their word-level tokenizer: construction, one plain training loop, and a
seeded sampler. Kept plain (no Trainer, no generate()) so a build is deterministic from its seed:
every random draw goes through an explicit torch.Generator or a seeded init. Token format (the
trainer relies on it): docs/CONTRACTS.md; `<pad>` (id 0) differs from `<eos>` (id 1).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from harness.world.config import ModelArchConfig, PretrainConfig, RMTrainConfig, SFTConfig

StageConfig = PretrainConfig | SFTConfig | RMTrainConfig
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


def train_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """Train a word-level tokenizer on `texts`; specials get ids 0 (pad), 1 (eos), 2 (unk)."""
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()  # the language is lower case; "Pasta" is still pasta
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # words and punctuation, like grammar.words
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD, EOS, UNK], min_frequency=1, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        # Keep "great ." as is: decode must give back the text the grammar reads.
        clean_up_tokenization_spaces=False, model_max_length=1_000_000,
    )


def sample_ids(tok: PreTrainedTokenizerFast, prompt: str, response: str, ended: bool = True) -> tuple[list[int], int]:
    """Full sample ids in the token format and the number of prompt tokens."""
    p = tok(prompt)["input_ids"]
    r = tok(response)["input_ids"] if response else []
    return p + r + ([tok.eos_token_id] if ended else []), len(p)


def gpt2_config(arch: ModelArchConfig, vocab_size: int, pad_id: int, eos_id: int) -> GPT2Config:
    """GPT-2 config with dropout off: PPO's log-prob ratios must not be noise."""
    return GPT2Config(
        vocab_size=vocab_size, n_positions=arch.n_positions, n_embd=arch.n_embd,
        n_layer=arch.n_layer, n_head=arch.n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
    )


def forward_cached(model: Any, input_ids: torch.Tensor, cache: Any = None) -> tuple[torch.Tensor, Any]:
    """Last-position logits and the updated KV cache. The cache goes positionally and comes back
    second: it is named `cache` in transformers >= 5.2x and `past_key_values` before."""
    logits, cache = model(input_ids, cache, use_cache=True)[:2]
    return logits[:, -1], cache


def token_nll(model: Any, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
              reduction: str = "mean") -> torch.Tensor:
    """Next-token NLL of `labels` (-100 = not predicted); labels[t] is predicted from position t-1."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
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
    ids = pad_sequence([torch.tensor(s, dtype=torch.long) for s in seqs], batch_first=True, padding_value=pad_id)
    mask = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in seqs], batch_first=True)
    return ids, mask


def length_batches(lengths: Sequence[int], batch_size: int = 256) -> list[list[int]]:
    """Indices sorted by length and cut into batches, for evaluation: similar lengths pad less."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    return [order[j : j + batch_size] for j in range(0, len(order), batch_size)]


def epoch_batches(n: int, batch_size: int, generator: torch.Generator, lengths: Sequence[int],
                  pool: int = 32) -> Iterator[list[int]]:
    """Endless index batches: a fresh permutation every epoch, short last batches dropped. Each run
    of `pool` batches is sorted by length before it is cut into batches (and the batches are then
    shuffled), so a batch pads to a similar length: about half the compute of random mixes."""
    batch_size = min(batch_size, n)
    while True:
        perm = torch.randperm(n, generator=generator).tolist()
        batches = []
        for i in range(0, n, batch_size * pool):
            chunk = sorted(perm[i : i + batch_size * pool], key=lambda j: lengths[j])
            batches += [chunk[k : k + batch_size] for k in range(0, len(chunk) - batch_size + 1, batch_size)]
        order = torch.randperm(len(batches), generator=generator).tolist()
        yield from (batches[o] for o in order)


def fit(model: torch.nn.Module, loss_fn: Callable[[list[int]], torch.Tensor], lengths: Sequence[int],
        cfg: StageConfig, *, seed: int, desc: str, progress: bool,
        on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """`cfg.steps` AdamW steps (weight decay 0.01, gradients clipped to norm 1) on batches of
    example indices drawn with `seed`; `loss_fn(indices)` is a batch's loss. Learning rate: linear
    warmup over cfg.warmup_steps, then cosine decay to 10% of cfg.lr. Returns the loss per step;
    `on_step(step, loss)` is called after each (steps count from 1)."""
    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    batches = epoch_batches(len(lengths), cfg.batch_size, torch.Generator().manual_seed(seed), lengths)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    losses: list[float] = []
    # disable=None: no bar frames when the output is not a terminal (logs get the build's lines only)
    bar = tqdm(range(1, cfg.steps + 1), desc=desc, disable=None if progress else True, leave=False)
    for step in bar:
        model.train()
        loss = loss_fn(next(batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if on_step:
            on_step(step, losses[-1])
    model.eval()
    return losses


def train_causal_lm(model: GPT2LMHeadModel, examples: Sequence[tuple[list[int], int]], cfg: StageConfig,
                    *, seed: int, pad_id: int, desc: str, progress: bool = True) -> list[float]:
    """Next-token training; each example is (ids, loss_start): tokens before loss_start are
    context only (the prompt in SFT), the rest are predicted. Returns the loss per step."""
    def loss_fn(idx: list[int]) -> torch.Tensor:
        return token_nll(model, *loss_labels([examples[i] for i in idx], pad_id))

    return fit(model, loss_fn, [len(e[0]) for e in examples], cfg, seed=seed, desc=desc, progress=progress)


@torch.no_grad()
def sample(
    model: GPT2LMHeadModel,
    prompts: Sequence[list[int]],
    *, max_new_tokens: int, temperature: float, eos_id: int, banned: Sequence[int] = (),
    generator: torch.Generator, batch_size: int = 256, desc: str = "sample", progress: bool = True,
) -> list[tuple[list[int], bool]]:
    """(response ids without EOS, ended with EOS?) per prompt; prompts are batched by length, so no
    padding is needed. `banned` ids (pad, unk) are never sampled: they are not words."""
    model.eval()
    out: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    chunks = [idx[j : j + batch_size] for _, idx in sorted(by_len.items()) for j in range(0, len(idx), batch_size)]
    for idx in tqdm(chunks, desc=desc, disable=None if progress else True, leave=False):  # None: no bar frames in logs
        logits, cache = forward_cached(model, torch.tensor([prompts[i] for i in idx], dtype=torch.long))
        done = torch.zeros(len(idx), dtype=torch.bool)
        steps: list[torch.Tensor] = []
        for t in range(max_new_tokens):
            logits = logits.float() / temperature
            logits[:, list(banned)] = -float("inf")
            tok = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)
            tok = torch.where(done, torch.full_like(tok, eos_id), tok)
            steps.append(tok)
            done |= tok == eos_id
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            logits, cache = forward_cached(model, tok[:, None], cache)
        for i, seq in zip(idx, torch.stack(steps, 1).tolist()):
            out[i] = (seq[: seq.index(eos_id)], True) if eos_id in seq else (seq, False)
    return out


@torch.no_grad()
def mean_response_nll(model: GPT2LMHeadModel, examples: Sequence[tuple[list[int], int]], pad_id: int) -> float:
    """Mean per-token NLL of the predicted part of `examples` (an eval number for the build log)."""
    model.eval()
    total = count = 0.0
    for idx in length_batches([len(e[0]) for e in examples]):
        ids, mask, labels = loss_labels([examples[i] for i in idx], pad_id)
        total += token_nll(model, ids, mask, labels, reduction="sum").item()
        count += (labels[:, 1:] != -100).sum().item()
    return total / max(count, 1)
