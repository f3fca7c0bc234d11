"""Reading a built world: its folder layout, `World` and `load_world`. Nothing here imports torch or
transformers, so that what only reads a world (a run's input check, a runner resolving `world:` paths,
analysis and reports) starts in a fraction of a second; building one is harness.world.build's job."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from harness import statefile
from harness.world.config import WORLD_FORMAT, WorldConfig, world_config_from_dict
from harness.world.gold import gold_reward

if TYPE_CHECKING:
    from harness.world.preferences import Pair

WORLD_FILE = "world.json"
HF_DIRS = ("tokenizer", "pretrained", "sft", "reward")
"""The Hugging Face folders of a world (the tokenizer travels in each)."""


class WorldError(RuntimeError):
    """A world folder that cannot be used (missing, foreign, built by other code)."""


@dataclass
class World:
    """A built world, as the trainer sees it (see docs/CONTRACTS.md)."""

    dir: Path
    config: WorldConfig
    config_hash: str
    train_prompts: list[str]
    eval_prompts: list[str]
    sft_pairs: list[tuple[str, str]]
    tokenizer_dir: Path  # the HF_DIRS below `dir`
    pretrained_dir: Path
    sft_dir: Path
    reward_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)

    def gold_reward(self, prompts: Sequence[str], responses: Sequence[str],
                    ended: Sequence[bool] | None = None) -> list[float]:
        """Hidden gold score per response (see harness/world/gold.py), with this world's weights."""
        return gold_reward(prompts, responses, ended, weights=self.config.gold)

    def preference_pairs(self, split: str = "train") -> list[Pair]:
        """Labeled pairs of `split` ("train" or "eval")."""
        from harness.world.preferences import Pair  # imports torch, which reading a world does not need

        path = self.dir / "data" / f"prefs_{split}.jsonl"
        return [Pair(**json.loads(line)) for line in path.read_text().splitlines()]


def load_world(dir: str | Path) -> World:
    d = Path(dir)
    if not (d / WORLD_FILE).is_file():
        raise WorldError(f"no world at {str(d)!r} ({WORLD_FILE} missing); build one with: "
                         f"python -m harness.world build --out {d}")
    # a run resolves several world: paths and its prompts: read each built world once (a rebuild
    # rewrites world.json, and so is read anew)
    st = (d / WORLD_FILE).stat()
    return _load_world(d, (st.st_mtime_ns, st.st_ino, st.st_size))


@functools.lru_cache(maxsize=4)
def _load_world(d: Path, version: tuple[int, int, int]) -> World:
    build = f"python -m harness.world build --out {d}"
    try:
        meta = statefile.read_json_object(d / WORLD_FILE)
    except statefile.StateFileError as e:  # a build is renamed into place whole: a damaged copy, a full disk
        raise WorldError(f"{e}; rebuild the world with: {build} --force") from None
    if meta.get("format") != WORLD_FORMAT:
        raise WorldError(f"world at {str(d)!r} has format {meta.get('format')!r}; this code reads format "
                         f"{WORLD_FORMAT}: rebuild it with: {build}")
    data = d / "data"
    return World(
        dir=d,
        config=world_config_from_dict(meta["config"]),
        config_hash=meta["config_hash"],
        train_prompts=json.loads((data / "train_prompts.json").read_text()),
        eval_prompts=json.loads((data / "eval_prompts.json").read_text()),
        sft_pairs=[(p, r) for p, r in map(json.loads, (data / "sft_pairs.jsonl").read_text().splitlines())],
        **{f"{name}_dir": d / name for name in HF_DIRS},
        metrics=meta.get("metrics", {}),
    )


def built_hash(out_dir: str | Path) -> str | None:
    """Config hash of the world in `out_dir`, or None when there is none (or it is unreadable)."""
    try:
        return load_world(out_dir).config_hash
    except (OSError, ValueError, KeyError, WorldError):
        return None
