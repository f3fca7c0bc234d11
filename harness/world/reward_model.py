"""The reward model: the SFT trunk with one scalar head, scored at the last non-pad token, trained
on preference pairs with -log sigmoid(r_chosen - r_rejected) (paper Sec. 1)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from harness.world.config import RMTrainConfig
from harness.world.lm import fit, length_batches, pad_right, sample_ids
from harness.world.preferences import Pair

Encoded = Sequence[tuple[list[int], list[int]]]
"""(chosen ids, rejected ids) per pair, in the trainer's token format."""


def reward_model_from(sft: GPT2LMHeadModel, seed: int) -> GPT2ForSequenceClassification:
    """A sequence classifier (num_labels=1) whose trunk is a copy of the SFT model's."""
    config = type(sft.config).from_dict(sft.config.to_dict(), num_labels=1,
                                        architectures=["GPT2ForSequenceClassification"])
    torch.manual_seed(seed)  # the head's init
    rm = GPT2ForSequenceClassification(config)
    rm.transformer.load_state_dict(sft.transformer.state_dict())
    return rm


def encode_pairs(tok, pairs: Sequence[Pair]) -> list[tuple[list[int], list[int]]]:
    return [(sample_ids(tok, p.prompt, p.chosen, p.chosen_ended)[0],
             sample_ids(tok, p.prompt, p.rejected, p.rejected_ended)[0]) for p in pairs]


@torch.no_grad()
def score(rm: GPT2ForSequenceClassification, seqs: Sequence[list[int]], pad_id: int) -> list[float]:
    """Reward of each full sample (prompt + response [+ eos])."""
    rm.eval()
    out = [0.0] * len(seqs)
    for idx in length_batches([len(s) for s in seqs]):
        ids, mask = pad_right([seqs[i] for i in idx], pad_id)
        for i, r in zip(idx, rm(input_ids=ids, attention_mask=mask).logits.squeeze(-1).tolist()):
            out[i] = r
    return out


def score_diffs(rm, encoded: Encoded, pad_id: int) -> list[float]:
    """r(chosen) - r(rejected) for each pair."""
    r = score(rm, [c for c, _ in encoded] + [rj for _, rj in encoded], pad_id)
    return [c - rj for c, rj in zip(r, r[len(encoded):])]


def accuracy(diffs: Sequence[float]) -> float:
    """Fraction of pairs ranked as labeled (ties count half)."""
    return sum(1.0 if d > 0 else 0.5 if d == 0 else 0.0 for d in diffs) / max(1, len(diffs))


def train_reward_model(
    rm: GPT2ForSequenceClassification, train: Encoded, evals: Encoded, cfg: RMTrainConfig,
    *, seed: int, pad_id: int, progress: bool = True,
) -> dict[str, list[float]]:
    """Bradley-Terry training. Every cfg.eval_every steps (and at step 0 and the end) records the
    mean train loss/accuracy since the last record and the held-out accuracy; returns the records
    as {"steps", "train_loss", "train_acc", "eval_acc"} lists."""
    hist: dict[str, list[float]] = {"steps": [], "train_loss": [], "train_acc": [], "eval_acc": []}
    losses: list[float] = []
    hits: list[float] = []

    def record(step: int) -> None:
        row = {"steps": step, "eval_acc": accuracy(score_diffs(rm, evals, pad_id))}
        if losses:
            row.update(train_loss=sum(losses) / len(losses), train_acc=sum(hits) / len(hits))
        else:  # step 0: the untrained head, measured on a slice of the training pairs
            d = score_diffs(rm, train[: len(evals)], pad_id)
            row.update(train_loss=sum(F.softplus(-torch.tensor(d)).tolist()) / max(1, len(d)), train_acc=accuracy(d))
        for k, v in row.items():
            hist[k].append(v)
        losses.clear()
        hits.clear()

    def loss_fn(idx: list[int]) -> torch.Tensor:
        ids, mask = pad_right([train[i][0] for i in idx] + [train[i][1] for i in idx], pad_id)
        r = rm(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        diff = r[: len(idx)] - r[len(idx):]
        hits.append(((diff > 0).float() + 0.5 * (diff == 0).float()).mean().item())
        return -F.logsigmoid(diff).mean()

    def on_step(step: int, loss: float) -> None:
        losses.append(loss)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            record(step)

    record(0)
    fit(rm, loss_fn, [max(len(c), len(r)) for c, r in train], cfg, seed=seed, desc="reward model", progress=progress,
        on_step=on_step)
    return hist
