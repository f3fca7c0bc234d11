"""The language of the embedded world: restaurant reviews from a small template grammar (fixed code,
no config): the lexicon, the sentence templates, a parser that says whether a sentence belongs to
the language (the gold reward's test of grammar) and what it says, and generators for sentences,
prompts and review bodies. Text is lower case, words and punctuation separated by single spaces
("the pasta was great ."); `words()` also splits glued punctuation, so any decoding reads the same.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

# -- Lexicon. Subjects come in four classes, each with its own adjectives: "the waiter was delicious" is
# ungrammatical (a person notices, an RM may not). Polarity, one per word: +1 praise, -1 complaint, 0 neutral.
FOODS = (
    "pasta", "pizza", "soup", "salad", "burger", "steak", "fish", "chicken", "rice", "bread",
    "cake", "pie", "coffee", "tea", "wine", "curry", "sushi", "dessert", "sandwich", "ramen",
    "lasagna", "risotto", "omelette", "stew",
)
STAFF = ("service", "staff", "waiter", "waitress", "owner", "chef", "host", "bartender", "server", "manager")
PLACES = ("place", "room", "decor", "music", "atmosphere", "patio", "view", "bar", "terrace", "interior")
PRICES = ("price", "bill", "cost")

FOOD_ADJ = {
    +1: ("delicious", "tasty", "fresh", "perfect", "amazing", "excellent", "flavorful", "tender",
         "crispy", "wonderful", "superb", "great"),
    -1: ("bland", "cold", "stale", "soggy", "greasy", "salty", "dry", "burnt", "awful", "terrible",
         "overcooked", "tasteless"),
    0: ("okay", "fine", "average", "decent", "plain", "simple"),
}
STAFF_ADJ = {
    +1: ("friendly", "helpful", "attentive", "kind", "quick", "polite", "welcoming", "professional", "cheerful"),
    -1: ("rude", "slow", "careless", "unfriendly", "lazy", "grumpy", "dismissive", "clueless"),
    0: ("busy", "quiet", "okay", "fine"),
}
PLACE_ADJ = {
    +1: ("cozy", "clean", "charming", "lovely", "bright", "relaxing", "beautiful", "stylish"),
    -1: ("dirty", "loud", "cramped", "noisy", "dark", "shabby", "crowded", "gloomy"),
    0: ("small", "quiet", "busy", "simple", "plain"),
}
PRICE_ADJ = {
    +1: ("fair", "reasonable", "low", "modest"),
    -1: ("steep", "high", "outrageous", "insane"),
    0: ("normal", "typical", "average"),
}
OVERALL_ADJ = {
    +1: ("great", "good", "nice", "lovely", "wonderful", "fantastic"),
    -1: ("bad", "poor", "terrible", "disappointing", "awful", "horrible"),
    0: ("fine", "average", "mixed", "okay"),
}
VERBS = {
    +1: ("loved", "enjoyed", "liked", "adored"),
    -1: ("hated", "disliked"),
    0: ("tried", "ordered", "had", "shared"),
}
ADVERBS = ("very", "really", "quite", "so", "truly", "pretty", "extremely", "incredibly")

# Category name -> words. Upper-case tokens in templates name these.
CATEGORIES: dict[str, tuple[str, ...]] = {
    "F": FOODS, "S": STAFF, "L": PLACES, "P": PRICES,
    "FA": sum(FOOD_ADJ.values(), ()), "SA": sum(STAFF_ADJ.values(), ()),
    "LA": sum(PLACE_ADJ.values(), ()), "PA": sum(PRICE_ADJ.values(), ()),
    "OA": sum(OVERALL_ADJ.values(), ()), "VB": sum(VERBS.values(), ()), "ADV": ADVERBS,
}
POLAR_CATEGORIES = {"FA": FOOD_ADJ, "SA": STAFF_ADJ, "LA": PLACE_ADJ, "PA": PRICE_ADJ, "OA": OVERALL_ADJ, "VB": VERBS}
SUBJECT_CATEGORIES = ("F", "S", "L", "P")

POLARITY: dict[str, int] = {w: pol for table in POLAR_CATEGORIES.values() for pol, ws in table.items() for w in ws}
SUBJECT_CLASS: dict[str, str] = {w: c for c in SUBJECT_CATEGORIES for w in CATEGORIES[c]}
"""Subject word -> its class ("pasta" -> "F")."""


@dataclass(frozen=True)
class Template:
    """A sentence pattern: literal words, CATEGORY slots, `CATEGORY?` optional slots. `polarity`: that
    of a fixed phrase ("one star ."); sentences with slots get it from the words that fill them."""

    pattern: tuple[str, ...]
    polarity: int = 0
    subject: str | None = None  # subject class the sentence is about ("F", "S", ...), for generation


def _t(text: str, polarity: int = 0, subject: str | None = None) -> Template:
    return Template(tuple(text.split()), polarity, subject)


ORDER_TEMPLATE = _t("i ordered the F and it was ADV? FA .", subject="F")
OVERALL_TEMPLATE = _t("overall the experience was ADV? OA .")
TEMPLATES: tuple[Template, ...] = (
    _t("the F was ADV? FA .", subject="F"),
    _t("the F was ADV? FA and ADV? FA .", subject="F"),
    _t("the F tasted ADV? FA .", subject="F"),
    _t("i VB the F .", subject="F"),
    ORDER_TEMPLATE,
    _t("i VB the F and the F .", subject="FF"),
    _t("we VB the F and the F .", subject="FF"),
    _t("the S was ADV? SA .", subject="S"),
    _t("our S was ADV? SA .", subject="S"),
    _t("the L was ADV? LA .", subject="L"),
    _t("the P was ADV? PA .", subject="P"),
    OVERALL_TEMPLATE,
    # Fixed closing phrases carry their own polarity.
    _t("we will come back .", +1), _t("i would recommend it .", +1), _t("highly recommended .", +1),
    _t("worth every penny .", +1), _t("five stars .", +1),
    _t("we will never come back .", -1), _t("i would not recommend it .", -1), _t("not worth it .", -1),
    _t("avoid this place .", -1), _t("one star .", -1),
    _t("three stars .", 0),
)
CLOSERS = tuple(t for t in TEMPLATES if all(not w[0].isupper() for w in t.pattern))

# Prompt openings. A header ending in ":" asks for a review; the other prompts are the start of
# the first sentence, which the response must finish.
HEADERS = ("review of the {a} :", "my review of the {a} :", "thoughts on the {a} :")
PAIR_HEADER = "review of the {a} and the {b} :"
OPENING = "the {a} was"
ORDER_OPENING = "i ordered the {a} and"


def vocabulary() -> list[str]:
    """Every word the grammar and the prompts can produce, sorted."""
    words: set[str] = set()
    for t in TEMPLATES:
        for w in t.pattern:
            cat = w.rstrip("?")
            words.update(CATEGORIES[cat] if cat in CATEGORIES else (w,))
    for h in HEADERS + (PAIR_HEADER, ORDER_OPENING):
        words.update(w for w in h.split() if not w.startswith("{"))
    return sorted(words)


_WORD_RE = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """Split text into words and punctuation marks (lower-cased), tolerant of glued punctuation."""
    return _WORD_RE.findall(text.lower())


# -- Parsing ----------------------------------------------------------------------------------------
# What a grammatical sentence says: its polarity counts and the subjects it names.
Parse = NamedTuple("Parse", [("positive", int), ("negative", int), ("subjects", tuple[str, ...])])
_CATEGORY_SETS = {k: frozenset(v) for k, v in CATEGORIES.items()}


def _match(pattern: tuple[str, ...], toks: tuple[str, ...], i: int = 0, j: int = 0, filled: tuple = ()) -> tuple | None:
    """Backtracking match of `toks[j:]` against `pattern[i:]`; returns the (category, word) fillers."""
    if i == len(pattern):
        return filled if j == len(toks) else None
    slot = pattern[i]
    cat = slot.rstrip("?")
    if slot.endswith("?"):
        skipped = _match(pattern, toks, i + 1, j, filled)
        if skipped is not None:
            return skipped
    if j >= len(toks):
        return None
    tok = toks[j]
    if cat in _CATEGORY_SETS:
        if tok not in _CATEGORY_SETS[cat]:
            return None
        return _match(pattern, toks, i + 1, j + 1, filled + ((cat, tok),))
    return _match(pattern, toks, i + 1, j + 1, filled) if tok == slot else None


@lru_cache(maxsize=65536)
def parse_sentence(sentence: tuple[str, ...]) -> Parse | None:
    """Parse one sentence (words including the final "."); None if it is not in the language."""
    for t in TEMPLATES:
        filled = _match(t.pattern, sentence)
        if filled is not None:
            pols = [t.polarity] + [POLARITY[w] for c, w in filled if c in POLAR_CATEGORIES]
            subjects = tuple(w for c, w in filled if c in SUBJECT_CATEGORIES)
            return Parse(sum(p > 0 for p in pols), sum(p < 0 for p in pols), subjects)
    return None


def split_sentences(toks: list[str]) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """Split words into complete sentences (each ending in ".") and the unfinished rest."""
    sentences, cur = [], []
    for w in toks:
        cur.append(w)
        if w == ".":
            sentences.append(tuple(cur))
            cur = []
    return sentences, tuple(cur)


# -- Generation -------------------------------------------------------------------------------------
def _fill(t: Template, rng: random.Random, polarity: int, subjects: list[str]) -> list[str]:
    """Fill a template's slots: subjects from `subjects` first, adjectives/verbs of `polarity`."""
    out: list[str] = []
    queue = list(subjects)
    for slot in t.pattern:
        cat = slot.rstrip("?")
        if cat not in CATEGORIES:
            out.append(slot)
        elif slot.endswith("?") and rng.random() < 0.6:
            continue
        elif cat in SUBJECT_CATEGORIES:
            out.append(queue.pop(0) if queue else rng.choice(CATEGORIES[cat]))
        elif cat in POLAR_CATEGORIES:
            out.append(rng.choice(POLAR_CATEGORIES[cat][polarity]))
        else:
            out.append(rng.choice(CATEGORIES[cat]))
    return out


def sentence_about(rng: random.Random, polarity: int, subject: str) -> list[str]:
    """A sentence whose first subject is `subject` (a food, staff, place or price word)."""
    return _fill(rng.choice([t for t in TEMPLATES if t.subject == SUBJECT_CLASS[subject]]), rng, polarity, [subject])


def random_sentence(rng: random.Random, polarity: int) -> list[str]:
    """Any sentence of the language with the given polarity (closers included)."""
    r = rng.random()
    if r < 0.15:
        return list(rng.choice([t for t in CLOSERS if t.polarity == polarity]).pattern)
    if r < 0.22:
        return _fill(OVERALL_TEMPLATE, rng, polarity, [])
    cls = rng.choices(SUBJECT_CATEGORIES, weights=(5, 3, 2, 1))[0]
    if cls == "F" and rng.random() < 0.15:
        t = rng.choice([t for t in TEMPLATES if t.subject == "FF"])
        return _fill(t, rng, polarity, rng.sample(FOODS, 2))
    return sentence_about(rng, polarity, rng.choice(CATEGORIES[cls]))


@dataclass(frozen=True)
class PromptSpec:
    """A prompt, the subjects it is about, and the words that start the review's first sentence."""

    text: str
    subjects: tuple[str, ...]
    kind: str  # header | pair | opening | order


def all_prompts(rng: random.Random, n_pair_prompts: int) -> list[PromptSpec]:
    """Every prompt of the task: single-item headers, some two-item headers, sentence openings."""
    out = [PromptSpec(h.format(a=f), (f,), "header") for h in HEADERS for f in FOODS]
    pairs = [(a, b) for a in FOODS for b in FOODS if a != b]
    pairs = rng.sample(pairs, min(n_pair_prompts, len(pairs)))
    out += [PromptSpec(PAIR_HEADER.format(a=a, b=b), (a, b), "pair") for a, b in pairs]
    out += [PromptSpec(OPENING.format(a=s), (s,), "opening") for c in SUBJECT_CATEGORIES for s in CATEGORIES[c]]
    out += [PromptSpec(ORDER_OPENING.format(a=f), (f,), "order") for f in FOODS]
    return out


def prompt_body_prefix(prompt: str) -> list[str]:
    """The words of a prompt that belong to the review itself (after the last ':', if any)."""
    toks = words(prompt)
    return toks[len(toks) - toks[::-1].index(":"):] if ":" in toks else toks


def prompt_subjects(prompt: str) -> tuple[str, ...]:
    """Subjects the prompt asks about, in order, without repeats."""
    return tuple(dict.fromkeys(w for w in words(prompt) if w in SUBJECT_CLASS))


def review_body(rng: random.Random, spec: PromptSpec, mood: str, n_sentences: int,
                on_topic: float = 0.9, repeat: float = 0.05) -> list[list[str]]:
    """Sentences of a review for `spec`; the first finishes the prompt's opening when it has one.
    mood: "pos", "neg" or "mixed" sets each sentence's polarity. The review is a natural, imperfect
    one: sometimes off topic (prob 1-on_topic) or repeating itself (`repeat`)."""
    def polarity() -> int:
        if mood == "mixed":
            return rng.choice((-1, 0, 1))
        main = 1 if mood == "pos" else -1
        return rng.choices((main, 0, -main), weights=(0.8, 0.1, 0.1))[0]

    sents: list[list[str]] = []
    if spec.kind == "opening":
        cls = SUBJECT_CLASS[spec.subjects[0]]
        # Only templates that begin like the prompt ("the X was ...") can finish it.
        fitting = [t for t in TEMPLATES if t.subject == cls and t.pattern[:3] == ("the", cls, "was")]
        sents.append(_fill(rng.choice(fitting), rng, polarity(), list(spec.subjects)))
    elif spec.kind == "order":
        sents.append(_fill(ORDER_TEMPLATE, rng, polarity(), list(spec.subjects)))
    elif rng.random() < on_topic:
        if spec.kind == "pair" and rng.random() < 0.3:
            both = rng.choice([t for t in TEMPLATES if t.subject == "FF"])
            sents.append(_fill(both, rng, polarity(), list(spec.subjects)))
        else:
            sents += [sentence_about(rng, polarity(), s) for s in spec.subjects]
    while len(sents) < n_sentences:
        if sents and rng.random() < repeat:
            sents.append(list(rng.choice(sents)))
        else:
            sents.append(random_sentence(rng, polarity()))
    return sents
