"""Signals that need no gold reward and may move before it falls: what the samples look like, and a
second opinion on the reward. Pure functions of one step's batch; the trainer logs them every step
(keys `signal/*` and `audit/*`, docs/CONTRACTS.md) and harness.detector reads them.

Pattern collapse is literally repetition: on the embedded world the RM prefers piled-up praise, and
collapsed responses repeat it; on real models mode collapse shows as less diverse samples. So, over
the response token ids of a batch (EOS and padding excluded):

    distinct-n       |unique n-grams of the batch| / |n-grams of the batch|        (Li et al. 2016)
    repeated n-grams mean over responses of the share of a response's n-grams that already occurred
                     earlier in that same response (0: no repetition; 1 - 1/k for a token repeated k times)
    group similarity mean over prompts with G > 1 samples of the mean pairwise Jaccard similarity of
                     the samples' n-gram sets (1: all G samples alike)

And over-optimisation is the proxy reward rising while the true reward stops rising (Gao et al.
2022): reward models trained on other preference data (harness.world.audit) are a proxy for the
truth a practitioner can afford, and their disagreement grows as the policy leaves the data they
agree on (Coste et al. 2023). With s the proxy RM's scores [B] and A the audit RMs' [k, B]:

    audit mean       mean of A                      the held-out reward
    audit std        std over the batch of the members' mean score
    audit gap        mean(s) - mean(A)               proxy minus held-out (raw units: the detector
                                                     reads its change from the run's start)
    disagreement     mean over samples of the std over members of A[:, i] (0 with one member)

Cost: a few Python passes over at most B x max_new_tokens ids per step, and one forward of each
audit RM over the batch (the proxy RM's cost again per member; on a 7B run, a small audit RM is a
fraction of that: docs/CONTRACTS.md).
"""
from __future__ import annotations

import math
from itertools import combinations
from typing import Sequence

import torch


def ngrams(ids: Sequence[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]


def distinct_n(responses: Sequence[Sequence[int]], n: int) -> float:
    """Unique n-grams over all n-grams of the batch (1.0 when the batch has no n-gram at all)."""
    grams = [g for r in responses for g in ngrams(r, n)]
    return len(set(grams)) / len(grams) if grams else 1.0


def repeated_share(response: Sequence[int], n: int) -> float:
    """Share of a response's n-grams that already occurred earlier in it (0 for fewer than 2 n-grams)."""
    seen: set[tuple[int, ...]] = set()
    rep = 0
    grams = ngrams(response, n)
    for g in grams:
        rep += g in seen
        seen.add(g)
    return rep / len(grams) if grams else 0.0


def repeated_ngrams(responses: Sequence[Sequence[int]], n: int) -> float:
    """Batch mean of `repeated_share`."""
    return sum(repeated_share(r, n) for r in responses) / max(1, len(responses))


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def group_similarity(responses: Sequence[Sequence[int]], group_size: int, n: int) -> float | None:
    """Mean over prompts of the mean pairwise Jaccard similarity of its samples' n-gram sets (rows
    r*G .. r*G+G-1 are one prompt's samples); None when there is one sample per prompt."""
    if group_size < 2:
        return None
    sims = []
    for start in range(0, len(responses) - group_size + 1, group_size):
        sets = [set(ngrams(r, n)) for r in responses[start:start + group_size]]
        pairs = [jaccard(a, b) for a, b in combinations(sets, 2)]
        sims.append(sum(pairs) / len(pairs))
    return sum(sims) / len(sims) if sims else None


def audit_stats(scores: torch.Tensor, audit: torch.Tensor) -> dict[str, float]:
    """{mean, std, gap, disagreement} of the audit RMs' scores `audit` [k, B] beside the proxy's [B]."""
    per_sample = audit.mean(0)
    return {"mean": per_sample.mean().item(),
            "std": per_sample.std().item() if per_sample.numel() > 1 else 0.0,
            "gap": (scores.mean() - per_sample.mean()).item(),
            "disagreement": audit.std(0).mean().item() if audit.shape[0] > 1 else 0.0}


def batch_signals(responses: Sequence[Sequence[int]], group_size: int) -> dict[str, float]:
    """distinct-1, distinct-2, repeated 2-gram share and (G > 1) group similarity of one batch."""
    out = {"distinct_1": distinct_n(responses, 1), "distinct_2": distinct_n(responses, 2),
           "repeated_2gram": repeated_ngrams(responses, 2)}
    sim = group_similarity(responses, group_size, 2)
    if sim is not None and not math.isnan(sim):
        out["group_similarity"] = sim
    return out
