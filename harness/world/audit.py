"""Audit reward models: a second opinion on the reward, built beside a world without touching it.

Over-optimisation is the proxy reward rising while the true reward stops rising (Gao et al. 2022);
reward models trained on other data disagree as the policy leaves the data they agree on (Coste et
al. 2023, Eisenstein et al. 2023). A practitioner can always afford one: a few small RMs trained on
a held-out part of their preference data, or from other seeds. This module builds that for the
embedded world: `n` reward models, each trained like the world's own (harness.world.reward_model,
the world's `rm` settings) from the SFT trunk, with its own head init and data order, on its own
preference pairs, drawn afresh from the SFT model and labelled by the same noisy judge, so that no
audit member saw a pair the proxy RM trained on and no two members share a pair.

They live in `<world_dir>-audit/` (`audit_dir`), never inside the world folder: the world's
content hash, which the committed reference ran on, stays the same. `audit.json` records the
world's config and content hashes they were built for; a world rebuilt in place makes them stale
and `ensure_audit` builds them again. A run reads them through `model.audit_reward_paths`
(`auto`: these, where built).
"""
from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import torch
from filelock import FileLock

AUDIT_RMS = 3
"""Audit reward models a world build makes by default (`python -m harness.world build --audit-rms N`)."""
AUDIT_FILE = "audit.json"


def audit_dir(world_dir: str | Path) -> Path:
    """Where a world's audit RMs are cached: the sibling folder `<world_dir>-audit`."""
    d = Path(world_dir).resolve()
    return d.parent / f"{d.name}-audit"


def member_dirs(world_dir: str | Path) -> list[Path]:
    """The audit RMs built for the world now in `world_dir` (empty: none, or built for another world)."""
    from harness.world.shipped import content_hash

    d = audit_dir(world_dir)
    try:
        meta = json.loads((d / AUDIT_FILE).read_text())
    except (OSError, ValueError):
        return []
    if meta.get("world_content") != content_hash(world_dir):
        return []
    return [d / name for name in meta.get("members", []) if (d / name / "config.json").is_file()]


def ensure_audit(world_dir: str | Path, n: int = AUDIT_RMS, *, progress: bool = True) -> list[Path]:
    """The world's `n` audit RMs, built if missing or stale (one builder at a time, as parallel
    workers may all ask); returns their folders. n = 0 builds nothing."""
    if n <= 0:
        return []
    have = member_dirs(world_dir)
    if len(have) >= n:
        return have[:n]
    out = audit_dir(world_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        have = member_dirs(world_dir)
        if len(have) >= n:
            return have[:n]
        tmp = out.parent / f".{out.name}.building-{uuid.uuid4().hex[:8]}"
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)  # as the world build: the same RMs whatever the caller's threads
            tmp.mkdir()
            _build_into(Path(world_dir), tmp, n, progress)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        finally:
            torch.set_num_threads(threads)
            shutil.rmtree(tmp, ignore_errors=True)
    return member_dirs(world_dir)[:n]


def _build_into(world_dir: Path, tmp: Path, n: int, progress: bool) -> None:
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    from harness.world.build import stage_seed
    from harness.world.load import load_world
    from harness.world.preferences import make_pairs
    from harness.world.reward_model import accuracy, encode_pairs, reward_model_from, score_diffs, train_reward_model
    from harness.world.shipped import content_hash

    t0 = time.perf_counter()
    hf_logging.disable_progress_bar()  # lines, never bar frames: build logs are read as files
    w = load_world(world_dir)
    cfg = w.config
    tok = PreTrainedTokenizerFast.from_pretrained(str(w.tokenizer_dir))
    sft = GPT2LMHeadModel.from_pretrained(str(w.sft_dir)).eval()
    # fresh pairs, disjoint from the proxy RM's by construction (another seed stage), one share per member
    per = max(cfg.prefs.train_pairs // n, 64)
    pairs, _ = make_pairs(sft, tok, w.train_prompts, per * n, cfg.prefs, cfg.gold, cfg.task.max_new_tokens,
                          seed=stage_seed(cfg.seed, "audit_pairs"), desc="audit pairs", progress=progress)
    evals = encode_pairs(tok, w.preference_pairs("eval"))
    members, accs = [], []
    for k in range(n):
        rm = reward_model_from(sft, stage_seed(cfg.seed, f"audit_rm_init_{k}"))
        train_reward_model(rm, encode_pairs(tok, pairs[k * per:(k + 1) * per]), evals, cfg.rm,
                           seed=stage_seed(cfg.seed, f"audit_rm_train_{k}"), pad_id=tok.pad_token_id, progress=progress)
        name = f"rm{k}"
        rm.save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
        members.append(name)
        accs.append(round(accuracy(score_diffs(rm, evals, tok.pad_token_id)), 6))
    (tmp / AUDIT_FILE).write_text(json.dumps({
        "world_config": w.config_hash, "world_content": content_hash(world_dir), "members": members,
        "pairs_per_member": per, "eval_acc": accs, "build_s": round(time.perf_counter() - t0, 1)}, indent=1) + "\n")
    if progress:
        print(f"[world] audit RMs: {n} x {per} pairs, held-out accuracy {', '.join(f'{a:.3f}' for a in accs)} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
