"""Build, cache and load the embedded world. `build_world` runs the stages into a temporary folder
beside `out_dir` and renames it into place only when complete, so a killed build never leaves half
a world; a later call with the same config (its hash is in world.json) returns at once. Of the
files, only build_info.json (timings, MLflow run id, CPU) differs between identical builds on one
kind of CPU. A config the project ships a world for (harness/world/shipped.py) is unpacked, not
built, unless `shipped=False`: another CPU builds other weights from the same config.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml
from filelock import FileLock
from transformers import GPT2LMHeadModel
from transformers.utils import logging as hf_logging

from harness import keys, provenance, statefile, tracking
from harness.config import flatten, to_dict
from harness.world import corpus, grammar
from harness.world import shipped as shipped_worlds
from harness.world.config import WORLD_FORMAT, WorldConfig, world_config_from_dict, world_config_hash
from harness.world.gold import gold_reward
from harness.world.lm import gpt2_config, mean_response_nll, sample_ids, train_causal_lm, train_tokenizer
from harness.world.preferences import Pair, make_pairs
from harness.world.reward_model import accuracy, encode_pairs, reward_model_from, score_diffs, train_reward_model

WORLD_FILE = "world.json"
INFO_FILE = "build_info.json"
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


def stage_seed(seed: int, stage: str) -> int:
    """An independent, reproducible seed per stage, so changing one stage leaves the others' draws alone."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{stage}".encode()).digest()[:4], "big") & 0x7FFFFFFF


def _write(path: Path, obj: Any) -> None:
    """JSON (indented, keys sorted), or for .jsonl one JSON value per line."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in obj))
    else:
        path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[world] {msg}", flush=True)  # lines, never bar frames: build logs are read as files


def _build_into(tmp: Path, cfg: WorldConfig, chash: str, run_id: str | None,
                progress: bool) -> list[tuple[str, float, int]]:
    """Run every stage into `tmp`, world.json last (its presence marks a complete world). Returns
    the (key, value, step) metrics of the build's MLflow run: LM loss curves (every 10th step and
    the last), the RM's records and the final numbers."""
    points: list[tuple[str, float, int]] = []
    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}
    start = clock = (time.perf_counter(), time.process_time())

    def lap(name: str) -> None:
        # Wall and CPU time: on shared cores the wall clock mostly measures the neighbours.
        nonlocal clock
        now = (time.perf_counter(), time.process_time())
        timings[name], cpu[name] = round(now[0] - clock[0], 3), round(now[1] - clock[1], 3)
        clock = now
        _log(progress, f"{name}: {timings[name]:.1f}s (cpu {cpu[name]:.1f}s)")

    def rng(stage: str) -> random.Random:
        return random.Random(stage_seed(cfg.seed, stage))

    def curve(key: str, values: list[float]) -> None:
        points.extend((key, v, i) for i, v in enumerate(values, 1) if i % 10 == 0 or i == len(values))

    # 1. Text, generated by code.
    data = tmp / "data"
    data.mkdir()
    train_specs, eval_specs = corpus.split_prompts(rng("prompts"), cfg.task)
    docs = corpus.pretrain_docs(rng("pretrain_docs"), cfg.corpus.pretrain_docs)
    sft = corpus.sft_pairs(rng("sft"), train_specs, cfg.corpus.sft_examples, cfg.task)
    # Fresh reviews of held-out prompts: the SFT model's generalization check.
    sft_eval = corpus.sft_pairs(rng("sft_eval"), eval_specs, 500, cfg.task)
    train_prompts = [s.text for s in train_specs]
    eval_prompts = [s.text for s in eval_specs]
    _write(data / "train_prompts.json", train_prompts)
    _write(data / "eval_prompts.json", eval_prompts)
    _write(data / "sft_pairs.jsonl", sft)
    (data / "pretrain.txt").write_text("".join(d + "\n" for d in docs))
    lap("corpus")

    # 2. Tokenizer over every word of the grammar, drawn by the corpora or not; it travels with every model.
    tok = train_tokenizer(docs + [f"{p} {r}" for p, r in sft] + [" ".join(grammar.vocabulary())])
    for name in HF_DIRS:
        tok.save_pretrained(tmp / name)
    lap("tokenizer")

    # 3. Pretrained LM on the generic corpus.
    torch.manual_seed(stage_seed(cfg.seed, "init"))  # weight init draws from the global generator
    lm = GPT2LMHeadModel(gpt2_config(cfg.model, len(tok), tok.pad_token_id, tok.eos_token_id))
    lm_args = dict(pad_id=tok.pad_token_id, progress=progress)
    pre_examples = [(tok(d)["input_ids"] + [tok.eos_token_id], 0) for d in docs]
    curve(keys.PRETRAIN_LOSS, train_causal_lm(lm, pre_examples, cfg.pretrain, desc="pretrain",
                                              seed=stage_seed(cfg.seed, "pretrain"), **lm_args))
    lm.save_pretrained(tmp / "pretrained")
    lap("pretrain")

    # 4. SFT: continue from the pretrained weights, loss on response tokens and EOS only.
    sft_examples = [sample_ids(tok, p, r, True) for p, r in sft]
    curve(keys.SFT_LOSS, train_causal_lm(lm, sft_examples, cfg.sft, desc="sft",
                                         seed=stage_seed(cfg.seed, "sft_train"), **lm_args))
    sft_eval_nll = mean_response_nll(lm, [sample_ids(tok, p, r, True) for p, r in sft_eval], tok.pad_token_id)
    lm.save_pretrained(tmp / "sft")
    lap("sft")

    # 5. Preference pairs sampled from the SFT model, labeled by the noisy judge.
    pairs, skipped = {}, 0
    for split, prompts in (("train", train_prompts), ("eval", eval_prompts)):
        pairs[split], skips = make_pairs(lm, tok, prompts, getattr(cfg.prefs, f"{split}_pairs"), cfg.prefs, cfg.gold,
                                         cfg.task.max_new_tokens, seed=stage_seed(cfg.seed, f"pairs_{split}"),
                                         desc=f"pairs ({split})", progress=progress)
        _write(data / f"prefs_{split}.jsonl", [asdict(p) for p in pairs[split]])
        skipped += skips
    train_pairs, eval_pairs = pairs["train"], pairs["eval"]
    lap("pairs")

    # 6. Reward model from the SFT trunk.
    rm = reward_model_from(lm, stage_seed(cfg.seed, "rm_init"))
    enc_eval = encode_pairs(tok, eval_pairs)
    hist = train_reward_model(rm, encode_pairs(tok, train_pairs), enc_eval, cfg.rm,
                              seed=stage_seed(cfg.seed, "rm_train"), pad_id=tok.pad_token_id, progress=progress)
    points += rm_points(hist)
    rm.save_pretrained(tmp / "reward")
    lap("reward_model")

    # 7. The numbers that say how good (and how fallible) the reward model is.
    diffs = score_diffs(rm, enc_eval, tok.pad_token_id)
    vs_gold = [d if p.gold_chosen > p.gold_rejected else -d
               for d, p in zip(diffs, eval_pairs) if p.gold_chosen != p.gold_rejected]
    normal = [p for p in eval_pairs if not p.corrupted]
    sft_golds = [p.gold_chosen for p in normal] + [p.gold_rejected for p in normal]
    sft_ended = [p.chosen_ended for p in normal] + [p.rejected_ended for p in normal]
    metrics = {
        keys.RM_EVAL_ACC: accuracy(diffs),
        keys.RM_TRAIN_ACC: hist["train_acc"][-1],
        keys.RM_EVAL_ACC_GOLD: accuracy(vs_gold),
        # The best accuracy any reward model can reach on these noisy labels.
        keys.RM_LABEL_CEILING: accuracy([p.gold_chosen - p.gold_rejected for p in eval_pairs]),
        # The same in expectation over the judge's coin flips: a label follows the likelier side with
        # probability max(p, 1 - p), p = p_chosen (gold ties count half).
        keys.RM_LABEL_CEILING_EXPECTED: sum(max(p.p_chosen, 1 - p.p_chosen) if p.gold_chosen != p.gold_rejected
                                            else 0.5 for p in eval_pairs) / len(eval_pairs),
        keys.SFT_GOLD_MEAN: sum(sft_golds) / max(1, len(sft_golds)),
        keys.SFT_ENDED_FRAC: sum(sft_ended) / max(1, len(sft_ended)),
        keys.SFT_EVAL_NLL: sft_eval_nll,
    }
    metrics = {k: round(float(v), 6) for k, v in metrics.items()}
    diff_doc = {"diff": [round(d, 6) for d in diffs], "corrupted": [p.corrupted for p in eval_pairs]}
    _write(data / keys.RM_SCORE_DIFF, diff_doc)
    _write(data / "rm_history.json", hist)
    lap("evaluate")
    timings["total"] = round(time.perf_counter() - start[0], 3)
    cpu["total"] = round(time.process_time() - start[1], 3)
    final = {k: v for k, v in metrics.items() if k not in (keys.RM_EVAL_ACC, keys.RM_TRAIN_ACC)}
    points += [(k, v, cfg.rm.steps) for k, v in (final | {keys.WORLD_BUILD_S: timings["total"]}).items()]

    (tmp / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    _write(tmp / INFO_FILE, {
        "timings_s": timings, "cpu_s": cpu, "mlflow_run_id": run_id, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "skipped_identical_pairs": skipped, "torch_threads": torch.get_num_threads(), "cpu": provenance.cpu(),
    })
    _write(tmp / WORLD_FILE, {
        "format": WORLD_FORMAT, "config_hash": chash, "config": to_dict(cfg), "metrics": metrics,
        "vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
        "n_train_prompts": len(train_prompts), "n_eval_prompts": len(eval_prompts),
    })
    return points


def rm_points(hist: dict[str, list[float]]) -> list[tuple[str, float, int]]:
    """The RM's training curves (data/rm_history.json) as (metric key, value, RM step) points."""
    rm_keys = {keys.RM_TRAIN_ACC: "train_acc", keys.RM_EVAL_ACC: "eval_acc", keys.RM_TRAIN_LOSS: "train_loss"}
    return [(k, hist[v][j], step) for j, step in enumerate(hist["steps"]) for k, v in rm_keys.items()]


def _swap_in(tmp: Path, out: Path) -> None:
    """A complete world folder `tmp` becomes `out`, replacing an older world there."""
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _unpack_into(out: Path, wcfg: WorldConfig, chash: str, entry: dict[str, Any], progress: bool,
                 tracking_uri: str | None, run_tags: dict[str, str], experiment: str,
                 parent_run_id: str | None) -> Path:
    """The shipped world of `chash` into `out` (we hold its lock): unpacked beside it, checked, renamed
    in. With a tracking URI, one world run as a build logs it, from the files the build left (the RM's
    curves in data/rm_history.json, its final numbers, rm_score_diff.json); the LM loss curves are not
    kept, and the run says it was unpacked (tag harness.world_shipped: the content hash)."""
    tmp = out.parent / f".{out.name}.building-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    try:
        shipped_worlds.unpack(chash, tmp)
        _swap_in(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, shipped_worlds.ShippedWorldError):
            raise WorldError(str(e)) from None
        raise
    _log(progress, f"world {chash}: unpacked the shipped one (content {entry['content']}, built on "
                   f"{entry['built_on']['cpu.model']}) into {out} in {time.perf_counter() - t0:.1f}s; "
                   "build it on this CPU instead with --no-shipped")
    if tracking_uri:
        run_id = tracking.start_run(tracking_uri, experiment, f"world-{chash}",
                                    {**run_tags, keys.TAG_WORLD_SHIPPED: entry["content"]}, parent_run_id)
        tracking.log_params(tracking_uri, run_id, flatten(to_dict(wcfg)))
        points = rm_points(json.loads((out / "data" / "rm_history.json").read_text()))
        final = {k: v for k, v in entry["metrics"].items() if k not in (keys.RM_EVAL_ACC, keys.RM_TRAIN_ACC)}
        tracking.MetricLogger(tracking_uri, run_id).log_points(points + [(k, v, wcfg.rm.steps) for k, v in final.items()])
        tracking.log_file_artifacts(tracking_uri, run_id, [out / "data" / keys.RM_SCORE_DIFF, out / WORLD_FILE])
        tracking.end_run(tracking_uri, run_id, "FINISHED")
    return out


def build_world(
    wcfg: WorldConfig,
    out_dir: str | Path,
    *,
    tracking_uri: str | None = None,
    experiment: str = "world",
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
    progress: bool = True,
    force: bool = False,
    shipped: bool = True,
) -> Path:
    """Build the world for `wcfg` into `out_dir`, or return at once if it is already there (`force`:
    rebuild anyway); one builder per folder at a time, as parallel workers may all ask for it. With a
    tracking URI the build is one MLflow run in `experiment` (tag harness.role=world) with the RM
    curves, final numbers and rm_score_diff.json. A config the project ships a world of is unpacked
    from its archive instead (`shipped`: False builds it on this CPU)."""
    out = Path(out_dir).resolve()
    chash = world_config_hash(wcfg)
    entry = shipped_worlds.shipped(chash) if shipped else None
    if not force and built_hash(out) == chash:
        if entry and (content := shipped_worlds.content_hash(out)) != entry["content"]:
            _log(progress, f"note: {out} holds a world of config {chash} built on a CPU, not the shipped one (content "
                           f"{content}, shipped {entry['content']}); runs on it compare with "
                           f"the reference only within the world-to-world spread. The shipped one: "
                           f"python -m harness.world build --out {out} --force")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if not force and built_hash(out) == chash:  # another process built it while we waited
            return out
        if out.exists() and not (out / WORLD_FILE).exists() and any(out.iterdir()):
            raise WorldError(f"out_dir {str(out)!r} exists, is not empty and holds no world; "
                             "allowed: an empty folder, a world folder, or a new path")
        for stale in out.parent.glob(f".{out.name}.building-*"):  # left by killed builds (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tags = {keys.TAG_ROLE: "world", keys.TAG_CONFIG_HASH: chash, keys.TAG_SEED: str(wcfg.seed),
                keys.TAG_COMMIT: tracking.git_commit(), **(tags or {})}
        if entry:
            return _unpack_into(out, wcfg, chash, entry, progress, tracking_uri, tags, experiment, parent_run_id)
        run_id = None
        if tracking_uri:
            run_id = tracking.start_run(tracking_uri, experiment, f"world-{chash}", tags, parent_run_id)
            tracking.log_params(tracking_uri, run_id, flatten(to_dict(wcfg)))
        tmp = out.parent / f".{out.name}.building-{uuid.uuid4().hex[:8]}"
        _log(progress, f"building world {chash} into {out}")
        threads, bars = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
        try:
            tmp.mkdir()
            # One thread, always: float reductions split over several threads round differently,
            # and the world must be the same whatever thread count the caller runs with (these
            # 128-wide models gain little from more threads anyway). No per-save progress bars.
            torch.set_num_threads(1)
            hf_logging.disable_progress_bar()
            points = _build_into(tmp, wcfg, chash, run_id, progress)
            _swap_in(tmp, out)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            killed = isinstance(e, KeyboardInterrupt)
            if run_id and not killed:
                tracking.set_tags(tracking_uri, run_id, {keys.TAG_FAILURE: f"{type(e).__name__}: {e}"[:5000]})
            if run_id:
                tracking.end_run(tracking_uri, run_id, "KILLED" if killed else "FAILED")
            raise
        finally:
            torch.set_num_threads(threads)
            if bars:
                hf_logging.enable_progress_bar()
        if run_id:
            tracking.MetricLogger(tracking_uri, run_id).log_points(points)
            tracking.log_file_artifacts(tracking_uri, run_id, [out / "data" / keys.RM_SCORE_DIFF, out / WORLD_FILE])
            tracking.end_run(tracking_uri, run_id, "FINISHED")
        _log(progress, f"world ready: {out}")
        return out
