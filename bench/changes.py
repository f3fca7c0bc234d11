"""Leave-one-out measurement of each speed change: the harness step with everything on, and with
one change switched back to the old behaviour at a time (by patching, in one process).

    .venv/bin/python -m bench.changes --size medium --threads 1 --reps 3 --steps 2

Reports CPU seconds per step (time.process_time: on a shared machine this counts only the time
this process ran, so other jobs disturb it far less than wall time) and wall seconds. The effect
of a change = time without it / time with everything on - 1 (how much slower the old way is).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def patched(change: str):
    import torch

    import harness.rollout as R
    import harness.trainer as T

    undo = []

    def setp(obj, name, val):
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, val)

    if change == "fused_gelu":
        setp(T, "fuse_activations", lambda m: 0)
    elif change == "static_kv_decoder":
        setp(R.StaticGPT2Decoder, "supports", staticmethod(lambda m: False))
    elif change == "lm_head_trim":
        setp(R, "_keep_last", lambda m, n=1: {})
    elif change == "entropy_only_when_needed":
        orig = T.logprobs_and_entropy
        setp(T, "logprobs_and_entropy", lambda *a, **k: orig(*a, **{**k, "with_entropy": True}))
    elif change == "fused_adamw":
        orig_adamw = torch.optim.AdamW

        class AdamW(orig_adamw):
            def __init__(self, *a, **k):
                k.pop("fused", None)
                super().__init__(*a, **k)

        setp(T.torch.optim, "AdamW", AdamW)
    elif change == "first_epoch_reuses_scoring_forward":
        orig_make = T.PPOTrainer.make_batch

        def make_batch(self, timers):
            b = orig_make(self, timers)
            b.first_pass = None
            return b

        setp(T.PPOTrainer, "make_batch", make_batch)
    elif change != "all_on":
        raise ValueError(change)
    try:
        yield
    finally:
        for obj, name, val in reversed(undo):
            setattr(obj, name, val)


CHANGES = ["all_on", "fused_gelu", "static_kv_decoder", "lm_head_trim", "entropy_only_when_needed", "fused_adamw",
           "first_epoch_reuses_scoring_forward"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--changes", default=",".join(CHANGES))
    ap.add_argument("--models-dir", default=str(REPO / ".harness" / "bench_models"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    import harness.trainer as T
    from bench.common import build
    from bench.harness_step import bench_config
    from harness.data import PromptSource
    from harness.models import Models

    torch.set_num_threads(args.threads)
    models_dir = build(args.size, args.models_dir)
    prompts = json.loads((models_dir / "prompts.json").read_text())
    changes = args.changes.split(",")
    res: dict[str, dict[str, list[float]]] = {c: {"cpu": [], "wall": []} for c in changes}
    with tempfile.TemporaryDirectory() as d:
        cfg = bench_config(models_dir, 100, Path(d), args.overrides)
        for rep in range(args.reps):
            for c in (changes if rep % 2 == 0 else changes[::-1]):
                with patched(c):
                    torch.manual_seed(0)
                    models = Models(cfg, torch.device("cpu"))
                    tr = T.PPOTrainer(cfg, models, PromptSource(prompts, [], [], None), torch.device("cpu"))
                    tr.step()  # warm-up
                    for _ in range(args.steps):
                        c0, w0 = time.process_time(), time.perf_counter()
                        tr.step()
                        res[c]["cpu"].append(time.process_time() - c0)
                        res[c]["wall"].append(time.perf_counter() - w0)
                print(f"[changes] rep {rep} {c:36s} cpu {statistics.median(res[c]['cpu'][-args.steps:]):.3f}s", flush=True)
    base = statistics.median(res["all_on"]["cpu"]) if "all_on" in res else None
    out = {}
    for c in changes:
        cpu, wall = statistics.median(res[c]["cpu"]), statistics.median(res[c]["wall"])
        out[c] = {"cpu_s": cpu, "wall_s": wall, "old_way_slower_by": (cpu / base - 1) if base else None}
        print(f"{args.size:6s} {c:36s} cpu/step {cpu:7.3f}s  wall/step {wall:7.3f}s  "
              + (f"without it: {100 * (cpu / base - 1):+.1f}%" if base and c != "all_on" else ""))
    print("BENCH_JSON " + json.dumps({"size": args.size, "threads": args.threads, "overrides": args.overrides, "changes": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
