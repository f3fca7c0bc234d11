"""Times harness PPO steps on a benchmark model directory (runs in the main venv).

`python -m bench.harness_step --models DIR --steps N --warmup W [--set key=value ...]`
prints one JSON line: per-step wall times (between consecutive `on_step` callbacks, so each one
holds the trainer's step plus the MLflow log_batch and collapse rule), the trainer's phase timers,
the logging time of each step, peak RSS (and peak GPU memory, on a GPU: `--set device=cuda`) and
the last step's metrics.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def bench_config(models: Path, steps: int, workdir: Path, overrides: list[str]):
    from bench.common import BATCH, MINIBATCHES, PPO_EPOCHS, RESPONSE_LEN, THREADS

    base = {
        "seed": 0, "device": "cpu", "threads": THREADS,
        "model": {"sft_path": str(models / "sft"), "reward_path": str(models / "reward"), "critic_init": "reward"},
        # the prompt source is swapped in below (PromptSource over prompts.json); hh_path only satisfies validation
        "data": {"source": "hh_rlhf", "hh_path": str(models / "prompts.json"), "max_prompt_tokens": 64, "eval_prompts": 0},
        "generation": {"max_new_tokens": RESPONSE_LEN, "stop_at_eos": False, "temperature": 1.0},
        "ppo": {"steps": steps, "rollout_batch_size": BATCH, "ppo_epochs": PPO_EPOCHS, "num_minibatches": MINIBATCHES,
                # TRL 1.12 PPOConfig defaults, so both sides compute the same losses
                "policy_lr": 3e-6, "critic_lr": 3e-6, "kl_coef": 0.05, "kl_estimator": "k1", "clip_eps": 0.2,
                "value_clip": 0.2, "gamma": 1.0, "gae_lambda": 0.95, "adv_normalize": True, "max_grad_norm": 0.0},
        "reward": {"normalize": False, "scale": False, "clip": None},
        "logging": {"tracking_uri": f"sqlite:///{workdir}/mlflow.db", "experiment": "bench", "run_name": "bench",
                    "output_dir": str(workdir / "runs"), "sample_every": 0, "eval_every": 0, "checkpoint_every": 0,
                    "progress": False},
    }
    from harness.config import from_dict, merge, parse_overrides

    return from_dict(merge(base, parse_overrides(overrides)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args(argv)

    import torch

    import harness.data
    from harness import keys
    from harness.data import PromptSource
    from harness.train import train

    models = Path(args.models)
    prompts = json.loads((models / "prompts.json").read_text())
    harness.data.load_source = lambda cfg: PromptSource(prompts, [], [(prompts[0], prompts[1])], None)

    with tempfile.TemporaryDirectory(prefix="bench_harness_") as d:
        cfg = bench_config(models, args.warmup + args.steps, Path(d), args.overrides)
        torch.set_num_threads(cfg.threads)
        stamps: list[float] = []
        cpu: list[float] = []
        per_step: list[dict] = []

        def on_step(step: int, m: dict) -> bool:
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
            per_step.append({k: float(v) for k, v in m.items()})
            return False

        t_start = time.perf_counter()
        res = train(cfg, on_step=on_step)
        t_end = time.perf_counter()
        if res.status != "FINISHED":
            print(json.dumps({"error": res.error}))
            return 1
    # step i's wall time: from the previous on_step (or the first step's start, unknown: skipped) to this one
    wall = [b - a for a, b in zip(stamps, stamps[1:])]
    # the logging time of step i is reported by step i+1 (perf/time_logging_s)
    log_s = [per_step[i + 1][keys.TIME_LOGGING] for i in range(len(per_step) - 1)]
    w = args.warmup
    out = {
        "impl": "harness",
        "overrides": args.overrides,
        "threads": torch.get_num_threads(),
        "step_s": wall[w - 1:] if w >= 1 else wall,  # wall[k] is step k+2's time
        "cpu_s": [b - a for a, b in zip(cpu, cpu[1:])][w - 1:] if w >= 1 else [b - a for a, b in zip(cpu, cpu[1:])],
        "phases": {k: [m[k] for m in per_step[w:]] for k in
                   (keys.STEP_S, keys.TIME_ROLLOUT, keys.TIME_SCORE, keys.TIME_ADVANTAGE, keys.TIME_UPDATE)},
        "logging_s": log_s[w:],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "device": cfg.device,
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else None,
        "total_s": t_end - t_start,
        "last_metrics": {k: v for k, v in per_step[-1].items() if not k.startswith("perf/")},
    }
    print("BENCH_JSON " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
