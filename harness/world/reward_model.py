"""The reward model: the SFT trunk with one scalar head, scored at the last non-pad token, trained
on preference pairs with -log sigmoid(r_chosen - r_rejected) (paper Sec. 1)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from harness.world.config import RMTrainConfig
from harness.world.lm import epoch_batches, make_optimizer, pad_right
from harness.world.preferences import Pair
from harness.world.tokenizer import sample_ids


def reward_model_from(sft: GPT2LMHeadModel, seed: int) -> GPT2ForSequenceClassification:
    """A sequence classifier (num_labels=1) whose trunk is a copy of the SFT model's."""
    config = sft.config.__class__.from_dict(sft.config.to_dict())
    config.num_labels = 1
    config.architectures = ["GPT2ForSequenceClassification"]
    torch.manual_seed(seed)  # the head's init
    rm = GPT2ForSequenceClassification(config)
    rm.transformer.load_state_dict(sft.transformer.state_dict())
    return rm


def encode_pairs(tok, pairs: Sequence[Pair]) -> list[tuple[list[int], list[int]]]:
    """(chosen ids, rejected ids) in the trainer's token format."""
    return [
        (sample_ids(tok, p.prompt, p.chosen, p.chosen_ended)[0], sample_ids(tok, p.prompt, p.rejected, p.rejected_ended)[0])
        for p in pairs
    ]


@torch.no_grad()
def score(rm: GPT2ForSequenceClassification, seqs: Sequence[list[int]], pad_id: int, batch_size: int = 256) -> list[float]:
    """Reward of each full sample (prompt + response [+ eos])."""
    rm.eval()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths pad less
    out = [0.0] * len(seqs)
    for j in range(0, len(order), batch_size):
        idx = order[j : j + batch_size]
        ids, mask = pad_right([seqs[i] for i in idx], pad_id)
        for i, r in zip(idx, rm(input_ids=ids, attention_mask=mask).logits.squeeze(-1).tolist()):
            out[i] = r
    return out


def score_diffs(rm, encoded: Sequence[tuple[list[int], list[int]]], pad_id: int) -> list[float]:
    """r(chosen) - r(rejected) for each pair."""
    r = score(rm, [c for c, _ in encoded] + [rj for _, rj in encoded], pad_id)
    n = len(encoded)
    return [r[i] - r[n + i] for i in range(n)]


def accuracy(diffs: Sequence[float]) -> float:
    """Fraction of pairs ranked as labeled (ties count half)."""
    return sum(1.0 if d > 0 else 0.5 if d == 0 else 0.0 for d in diffs) / max(1, len(diffs))


@dataclass
class RMHistory:
    """RM training curves: one row per logging point."""

    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    train_acc: list[float] = field(default_factory=list)
    eval_acc: list[float] = field(default_factory=list)


def train_reward_model(
    rm: GPT2ForSequenceClassification,
    train: Sequence[tuple[list[int], list[int]]],
    evals: Sequence[tuple[list[int], list[int]]],
    cfg: RMTrainConfig, *, seed: int, pad_id: int, progress: bool = True,
    on_log: Callable[[int, dict[str, float]], None] | None = None,
) -> RMHistory:
    """Bradley-Terry training; every cfg.eval_every steps (and at the end) records the mean
    train loss/accuracy since the last record and the held-out accuracy, and calls on_log."""
    gen = torch.Generator().manual_seed(seed)
    opt, sched = make_optimizer(rm, cfg.lr, cfg.warmup_steps, cfg.steps)
    batches = epoch_batches(len(train), cfg.batch_size, gen, lengths=[max(len(c), len(r)) for c, r in train])
    hist = RMHistory()
    losses: list[float] = []
    hits: list[float] = []

    def record(step: int) -> None:
        row = {"eval_acc": accuracy(score_diffs(rm, evals, pad_id))}
        if losses:
            row.update(train_loss=sum(losses) / len(losses), train_acc=sum(hits) / len(hits))
        else:  # step 0: the untrained head, measured on a slice of the training pairs
            d = score_diffs(rm, train[: len(evals)], pad_id)
            row.update(train_loss=sum(F.softplus(-torch.tensor(d)).tolist()) / max(1, len(d)), train_acc=accuracy(d))
        hist.steps.append(step)
        hist.train_loss.append(row["train_loss"])
        hist.train_acc.append(row["train_acc"])
        hist.eval_acc.append(row["eval_acc"])
        losses.clear()
        hits.clear()
        if on_log:
            on_log(step, row)

    record(0)
    bar = tqdm(range(1, cfg.steps + 1), desc="reward model", disable=None if progress else True, leave=False)  # None: no bar frames in logs
    for step in bar:
        rm.train()
        batch = [train[i] for i in next(batches)]
        ids, mask = pad_right([c for c, _ in batch] + [r for _, r in batch], pad_id)
        r = rm(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        diff = r[: len(batch)] - r[len(batch):]
        loss = -F.logsigmoid(diff).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(rm.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        hits.append(((diff > 0).float() + 0.5 * (diff == 0).float()).mean().item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            record(step)
    rm.eval()
    return hist
