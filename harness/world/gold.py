"""The hidden gold reward: what a careful person would score a review (the weights' docstrings in
`GoldConfig` say what each term counts). A person rewards enthusiasm and penalizes what reward
models are easily fooled by: off topic, broken grammar, repetition, rambling, saying nothing:

raw = w_sent*s - w_topic*missing - w_grammar*bad_frac - w_rep*rep_frac - w_end*(not ended)
      - w_len*max(0, words - target) - w_empty*(nothing said);   gold = scale*tanh(raw/scale),
s = (pos - neg) / (pos + neg + 1).

With the default weights gold lies in (-3, 3); SFT samples average near 0 (their moods are mixed),
a crisp positive on-topic review scores about 1.3-1.6, word salad or a capped ramble below -1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from harness.world.config import GoldConfig
from harness.world.grammar import parse_sentence, prompt_body_prefix, prompt_subjects, split_sentences, words


@dataclass(frozen=True)
class GoldBreakdown:
    """The parts of one gold score (for tests, debugging and sample tables)."""

    gold: float
    raw: float
    sentiment: float
    missing_topic: float
    bad_grammar: float
    repetition: float
    ended: bool
    extra_words: int
    said_nothing: bool


def gold_breakdown(prompt: str, response: str, ended: bool | None = None, weights: GoldConfig | None = None) -> GoldBreakdown:
    """Score one response to one prompt, with every part of the score."""
    w = weights or GoldConfig()
    prefix = prompt_body_prefix(prompt)
    resp = words(response)
    if ended is None:
        # Without the sampler's word, a response that stops on a full stop is taken as ended.
        ended = bool(resp) and resp[-1] == "."
    body = prefix + resp
    sentences, rest = split_sentences(body)
    if rest and ended:
        sentences.append(rest)  # an ended response with an unfinished sentence: that sentence is broken

    pos = neg = bad = 0
    named: set[str] = set()
    said = False
    seen: set[tuple[str, ...]] = set()
    covered = 0  # body words consumed by the sentences so far
    for sent in sentences:
        covered += len(sent)
        parse = parse_sentence(sent)
        if parse is None:
            bad += 1
            continue
        named.update(parse.subjects)
        said |= covered > len(prefix)  # the sentence holds words of the response, not only the prompt's
        if sent in seen:
            continue  # a repeated sentence earns no praise a second time
        seen.add(sent)
        pos += parse.positive
        neg += parse.negative

    subjects = prompt_subjects(prompt)
    missing = sum(s not in named for s in subjects) / len(subjects) if subjects else 0.0
    bad_frac = bad / len(sentences) if sentences else 0.0
    sentiment = (pos - neg) / (pos + neg + 1)
    grams = [tuple(body[i : i + 3]) for i in range(len(body) - 2)]
    rep = (len(grams) - len(set(grams))) / len(grams) if grams else 0.0  # word trigrams repeating an earlier one
    extra = max(0, len(resp) - w.length_target)
    raw = (
        w.sentiment * sentiment
        - w.topic * missing
        - w.grammar * bad_frac
        - w.repetition * rep
        - w.not_ended * (not ended)
        - w.length * extra
        - w.empty * (not said)
    )
    gold = w.scale * math.tanh(raw / w.scale)
    return GoldBreakdown(gold, raw, sentiment, missing, bad_frac, rep, ended, extra, not said)


def gold_reward(prompts: Sequence[str], responses: Sequence[str], ended: Sequence[bool] | None = None,
                weights: GoldConfig | None = None) -> list[float]:
    """Gold score of each (prompt, response) as decoded by the world tokenizer (special tokens such
    as "<pad>" make a sentence ungrammatical); `ended[i]` = the response stopped with EOS, `ended=None`
    infers it from the text (ended iff the response ends with ".")."""
    if len(prompts) != len(responses):
        raise ValueError(f"gold_reward: got {len(prompts)} prompts and {len(responses)} responses; allowed: equal lengths")
    if ended is not None and len(ended) != len(responses):
        raise ValueError(f"gold_reward: got {len(ended)} ended flags for {len(responses)} responses; allowed: one per response or None")
    flags = list(ended) if ended is not None else [None] * len(responses)
    return [gold_breakdown(p, r, None if e is None else bool(e), weights).gold for p, r, e in zip(prompts, responses, flags)]
