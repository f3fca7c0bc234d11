"""Does torch.compile (inductor) pay at world scale? The policy's teacher-forced pass of the update
(packed trunk + LM head: log-probs and entropy, `rollout.logprobs_and_entropy`) forward + backward on
update minibatches of a real world rollout, eager against compiled, and the compile time that every
new run process pays before its first step (issue 14).

    python -m bench.compile_trunk [--calls 30] [--out bench/results_compile.json]

Compiled forms (inductor, dynamic shapes: every minibatch has other lengths):
  block   each GPT-2 block (`gpt2.block`: layer norms, linear layers, GELU, residuals, the attention
          call); the packing and the LM head stay eager
  packed  the whole `gpt2.packed_hidden` (dynamo breaks the graph where it reads the longest row)
  block-static  `block` compiled for static shapes: one compile per minibatch token count (the 8
          minibatches here compile 8 times; a run's minibatches each have a new count)
In every compiled form GELU is aten's tanh GELU (the same function as `rollout.GELUTanh`, whose custom autograd
form dynamo does not trace). Each form runs in a fresh process, 1 torch thread; a compiled form
twice: with an empty inductor cache (a new machine) and with the cache the first left (later runs).
Times are medians over `--calls` minibatches of 16 rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(world: str, mode: str, calls: int) -> dict:
    """Median ms per forward + backward of the policy pass in `mode` (eager | block | packed |
    block-static), and the seconds the first compiled calls took beyond eager ones."""
    import torch
    import torch.nn.functional as F
    from world_step import world_trainer

    import harness.gpt2 as gpt2
    import harness.rollout as rollout

    trainer = world_trainer(world, 10)
    for _ in range(3):  # a policy a few updates in, as in a run
        trainer.step()
    ro = trainer.make_batch({}).rollout
    P = ro.prompt_ids.shape[1]
    seq, attn, resp = ro.sequences, ro.attention_mask, ro.response_ids
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randperm(len(seq), generator=gen)[: len(seq) // 2].sort().values for _ in range(8)]
    policy = trainer.policy

    if mode != "eager":
        class AtenGELU(torch.nn.Module):
            def forward(self, x):
                return F.gelu(x, approximate="tanh")

        for m in policy.module.modules():
            for name, ch in list(m.named_children()):
                if type(ch).__name__ == "GELUTanh":
                    setattr(m, name, AtenGELU())
        if mode in ("block", "block-static"):
            gpt2.block = torch.compile(gpt2.block, dynamic=mode == "block")
        else:
            rollout.packed_hidden = torch.compile(gpt2.packed_hidden, dynamic=True)

    def call(i: int) -> float:
        t0 = time.perf_counter()
        with policy.training():
            lp, ent = rollout.logprobs_and_entropy(policy, seq[rows[i % 8]], attn[rows[i % 8]], P, resp[rows[i % 8]], 1.0, pack=True)
        (lp.sum() + ent.sum()).backward()
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    first = [call(i) for i in range(8)]  # every row set once: compiles what the shapes need
    first_s = time.perf_counter() - t0
    times = sorted(call(i) for i in range(calls))
    ms = 1e3 * statistics.median(times)
    return {"mode": mode, "ms": ms, "first_calls_s": first_s, "compile_s": first_s - 8 * ms / 1e3, "first": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compile_trunk", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default=".harness/world", help="built world directory (default .harness/world)")
    ap.add_argument("--calls", type=int, default=30, help="timed forward + backward calls per form (default 30)")
    ap.add_argument("--out", default="bench/results_compile.json")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench.common import in_tree
    from bench.run_all import load_avg, machine, versions

    world = str(Path(a.world).resolve())
    res: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), "versions": versions(),
                 "argv": sys.argv[1:], "load_before": load_avg(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="bench_inductor_") as cache:
        plan = [("eager", None), ("block", "cold"), ("block", "warm"), ("packed", "cold"), ("packed", "warm"),
                ("block-static", "cold"), ("eager", None)]
        for mode, cache_state in plan:
            d = Path(cache) / mode
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d)  # in_tree passes os.environ on to the process
            r = in_tree(REPO, "compile_trunk", f"child({world!r}, {mode!r}, {a.calls})")
            r["cache"] = cache_state
            res["runs"].append(r)
            print(f"[bench] {mode} {cache_state or ''}: {r['ms']:.1f} ms per forward + backward, "
                  f"first 8 calls {r['first_calls_s']:.1f} s", flush=True)
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
    res["load_after"] = load_avg()
    Path(a.out).write_text(json.dumps(res, indent=1))
    eager = statistics.median(r["ms"] for r in res["runs"] if r["mode"] == "eager")
    print(f"\nCPU: {res['machine'].get('cpu')} {res['machine'].get('isa')}; load {res['load_before']} -> {res['load_after']}")
    print("| form | inductor cache | ms per fwd + bwd | vs eager | compile s (first calls beyond eager) |\n|---|---|---|---|---|")
    for r in res["runs"]:
        comp = "-" if r["mode"] == "eager" else f"{r['compile_s']:.1f}"
        print(f"| {r['mode']} | {r['cache'] or '-'} | {r['ms']:.1f} | {eager / r['ms']:.2f}x | {comp} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
