"""Synthetic finished ablations written straight into an MLflow store, in the trainer's and the
ablation runner's formats (harness/keys.py), for the tests of analysis/ and reports/ and for
previews (`python -m analysis.synthetic --tracking-uri sqlite:///demo.db` writes vanilla, kl_eta
and rm_scores, see reports/README.md).

Curves are shaped like the paper's (paper-notes section 6): reward rises; a collapsing variant's
reward shoots up after `collapse_at` while gold reward falls, KL climbs, perplexity drops toward
1 and length runs to the cap.

Worlds: `write_worlds` writes one grid per world seed, as the runner's `--worlds 0,1,2` does: its
runs carry the world's hash (`provenance.world.hash`, `world_hash`) and the tag harness.world_seed,
with each world's own curves (an effect that holds, shrinks or flips per world; `Curve.offset`
moves a whole world) and noise. World seed 0 draws the same noise as an untagged grid.
"""
from __future__ import annotations

import argparse
import zlib
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from analysis.store import WORLD_SEED_TAG
from harness import keys as K
from harness import tracking

LENGTH_CAP = 24


@dataclass
class Curve:
    """How one variant's runs evolve; every seed adds its own noise and a small offset."""

    reward_slope: float = 0.02
    kl_slope: float = 0.004
    collapse_at: int | None = None
    noise: float = 0.02
    seed_spread: float = 0.0
    """Per-seed offset scale added to reward and KL (wide = claims turn inconclusive)."""
    gold_fall: float = 0.2
    """Gold lost per step after `collapse_at` (0: gold holds while the indicators collapse)."""
    warn_at: int | None = None
    """The step the early-warning detector warns (logged as collapse/warning_step), or None."""
    ppl_spikes: bool = False
    """Per-sample perplexity jumps to 50 on odd steps (one unlikely short response); the token-pooled one does not."""
    batch: int = 32
    """Responses per step: response/sampled_tokens grows by batch x mean length per step."""
    offset: float = 0.0
    """Added to every run's reward (and a tenth of it to KL): a world's level, shared by its seeds."""


def step_metrics(curve: Curve, step: int, steps: int, rng: np.random.Generator, seed_offset: float,
                 gold: bool = True) -> dict[str, float]:
    t = float(step)
    after = max(0.0, t - curve.collapse_at) if curve.collapse_at is not None else 0.0
    frac = t / max(steps, 1)
    e = lambda s=1.0: float(rng.normal(0, curve.noise * s))  # noqa: E731
    reward = 0.5 + curve.reward_slope * t + 0.3 * after + seed_offset + e()
    kl = curve.kl_slope * t + 0.05 * after + 0.1 * seed_offset + e(0.1)
    ppl = max(1.002, 3.0 - 0.8 * frac - 0.3 * after) + e(0.1)
    ppl_tokens = max(1.001, 0.95 * ppl)
    ppl = 50.0 if curve.ppl_spikes and step % 2 else ppl
    length = min(LENGTH_CAP, 10 + 4 * frac + 2.0 * after) + e(5)
    m = {
        K.RM_SCORE: reward, K.RM_SCORE_STD: 0.5, K.KL: kl, K.KL_K3: abs(kl), K.PPL: ppl, K.PPL_TOKENS: ppl_tokens,
        K.PPL_REF: ppl + 0.5, K.LENGTH: length, K.LENGTH_MAX: min(LENGTH_CAP, length + 4),
        K.FRAC_AT_CAP: 1.0 if after > 3 else 0.05, K.PG_LOSS: -0.01 + e(), K.VF_LOSS: 0.2 * np.exp(-frac) + abs(e()),
        K.VALUES: 0.3 * reward + e(), K.RETURNS: 0.35 * reward + e(), K.ADV_MEAN: e(0.5), K.ADV_STD: 1.0,
        K.ADV_RAW_MEAN: e(), K.ADV_RAW_STD: 0.5 + frac, K.ENTROPY: 2.0 - frac + e(), K.KL_COEF: 0.05,
        K.APPROX_KL: 0.001 + abs(e(0.05)),
    }
    if gold:
        m[K.GOLD_SCORE] = 0.3 + 0.5 * curve.reward_slope * t - curve.gold_fall * after + e()
    return m


def _log_all(tracking_uri: str, run_id: str, per_step: dict[int, dict[str, float]]) -> None:
    points = [(k, v, s) for s, ms in per_step.items() for k, v in ms.items()]
    tracking.MetricLogger(tracking_uri, run_id).log_points(points)


def _samples(variant: str, step: int, collapsed: bool, metrics: dict[str, float], n: int = 3) -> dict:
    # a collapsed response runs on past the report's clip, with one word too long to wrap
    rows = [{"prompt": f"prompt {i}: please explain item {i}", "rm_score": metrics[K.RM_SCORE],
             "response": "great " * 60 + "!!!" + "a" * 200 if collapsed else f"({variant}) a short helpful answer "
                                                                               f"number {i}, step {step}.",
             "gold_score": metrics.get(K.GOLD_SCORE), "length": metrics[K.LENGTH]} for i in range(n)]
    return {"step": step, "rows": rows}


def world_hash(world_seed: int) -> str:
    """A stand-in for a built world's config hash (16 hex digits), one per world seed."""
    return f"{zlib.crc32(f'world {world_seed}'.encode()):08x}{zlib.crc32(f'seed {world_seed}'.encode()):08x}"


def world_provenance(world_seed: int) -> dict[str, str]:
    """The `provenance.world.*` tags (prefix dropped) of a synthetic world: its hash and an RM accuracy of its own."""
    return {"world.hash": world_hash(world_seed), "world.rm/eval_acc": f"{0.74 - 0.01 * world_seed:.4g}"}


def _world_tags(world_seed: int | None) -> dict[str, str]:
    return {} if world_seed is None else {WORLD_SEED_TAG: str(world_seed),
                                          **{f"provenance.{k}": v for k, v in world_provenance(world_seed).items()}}


def _noise(key: str, world_seed: int | None) -> np.random.Generator:
    """The run's noise: world seed 0 (or none) draws that of the untagged grid, the others their own."""
    return np.random.default_rng(zlib.crc32((key + (f"/world {world_seed}" if world_seed else "")).encode()))


def _parent(tracking_uri: str, name: str, figure: str) -> str:
    return tracking.start_run(tracking_uri, name, f"{name}-parent",
                              tags={K.TAG_ROLE: "parent", K.TAG_ABLATION: name, K.TAG_FIGURE: figure})


def write_ablation(tracking_uri: str, name: str, figure: str, curves: dict[str, Curve], *, seeds=(0, 1),
                   steps: int = 30, sample_every: int = 10, eval_every: int = 0, gold: bool = True,
                   win_rate: bool = False, old_seeds=(), provenance: dict[str, str] | None = None,
                   world_seed: int | None = None) -> str:
    """A parent run (harness.role=parent) in experiment `name` and one finished child run per
    (variant, seed); returns the parent run id. Runs of `old_seeds` imitate a harness from before
    objective/ppl_tokens existed (they do not log it). `provenance`: more `provenance.*` tags
    (without the prefix) on every child run, e.g. {"cpu.model": ...}, over those of `world_seed`
    (world_provenance, and harness.world_seed; None: no world tags)."""
    parent = _parent(tracking_uri, name, figure)
    for vi, (variant, curve) in enumerate(curves.items()):
        for seed in seeds:
            rng = _noise(f"{name}/{variant}/{seed}", world_seed)
            offset = float(rng.normal(0, curve.seed_spread)) if curve.seed_spread else 0.0
            offset += curve.offset
            rid = tracking.start_run(tracking_uri, name, f"{name}-{vi}-s{seed}", parent_run_id=parent, tags={
                K.TAG_ROLE: "train", K.TAG_ABLATION: name, K.TAG_FIGURE: figure, K.TAG_VARIANT: variant,
                K.TAG_SEED: str(seed), K.TAG_COMMIT: "synthetic", "provenance.commit": "synthetic",
                **_world_tags(world_seed), **{f"provenance.{k}": v for k, v in (provenance or {}).items()},
            })
            collapsed = curve.collapse_at is not None and curve.collapse_at <= steps
            after = (lambda s: max(0, s - curve.collapse_at)) if collapsed else (lambda s: 0)  # noqa: E731
            per_step = {s: step_metrics(curve, s, steps, rng, offset, gold) for s in range(1, steps + 1)}
            tokens = 0.0
            for s, m in per_step.items():
                tokens += curve.batch * m[K.LENGTH]
                m[K.SAMPLED_TOKENS] = tokens
                if seed in old_seeds:
                    del m[K.PPL_TOKENS]
                if win_rate and s % 5 == 0:
                    m[K.EVAL_WIN_RATE] = float(np.clip(0.5 + 0.01 * s - 0.05 * after(s), 0, 1))
            if collapsed:
                per_step[curve.collapse_at][K.COLLAPSE_STEP] = curve.collapse_at
                if gold and curve.gold_fall:  # as the trainer logs the gold truth: the onset's step, as a value
                    per_step[curve.collapse_at][K.GOLD_ONSET] = curve.collapse_at
            if curve.warn_at is not None and curve.warn_at <= steps:
                per_step[curve.warn_at][K.WARNING_STEP] = curve.warn_at
            _log_all(tracking_uri, rid, per_step)
            for s in sorted({*(range(sample_every, steps + 1, sample_every) if sample_every else []), steps}):
                late = collapsed and s >= curve.collapse_at
                tracking.log_json_artifact(tracking_uri, rid, _samples(variant, s, late, per_step[s]),
                                           f"{K.SAMPLES_DIR}/step_{s:06d}.json")
            if eval_every:
                for s in range(eval_every, steps + 1, eval_every):
                    rm = rng.normal(per_step[s][K.RM_SCORE], 0.5, 64)
                    rm[:16] += rng.exponential(0.5 + 0.4 * min(after(s), 10), 16)  # Fig. 13's long tail
                    tracking.log_json_artifact(tracking_uri, rid, {"step": s, "rm": rm.tolist(), "gold": []},
                                               f"{K.EVAL_SCORES_DIR}/rm_scores_step_{s:06d}.json")
            tags = {K.TAG_COLLAPSED: str(collapsed).lower()}
            if eval_every and gold:  # the best eval gold before collapse, as harness.train keeps it
                evals = [s for s in range(eval_every, steps + 1, eval_every) if not after(s)]
                tags[K.TAG_BEST_STEP] = str(max(evals, key=lambda s: per_step[s][K.GOLD_SCORE], default=0))
            tracking.set_tags(tracking_uri, rid, tags)
            tracking.end_run(tracking_uri, rid)
    tracking.end_run(tracking_uri, parent)
    return parent


def write_world_ablation(tracking_uri: str, name: str, figure: str, rms: dict[str, float], *, rm_steps: int = 20,
                         pairs: int = 200, world_seed: int | None = None) -> str:
    """World runs (harness.role=world) under a parent, one per RM; `rms` maps the RM's name to
    its final held-out accuracy, which shapes both the accuracy curves and the score differences;
    `world_seed`: the world's tags, as in write_ablation."""
    parent = _parent(tracking_uri, name, figure)
    for vi, (variant, acc) in enumerate(rms.items()):
        rng = _noise(f"{name}/{variant}", world_seed)
        rid = tracking.start_run(tracking_uri, name, f"{name}-world-{vi}", parent_run_id=parent, tags={
            K.TAG_ROLE: "world", K.TAG_ABLATION: name, K.TAG_FIGURE: figure, K.TAG_VARIANT: variant, K.TAG_SEED: "0",
            **_world_tags(world_seed),
        })
        _log_all(tracking_uri, rid, {s: {
            K.RM_TRAIN_ACC: 0.5 + (acc + 0.05 - 0.5) * s / rm_steps, K.RM_EVAL_ACC: 0.5 + (acc - 0.5) * s / rm_steps,
            K.RM_TRAIN_LOSS: 0.69 * (1 - 0.5 * s / rm_steps)} for s in range(1, rm_steps + 1)})
        mu = NormalDist().inv_cdf(min(max(acc, 0.01), 0.99))  # a normal with P(diff > 0) = acc: mean = Phi^-1(acc)
        tracking.log_json_artifact(tracking_uri, rid, {"diff": rng.normal(mu, 1.0, pairs).tolist()}, K.RM_SCORE_DIFF)
        tracking.end_run(tracking_uri, rid)
    tracking.end_run(tracking_uri, parent)
    return parent


def write_worlds(tracking_uri: str, name: str, figure: str, per_world: list[dict[str, Curve]], **kw) -> list[str]:
    """One grid per world, world seed i with the curves per_world[i] (the runner's `--worlds 0,1,...`);
    `kw`: write_ablation's. Returns the parent run ids."""
    return [write_ablation(tracking_uri, name, figure, curves, world_seed=i, **kw)
            for i, curves in enumerate(per_world)]


def write_demo(tracking_uri: str) -> list[str]:
    """A few paper-shaped ablations for previewing figures and reports; returns their names."""
    write_ablation(tracking_uri, "vanilla", "4", {"vanilla PPO": Curve(collapse_at=40)}, seeds=range(5), steps=60,
                   eval_every=10, win_rate=True)
    write_ablation(tracking_uri, "kl_eta", "15", {
        "KL penalty η=0.05": Curve(kl_slope=0.006), "KL penalty η=0.1": Curve(kl_slope=0.004),
        "KL penalty η=0.2": Curve(kl_slope=0.002),
    }, seeds=range(5), steps=60)
    write_world_ablation(tracking_uri, "rm_scores", "2", {"reward model": 0.8, "reward model, 1/4 of the pairs": 0.65})
    return ["vanilla", "kl_eta", "rm_scores"]


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    ap = argparse.ArgumentParser(prog="python -m analysis.synthetic", description=__doc__)
    ap.add_argument("--tracking-uri", required=True, help="MLflow store to write to, e.g. sqlite:///demo.db")
    args = ap.parse_args(argv)
    names = write_demo(args.tracking_uri)
    print(f"wrote {', '.join(names)} to {args.tracking_uri}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
