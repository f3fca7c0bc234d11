"""Times TRL 1.12's PPOTrainer (trl.experimental.ppo) on a benchmark model directory.

Runs in the bench venv: `.venv-bench/bin/python -m bench.trl_step --models DIR --steps N --warmup W`.
Same work as bench/harness_step.py: 32 prompts of 16 tokens, 48 sampled tokens (no stop token),
4 PPO epochs, 1 minibatch, fp32, 2 torch threads, no tracker (report_to=none). Step wall times are
taken between consecutive `on_step_end` callbacks (one PPO update each). `--device cuda --batch 64
--response-len 256 --bf16` is the GPU workload of `bench.gpu_check` (the prompts' length is the
model directory's, `bench.common.build(prompt_len=)`).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
warnings.filterwarnings("ignore")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--batch", type=int, default=None, help="prompts per step (default bench.common.BATCH)")
    ap.add_argument("--response-len", type=int, default=None, help="sampled tokens (default bench.common.RESPONSE_LEN)")
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 weights, bf16 autocast)")
    args = ap.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from bench.common import BATCH, MINIBATCHES, PPO_EPOCHS, RESPONSE_LEN, THREADS

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads or THREADS)
    batch, response_len = args.batch or BATCH, args.response_len or RESPONSE_LEN
    models = Path(args.models)
    tok = AutoTokenizer.from_pretrained(models / "sft", padding_side="left")
    prompts = json.loads((models / "prompts.json").read_text())
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    train_ds = Dataset.from_dict({"input_ids": ids})
    eval_ds = Dataset.from_dict({"input_ids": ids[:batch]})

    policy = AutoModelForCausalLM.from_pretrained(models / "sft", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(models / "sft", dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(models / "reward", num_labels=1, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(models / "reward", num_labels=1, dtype=torch.float32)

    n_steps = args.warmup + args.steps
    stamps: list[float] = []
    cpu: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_log(self, a, state, control, logs=None, **kw):
            if logs:
                logs_copy = dict(logs)
                Timer.last = logs_copy

    with tempfile.TemporaryDirectory(prefix="bench_trl_") as d:
        cfg = PPOConfig(
            output_dir=d, report_to="none", use_cpu=args.device == "cpu", seed=0, bf16=args.bf16, fp16=False,
            per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_mini_batches=MINIBATCHES,
            num_ppo_epochs=PPO_EPOCHS, response_length=response_len, total_episodes=batch * n_steps,
            local_rollout_forward_batch_size=batch, stop_token=None, temperature=1.0, num_sample_generations=0,
            save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=3e-6, kl_coef=0.05,
            dataloader_num_workers=0,
        )
        trainer = PPOTrainer(args=cfg, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                             value_model=value, train_dataset=train_ds, eval_dataset=eval_ds, callbacks=[Timer()])
        import builtins
        _print = builtins.print
        builtins.print = lambda *a, **k: None  # PrinterCallback's per-step dict would clutter stdout
        t0 = time.perf_counter()
        try:
            trainer.train()
        finally:
            builtins.print = _print
        t1 = time.perf_counter()
    wall = [b - a for a, b in zip(stamps, stamps[1:])]
    w = args.warmup
    out = {
        "impl": "trl",
        "threads": torch.get_num_threads(),
        "step_s": wall[w - 1:] if w >= 1 else wall,
        "cpu_s": [b - a for a, b in zip(cpu, cpu[1:])][w - 1:] if w >= 1 else [b - a for a, b in zip(cpu, cpu[1:])],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "device": args.device, "batch": batch, "response_len": response_len, "bf16": args.bf16,
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else None,
        "total_s": t1 - t0,
        "last_metrics": getattr(Timer, "last", {}),
    }
    print("BENCH_JSON " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
