"""Prompt sources: the embedded world or an HH-RLHF file, behind one small interface."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

from ..config import TrainConfig


@dataclass
class PromptSource:
    train_prompts: list[str]
    eval_prompts: list[str]
    sft_texts: list[tuple[str, str]]
    """(prompt, response) pairs for PPO-ptx."""
    gold: Callable[[list[str], list[str], list[bool] | None], list[float]] | None
    """Hidden gold reward (embedded world only)."""


def load_source(cfg: TrainConfig) -> PromptSource:
    if cfg.data.source == "world":
        from ..world import load_world  # its WorldError says how to build a missing world

        w = load_world(cfg.data.world_dir)
        return PromptSource(list(w.train_prompts), list(w.eval_prompts)[: cfg.data.eval_prompts], list(w.sft_pairs), w.gold_reward)
    from .hh_rlhf import load_hh_rlhf

    hh = load_hh_rlhf(cfg.data.hh_path)
    if hh.malformed:
        print(f"[harness] {hh.summary(max_listed=5)}", file=sys.stderr)
    # hold out at most a tenth of the prompts for evaluation, and say so when that is fewer than asked
    n_eval = min(cfg.data.eval_prompts, len(hh.prompts) // 10)
    if n_eval < cfg.data.eval_prompts:
        if n_eval == 0:
            raise ValueError(f"data.hh_path: {cfg.data.hh_path!r} has {len(hh.prompts)} distinct prompts; at least 10 are "
                             f"needed to hold out eval prompts (or set data.eval_prompts: 0)")
        print(f"[harness] data.eval_prompts: {cfg.data.eval_prompts} asked, {n_eval} held out "
              f"(a tenth of the {len(hh.prompts)} prompts in {cfg.data.hh_path})", file=sys.stderr)
    return PromptSource(*hh.split_prompts(n_eval, seed=cfg.seed), hh.sft_pairs, None)
