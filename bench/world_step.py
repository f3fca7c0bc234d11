"""World-scale PPO step: time and model FLOPs per phase, and MFU against the fp32 matmul peak
measured in the same run (issue 14). Optionally the same measurement of an older commit, alternating.

    python -m bench.world_step [--baseline REV] [--compare-set KEY=VALUE] [--reps 3] [--steps 20] [--out bench/results_world.json]

The workload is what users run every day: the embedded world's models (GPT-2 3 x 128, vocab 188),
`ablations/bases/vanilla.yaml` (batch 32, 24-token cap, 2 epochs x 2 minibatches, fp32), 1 torch
thread. Each tree runs in its own process (`--child`), importing `harness` from that tree.

FLOPs count the model work the configured algorithm needs on REAL tokens (bench.common's per-token
formulas, multiply-add = 2): left-pad and right-pad positions, finished rows still decoded and the
LM head on positions whose logits are unused are not counted, so work on padding lowers MFU.
  rollout  sampling: prompt prefill + one single-token step per real response token but the last
  scoring  policy pass for the old log-probs (default math: ppo.reuse_rollout_logprobs=false),
           reference pass (LM head at the response), reward-model and critic trunks
  update   ppo_epochs x (policy + critic) forward and backward (backward = 2x forward)
The world must be built (`python -m harness.world build`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def world_trainer(world: str, steps: int, extra: list[str] | None = None):
    """The benchmarks' world-scale workload in this process: a PPOTrainer on
    `ablations/bases/vanilla.yaml` in `world` for `steps` steps, seed 0, 1 torch thread, logging
    into a temporary folder; `extra`: config overrides on top."""
    import torch

    torch.set_num_threads(1)
    import harness.data as hd
    from harness.config import load_config
    from harness.models import Models
    from harness.trainer import PPOTrainer

    d = tempfile.mkdtemp()
    cfg = load_config(str(REPO / "ablations/bases/vanilla.yaml"), [
        f"ppo.steps={steps}", f"data.world_dir={world}", f"logging.tracking_uri=sqlite:///{d}/m.db",
        f"logging.output_dir={d}/runs", "threads=1", "seed=0", *(extra or [])])
    dev = torch.device("cpu")
    return PPOTrainer(cfg, Models(cfg, dev), hd.load_source(cfg), dev)


def lengths(b) -> dict[str, list[int]]:
    """Each row's real prompt and response lengths of a step's batch (what `flops` counts)."""
    return {"prompt": b.rollout.prompt_mask.sum(1).tolist(), "response": b.rollout.response_mask.sum(1).tolist()}


def run_config(trainer) -> dict:
    """What `flops` needs of the trainer's config besides the lengths."""
    p = trainer.cfg.ppo
    return {"epochs": p.ppo_epochs, "reuse": p.reuse_rollout_logprobs, "critic": trainer.critic is not None}


def world_size(world: str):
    """The world's model size (bench.common.Size) from its SFT model's config."""
    from bench.common import Size

    mc = json.loads((Path(world) / "sft" / "config.json").read_text())
    return Size("world", mc["n_layer"], mc["n_embd"], mc["vocab_size"], mc["n_head"], mc["n_positions"])


def child(world: str, steps: int, warmup: int, extra: list[str] | None = None) -> dict:
    """Run warmup + steps world-scale steps in this process; per step: phase timers, CPU time and
    each row's real prompt and response lengths."""
    trainer = world_trainer(world, steps + warmup, extra)
    out = []
    for i in range(steps + warmup):
        c0 = time.process_time()
        m, b = trainer.step()
        if i >= warmup:
            out.append({"cpu_s": time.process_time() - c0, **lengths(b),
                        **{k.split("/")[-1]: m[k] for k in m if k.startswith("perf/time_") or k == "perf/step_s"}})
    return {"steps": out, "config": run_config(trainer)}


def flops(step: dict, conf: dict, size) -> dict[str, float]:
    from bench.common import fwd_flops, sampling_flops

    lm = trunk = rollout = 0.0
    for p, r in zip(step["prompt"], step["response"]):
        lm += fwd_flops(size, 1, p + r, lm_positions=r)
        trunk += fwd_flops(size, 1, p + r)
        rollout += sampling_flops(size, 1, p, r)
    critic = trunk if conf["critic"] else 0.0
    return {"rollout": rollout, "score": (0.0 if conf["reuse"] else lm) + lm + trunk + critic,
            "update": conf["epochs"] * 3 * (lm + critic)}


def measure(tree: Path, world: str, steps: int, warmup: int, extra: list[str]) -> dict:
    from bench.common import in_tree

    return in_tree(tree, "world_step", f"child({world!r}, {steps}, {warmup}, {extra!r})")


def summarize(runs: list[dict], size, peak: float) -> dict:
    med = statistics.median
    phases = {"rollout": "time_rollout_s", "score": "time_score_s", "update": "time_update_s"}
    out: dict = {}
    for ph, key in phases.items():
        t = med(s[key] for r in runs for s in r["steps"])
        f = med(flops(s, r["config"], size)[ph] for r in runs for s in r["steps"])
        out[ph] = {"s": t, "gflop": f / 1e9, "gflops": f / t / 1e9, "mfu": f / t / 1e9 / peak}
    t = med(s["step_s"] for r in runs for s in r["steps"])
    f = med(sum(flops(s, r["config"], size).values()) for r in runs for s in r["steps"])
    out["step"] = {"s": t, "gflop": f / 1e9, "gflops": f / t / 1e9, "mfu": f / t / 1e9 / peak,
                   "cpu_s": med(s["cpu_s"] for r in runs for s in r["steps"])}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.world_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default=".harness/world", help="built world directory (default .harness/world)")
    ap.add_argument("--baseline", metavar="REV", help="also measure this git revision (e.g. a commit before the change)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions, alternating the trees' order (default 3)")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per repetition (default 20)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="bench/results_world.json")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every tree, e.g. model.autocast=bf16 (repeatable)")
    ap.add_argument("--compare-set", dest="compare", action="append", default=[], metavar="KEY=VALUE",
                    help="also measure the current tree with these overrides on top (repeatable), e.g. "
                         "--compare-set model.autocast=bf16: an option's speed against the default")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench.common import trees as trees_of
    from bench.peak import measure as peak_of
    from bench.run_all import load_avg, machine, versions

    world = str(Path(a.world).resolve())
    size = world_size(world)
    tmp = tempfile.TemporaryDirectory(prefix="bench_base_")
    trees = trees_of(a.baseline, tmp.name)
    extra = {name: a.overrides for name in trees}
    if a.compare:
        name = "current " + " ".join(a.compare)
        trees[name], extra[name] = REPO, a.overrides + a.compare
    res: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), "versions": versions(),
                 "argv": sys.argv[1:], "load_before": load_avg(), "peak": [], "runs": {k: [] for k in trees}}
    res["peak"].append(peak_of(threads=1))
    for rep in range(a.reps):
        for name in (list(trees) if rep % 2 == 0 else list(trees)[::-1]):
            r = measure(trees[name], world, a.steps, a.warmup, extra[name])
            res["runs"][name].append(r)
            print(f"[bench] rep {rep} {name}: median step "
                  f"{statistics.median(s['step_s'] for s in r['steps']):.3f} s", flush=True)
    res["peak"].append(peak_of(threads=1))
    pk = max(p["peak_gflops"] for p in res["peak"])
    res["peak_fp32_gflops_1thread"] = pk
    res["summary"] = {name: summarize(runs, size, pk) for name, runs in res["runs"].items()}
    res["load_after"] = load_avg()
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"\nfp32 matmul peak, 1 thread (best of start/end): {pk:.1f} GFLOP/s; load {res['load_before']} -> "
          f"{res['load_after']}; CPU: {res['machine'].get('cpu')} {res['machine'].get('isa')}")
    print("| tree | phase | s/step | GFLOP (real tokens) | GFLOP/s | MFU |\n|---|---|---|---|---|---|")
    for name, sm in res["summary"].items():
        for ph, v in sm.items():
            print(f"| {name} | {ph} | {v['s']:.4f} | {v['gflop']:.2f} | {v['gflops']:.1f} | {100 * v['mfu']:.1f}% |")
    for name in list(trees)[1:]:
        other = res["summary"][name]["step"]["s"]
        print(f"\nstep time of {name} / current: {other / res['summary']['current']['step']['s']:.2f}x")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
