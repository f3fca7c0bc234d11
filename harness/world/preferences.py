"""Preference pairs: two SFT samples per prompt, labeled by a noisy Bradley-Terry judge on gold,
P(a preferred over b) = sigmoid((gold_a - gold_b) / label_noise). A fraction of pairs pits a sample
against a corrupted copy of itself (see `PreferenceConfig.corrupt_frac` for what is, and on purpose
is not, corrupted in).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from harness.world import grammar
from harness.world.config import GoldConfig, PreferenceConfig
from harness.world.gold import gold_reward
from harness.world.lm import sample


@dataclass
class Pair:
    """One labeled comparison. `chosen`/`rejected` follow the noisy label; gold_* are the truth."""

    prompt: str
    chosen: str
    rejected: str
    chosen_ended: bool
    rejected_ended: bool
    gold_chosen: float
    gold_rejected: float
    p_chosen: float  # the judge's probability of this label
    corrupted: bool


def _pile_up(rng: random.Random, toks: list[str]) -> list[str]:
    """Stack praise where an adjective (or any word) stands: "was delicious delicious perfect ."."""
    adj = [i for i, w in enumerate(toks) if w in grammar.POLARITY]
    i = rng.choice(adj) if adj else rng.randrange(len(toks))
    pool = [w for w, pol in grammar.POLARITY.items() if pol > 0] + [toks[i]] * 4
    return toks[: i + 1] + [rng.choice(sorted(pool)) for _ in range(rng.randint(2, 5))] + toks[i + 1 :]


def corrupt(rng: random.Random, text: str, vocab: list[str]) -> str:
    """Word salad from a response: shuffle its words, replace a third of them at random, or pile
    praise words up in place (the cheapest way a policy can please a sentiment-happy RM)."""
    toks = text.split()
    if len(toks) < 2:
        return " ".join(toks + [rng.choice(vocab) for _ in range(3)])
    kind = rng.randrange(3)
    if kind == 0:
        shuffled = toks[:]
        while shuffled == toks:
            rng.shuffle(shuffled)
        return " ".join(shuffled)
    if kind == 1:
        out = [rng.choice(vocab) if rng.random() < 1 / 3 else w for w in toks]
        if out == toks:
            i = rng.randrange(len(out))
            out[i] = rng.choice([w for w in vocab if w != toks[i]])
        return " ".join(out)
    return " ".join(_pile_up(rng, toks))


def bt_label(rng: random.Random, gold_a: float, gold_b: float, noise: float) -> tuple[bool, float]:
    """(a is chosen?, probability of the drawn label) under the Bradley-Terry judge."""
    diff = gold_a - gold_b
    if noise == 0:
        p_a = 1.0 if diff > 0 else 0.0 if diff < 0 else 0.5
    else:
        p_a = 1 / (1 + math.exp(-max(-60.0, min(60.0, diff / noise))))
    a_wins = rng.random() < p_a
    return a_wins, p_a if a_wins else 1 - p_a


def make_pairs(
    model, tok, prompts: list[str], n: int, cfg: PreferenceConfig, gold: GoldConfig, max_new_tokens: int,
    *, seed: int, desc: str, progress: bool = True,
) -> tuple[list[Pair], int]:
    """`n` labeled pairs on `prompts`, and how many identical sample pairs were skipped."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    # get_vocab() order is a dict order; sorted so draws are reproducible
    vocab = sorted(w for w in tok.get_vocab() if w not in tok.all_special_tokens)
    pairs: list[Pair] = []
    skipped_identical = 0
    while len(pairs) < n:
        need = n - len(pairs)
        n_corrupt = sum(rng.random() < cfg.corrupt_frac for _ in range(need))
        # One sample per corrupted pair, two per normal pair (with a little spare for identical draws).
        n_normal = need - n_corrupt
        spare = max(4, n_normal // 10)
        chosen_prompts = [rng.choice(prompts) for _ in range(n_normal + spare + n_corrupt)]
        ids = [tok(p)["input_ids"] for p in chosen_prompts for _ in (0, 1)]
        outs = sample(model, ids, max_new_tokens=max_new_tokens, temperature=cfg.temperature,
                      eos_id=tok.eos_token_id, banned=[tok.pad_token_id, tok.unk_token_id],
                      generator=gen, desc=desc, progress=progress)
        texts = [(tok.decode(r, skip_special_tokens=True), ended) for r, ended in outs]
        normal: list[tuple[str, str, bool, str, bool, bool]] = []
        corrupted: list[tuple[str, str, bool, str, bool, bool]] = []
        for k, p in enumerate(chosen_prompts):
            (a, ea), (b, eb) = texts[2 * k], texts[2 * k + 1]
            if k >= n_normal + spare:  # corrupted pair: a against its word salad
                corrupted.append((p, a, ea, corrupt(rng, a, vocab), ea, True))
            elif a == b and ea == eb:
                skipped_identical += 1
            else:
                normal.append((p, a, ea, b, eb, False))
        batch = normal[:n_normal] + corrupted
        rng.shuffle(batch)
        golds = gold_reward([c[0] for c in batch] * 2, [c[1] for c in batch] + [c[3] for c in batch],
                            [c[2] for c in batch] + [c[4] for c in batch], weights=gold)
        for j, (p, a, ea, b, eb, corr) in enumerate(batch):
            ga, gb = golds[j], golds[len(batch) + j]
            a_wins, p_label = bt_label(rng, ga, gb, cfg.label_noise)
            pairs.append(Pair(p, a, b, ea, eb, ga, gb, p_label, corr) if a_wins
                         else Pair(p, b, a, eb, ea, gb, ga, p_label, corr))
    return pairs[:n], skipped_identical

