"""The world's word-level tokenizer and its token format.

Token format (the trainer relies on it): prompt ids = `tokenizer(prompt)["input_ids"]` (no
special tokens are added); a full sample = prompt ids + response ids + [eos] when the response
ended. `<pad>` (id 0) differs from `<eos>` (id 1), so a reward model can score the last non-pad
token, which is EOS for ended responses.
"""
from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

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
    """Full sample ids in the trainer's format and the number of prompt tokens."""
    p = tok(prompt)["input_ids"]
    r = tok(response)["input_ids"] if response else []
    return p + r + ([tok.eos_token_id] if ended else []), len(p)
