"""The worlds a grid or a sweep runs on, built by its runner before the runs (each once, cached by its
config hash, in a process of its own, logged to the store's `world` experiment): harness.ablate and
harness.sweep call it, and the main job and the reference rerun through harness.ablate."""
from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import keys as K


def ensure_worlds(reg: Any, tracking_uri: str, workers: int = 1, *, missing_default: bool = False) -> None:
    """Build what the grid's runs read and is not built yet, `workers` at a time (each build in its own
    process), logged to the store's `world` experiment: the worlds of a grid over worlds (their
    properties printed), and with `missing_default` (the main job, the reference rerun) the default world
    at a data.world_dir that holds none. A folder holding a world of another config is used as it is."""
    from .world import WorldConfig, built_hash, world_config_hash

    todo: dict[str, tuple[Any, dict[str, str]]] = {}
    if missing_default and reg.kind == "train" and not reg.worlds:
        for d in sorted({r.cfg.data.world_dir for r in reg.runs if r.cfg.data.source == "world"
                         or str(r.cfg.model.sft_path).startswith("world:")}):
            have = built_hash(d)
            if have is None:
                todo[d] = (WorldConfig(), {})
            else:
                other = "" if have == world_config_hash(WorldConfig()) else (
                    f", not the default config; to rebuild it: python -m harness.world build --out {d} --force")
                print(f"  world at {d}: built ({have}{other}); reusing it")
    build_worlds(reg.worlds, tracking_uri, workers, todo)


def build_worlds(worlds: dict[int, tuple[Any, Path]], tracking_uri: str, workers: int = 1,
                 more: dict[str, tuple[Any, dict[str, str]]] | None = None) -> None:
    """The worlds of a grid or sweep over worlds (world seed -> (WorldConfig, folder):
    harness.registry.world_dirs) not built yet, and `more` (folder -> (WorldConfig, tags)), built
    `workers` at a time, each in its own process, logged to the store's `world` experiment; then each
    world of `worlds` printed with its properties."""
    from .launch import in_own_process
    from .world import build_world, built_hash, load_world, world_config_hash

    todo = dict(more or {})
    for w, (cfg, d) in worlds.items():
        if built_hash(d) != world_config_hash(cfg):
            todo[str(d)] = (cfg, {K.TAG_WORLD_SEED: str(w)})
    if todo:
        t0 = time.time()
        print(f"  building {len(todo)} world(s) into {', '.join(todo)} (pretrain, SFT, preference pairs, reward "
              "model: several CPU minutes each, once)", flush=True)
        with ThreadPoolExecutor(max(1, min(workers, len(todo)))) as pool:  # each build in its own process
            for job in [pool.submit(in_own_process, functools.partial(build_world, progress=len(todo) == 1,
                                                                      tracking_uri=tracking_uri, experiment="world",
                                                                      tags=tags), cfg, d)
                        for d, (cfg, tags) in todo.items()]:
                job.result()
        print(f"  world(s) ready ({time.time() - t0:.0f} s)", flush=True)
    for w, (cfg, d) in worlds.items():
        m = load_world(d).metrics
        print(f"  world {w} ({world_config_hash(cfg)}, {d}): RM held-out acc {m.get(K.RM_EVAL_ACC, float('nan')):.3f}, "
              f"vs gold {m.get(K.RM_EVAL_ACC_GOLD, float('nan')):.3f}, SFT gold {m.get(K.SFT_GOLD_MEAN, float('nan')):+.3f}")
