"""Typed config of the embedded world (validated by `harness.schema`). The world is a pure function
of this config (and `WORLD_FORMAT`): its hash names the cached build."""
from __future__ import annotations

import hashlib
import json
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from harness import schema
from harness.schema import Batch, Count, Float, Int, NonNeg, Pos, PosCount, Seed, Unit, section, to_dict

# Bump when code changes what a build produces, so cached worlds from older code are rebuilt.
WORLD_FORMAT = 2


@section
class TaskConfig:
    pair_prompts: Count = 150
    """Two-dish prompts ("review of the pasta and the curry :") drawn from all dish pairs; the other prompt kinds are fixed (72 single-dish headers, 47 sentence openings, 24 "i ordered the X and")."""
    eval_frac: Annotated[Float, Field(gt=0, lt=1)] = 0.2
    """Fraction of prompts of each kind held out as eval prompts (never seen by SFT or RM training)."""
    max_new_tokens: Annotated[Int, Field(ge=1, le=1_000_000)] = 24
    """Response length cap when sampling preference pairs; match generation.max_new_tokens of the runs."""
    off_topic: Unit = 0.1
    """Probability that an SFT review skips the dish the prompt asks about (SFT imperfection PPO can fix)."""
    repeat: Unit = 0.05
    """Probability that each further SFT sentence repeats an earlier one."""


@section
class CorpusConfig:
    pretrain_docs: PosCount = 20000
    """Generic documents (2-6 random sentences, some under a random review header) for pretraining."""
    sft_examples: PosCount = 20000
    """(prompt, response) SFT examples on train prompts: reviews mixed in mood (positive, negative, mixed)."""


@section
class ModelArchConfig:
    n_layer: Annotated[Int, Field(ge=1, le=1024)] = 3
    """GPT-2 blocks (policy, reference, reward model and critic all share this trunk shape)."""
    n_embd: Annotated[Int, Field(ge=1, le=65536)] = 128
    """Hidden size; must be divisible by n_head."""
    n_head: Annotated[Int, Field(ge=1, le=1024)] = 4
    """Attention heads."""
    n_positions: Annotated[Int, Field(ge=16, le=1_000_000)] = 128
    """Maximum sequence length (prompt + response + eos) the models accept."""


@section
class PretrainConfig:
    steps: Count = 400
    """Optimizer steps (the corpus is reshuffled each epoch)."""
    batch_size: Batch = 64
    """Documents per step."""
    lr: Pos = 1e-3
    """AdamW peak learning rate (linear warmup, then cosine decay to 10%)."""
    warmup_steps: Count = 30
    """Linear warmup steps."""


@section
class SFTConfig:
    steps: Count = 400
    """Optimizer steps (the SFT examples are reshuffled each epoch)."""
    batch_size: Batch = 64
    """Examples per step."""
    lr: Pos = 2e-3
    """AdamW peak learning rate (linear warmup, then cosine decay to 10%). High on purpose: copying the dish named in the prompt is learned in a sudden jump, which at 5e-4 comes after 400 steps and at 2e-3 before 300."""
    warmup_steps: Count = 30
    """Linear warmup steps."""


@section
class PreferenceConfig:
    train_pairs: PosCount = 4000
    """Preference pairs on train prompts: two SFT samples of one prompt, labeled by the gold reward."""
    eval_pairs: PosCount = 1000
    """Held-out pairs on eval prompts (RM eval accuracy, Fig. 2 histogram)."""
    temperature: Annotated[Float, Field(ge=0.05, le=100)] = 1.0
    """SFT sampling temperature for the pairs."""
    label_noise: NonNeg = 0.5
    """Bradley-Terry temperature of the labeler: P(a preferred over b) = sigmoid((gold_a - gold_b) / label_noise); 0 = always the gold order."""
    corrupt_frac: Unit = 0.1
    """Fraction of pairs where one side is a corrupted copy of the other (words shuffled, replaced by random words, or praise piled up in place): teaches the RM that word salad is bad. Repeated sentences and rambling are deliberately NOT corrupted in, so the RM stays exploitable there."""


@section
class RMTrainConfig:
    steps: Count = 250
    """Optimizer steps on preference pairs (-log sigmoid(r_chosen - r_rejected))."""
    batch_size: Batch = 32
    """Pairs per step."""
    lr: Pos = 3e-4
    """AdamW peak learning rate (warmup, cosine decay)."""
    warmup_steps: Count = 20
    """Linear warmup steps."""
    eval_every: PosCount = 25
    """Log rm/train_acc, rm/train_loss (means since the last log) and rm/eval_acc every N steps."""


@section
class GoldConfig:
    sentiment: NonNeg = 2.0
    """Weight of enthusiasm s = (pos - neg) / (pos + neg + 1), counted over grammatical, non-repeated sentences (saturates: more praise helps less and less)."""
    topic: NonNeg = 1.0
    """Penalty times the fraction of the prompt's subjects the review never names in a grammatical sentence."""
    grammar: NonNeg = 2.0
    """Penalty times the fraction of sentences that are not in the grammar (an unfinished last sentence counts when the response ended)."""
    repetition: NonNeg = 3.0
    """Penalty times the fraction of word trigrams that repeat an earlier trigram."""
    not_ended: NonNeg = 1.0
    """Penalty when the response ran into the length cap instead of ending with EOS."""
    length_target: PosCount = 20
    """Response words beyond this count as rambling."""
    length: NonNeg = 0.1
    """Penalty per response word beyond length_target."""
    empty: NonNeg = 1.5
    """Penalty when the response itself contributes no grammatical sentence."""
    scale: Pos = 3.0
    """Squash: gold = scale * tanh(raw / scale), so gold lies in (-scale, scale)."""


@section
class WorldConfig:
    seed: Seed = 0
    """Seed of everything: corpora, prompt split, model init, data order, sampling and labels."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and the SFT review style."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    """Sizes of the generated corpora."""
    model: ModelArchConfig = field(default_factory=ModelArchConfig)
    """GPT-2 shape of every model."""
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    """Pretraining on the generic corpus (next-token loss on every token)."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """SFT from the pretrained model (loss on response tokens and EOS only)."""
    prefs: PreferenceConfig = field(default_factory=PreferenceConfig)
    """Preference pairs sampled from the SFT model."""
    rm: RMTrainConfig = field(default_factory=RMTrainConfig)
    """Reward-model training."""
    gold: GoldConfig = field(default_factory=GoldConfig)
    """The hidden gold reward's weights (what a person would score)."""


TINY: dict[str, Any] = {
    "task.pair_prompts": 40, "corpus.pretrain_docs": 1500, "corpus.sft_examples": 1500,
    "model.n_layer": 1, "model.n_embd": 64, "model.n_head": 2, "model.n_positions": 64,
    "pretrain.steps": 100, "pretrain.batch_size": 32, "pretrain.lr": 3e-3, "pretrain.warmup_steps": 5,
    "sft.steps": 100, "sft.batch_size": 32, "sft.lr": 3e-3, "sft.warmup_steps": 5,
    "prefs.train_pairs": 1500, "prefs.eval_pairs": 300,
    "rm.steps": 80, "rm.batch_size": 32, "rm.lr": 2e-3, "rm.warmup_steps": 10, "rm.eval_every": 20,
}
"""Overrides for a world that builds in seconds (tests, smoke runs): `load_world_config(overrides=TINY)`."""


def world_cross_checks(cfg: WorldConfig) -> list[str]:
    p: list[str] = []
    if cfg.model.n_embd % cfg.model.n_head:
        p.append(f"model.n_embd: got {cfg.model.n_embd}; allowed: a multiple of model.n_head={cfg.model.n_head}")
    longest = 8 + cfg.task.max_new_tokens + 1  # the longest prompt, "review of the pasta and the curry :"
    if cfg.model.n_positions < longest:
        p.append(f"model.n_positions: got {cfg.model.n_positions}; allowed: >= {longest} (prompt + task.max_new_tokens + eos)")
    return p


def world_config_from_dict(data: dict[str, Any] | None) -> WorldConfig:
    """Validate a nested dict into a WorldConfig; raises ConfigError listing every problem."""
    cfg = schema.validate(WorldConfig, data)
    if problems := world_cross_checks(cfg):
        raise schema.ConfigError(problems)
    return cfg


def load_world_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> WorldConfig:
    """YAML file (optional) + overrides (`["rm.steps=100"]` or `{"rm.steps": 100}`) -> WorldConfig."""
    return schema.load(WorldConfig, path, overrides, world_cross_checks)


def world_config_hash(cfg: WorldConfig) -> str:
    """Hash of everything that changes what the build produces (the cache key)."""
    data = {**to_dict(cfg), "_format": WORLD_FORMAT}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
