"""Where a world-scale PPO step's time goes by kind of kernel, and the MFU ceiling that follows:
the MFU a step would reach if everything but its matmul kernels took no time (issue 14).

    python -m bench.world_profile [--steps 5] [--warmup 5] [--reps 2] [--out bench/results_world_profile.json]

Same workload and FLOP count as `bench.world_step` (`ablations/bases/vanilla.yaml`, 1 torch thread,
real tokens only); the world must be built. Each repetition runs in a fresh process: `--warmup`
steps, `--steps` steps timed plainly (the step time and MFU), then `--steps` more under
torch.profiler, whose self CPU time per aten op is summed by kind:

  matmul     addmm, mm, bmm, baddbmm (linear layers, LM head, short-row attention)
  attention  the CPU flash-attention kernel (rollout decode and long rows)
  layout     copies, index / gather / scatter, cat, fill, casts
  pointwise  the elementwise and row-wise maths: adds, muls, GELU, layer norms, softmax, ...
  views      views, reshapes, allocations and the dispatching ops that only call others
             (matmul, linear, layer_norm: their kernels' time is counted where it lands)
  optimizer  fused AdamW, gradient norms and clipping
  other      everything else aten does

The profiler adds a few microseconds to every op, so the small-op kinds are overstated and the
shares are taken of the profiled time; the matmul kernels' own time is what counts for the ceiling.
ceiling = model FLOPs / (fp32 peak x matmul kernel time per step): an upper bound on the MFU any
eager fp32 implementation with these kernels reaches, since the FLOPs count only real tokens while
the kernels also see rows that finished sampling.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

KINDS = {
    "matmul": ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "layout": ("aten::copy_", "aten::index", "aten::index_select", "aten::index_copy_", "aten::_index_put_impl_",
               "aten::index_add_", "aten::gather", "aten::scatter", "aten::scatter_add_", "aten::masked_scatter_",
               "aten::masked_select", "aten::nonzero", "aten::cat", "aten::stack", "aten::fill_", "aten::zero_",
               "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::embedding_dense_backward", "aten::where",
               "aten::repeat_interleave", "aten::cumsum", "aten::flip"),
    "views": ("aten::view", "aten::as_strided", "aten::empty", "aten::empty_strided", "aten::empty_like",
              "aten::transpose", "aten::t", "aten::permute", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view",
              "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::detach",
              "aten::alias", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::narrow", "aten::flatten",
              "aten::resize_", "aten::zeros", "aten::ones", "aten::full", "aten::new_zeros", "aten::new_empty",
              "aten::new_ones", "aten::new_full", "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::lift_fresh",
              "aten::arange", "aten::item", "aten::_local_scalar_dense", "aten::to", "aten::result_type", "aten::view_as",
              "aten::expand_as", "aten::is_nonzero", "aten::numpy_T", "aten::matmul", "aten::linear", "aten::dropout",
              "aten::embedding", "aten::layer_norm", "aten::scaled_dot_product_attention"),
    "optimizer": ("aten::_fused_adamw_", "aten::linalg_vector_norm", "aten::_foreach_norm", "aten::clamp",
                  "aten::_foreach_mul_"),
    "pointwise": ("aten::add", "aten::add_", "aten::mul", "aten::mul_", "aten::sub", "aten::sub_", "aten::div",
                  "aten::div_", "aten::sigmoid_", "aten::sigmoid", "aten::gelu", "aten::gelu_backward",
                  "aten::native_layer_norm", "aten::native_layer_norm_backward", "aten::_softmax",
                  "aten::_softmax_backward_data", "aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::exp",
                  "aten::log", "aten::sum", "aten::mean", "aten::neg", "aten::pow", "aten::sqrt", "aten::rsqrt",
                  "aten::maximum", "aten::minimum", "aten::max", "aten::min", "aten::clamp_", "aten::tanh",
                  "aten::tanh_backward", "aten::sigmoid_backward", "aten::addcmul_", "aten::addcdiv_", "aten::lerp_",
                  "aten::multinomial", "aten::exponential_", "aten::argmax", "aten::eq", "aten::ne", "aten::lt",
                  "aten::gt", "aten::le", "aten::ge", "aten::logical_and", "aten::logical_not", "aten::bitwise_and",
                  "aten::bitwise_or", "aten::abs", "aten::square", "aten::var", "aten::std", "aten::triu_",
                  "aten::threshold_backward", "aten::masked_fill_", "aten::log_softmax", "aten::softmax"),
}


def kind_of(name: str) -> str:
    """The kind of an aten op by name; "not aten" for the profiler's other events (Python ranges,
    autograd nodes: bookkeeping it sees outside any kernel)."""
    if not name.startswith("aten::"):
        return "not aten"
    return next((k for k, names in KINDS.items() if name in names), "other")


def child(world: str, steps: int, warmup: int) -> dict:
    """warmup + steps timed + steps profiled world-scale steps in this process (1 thread)."""
    from torch.profiler import ProfilerActivity, profile
    from world_step import lengths, run_config, world_trainer

    trainer = world_trainer(world, warmup + 2 * steps)
    for _ in range(warmup):
        trainer.step()
    timed = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _, b = trainer.step()
        timed.append({"step_s": time.perf_counter() - t0, **lengths(b)})
    profiled = []
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            _, b = trainer.step()
            profiled.append(lengths(b))
    wall = time.perf_counter() - t0
    by_kind: dict[str, float] = {}
    calls: dict[str, int] = {}
    top = []
    for e in prof.key_averages():
        k = kind_of(e.key)
        by_kind[k] = by_kind.get(k, 0.0) + e.self_cpu_time_total / 1e6 / steps
        calls[k] = calls.get(k, 0) + e.count // steps
        top.append((e.self_cpu_time_total / 1e6 / steps, e.key, e.count // steps))
    top.sort(reverse=True)
    return {"timed": timed, "profiled": profiled, "profiled_wall_s": wall / steps, "self_s": by_kind, "calls": calls,
            "top": [{"op": k, "s": s, "calls": c} for s, k, c in top[:15]],
            "config": run_config(trainer)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.world_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default=".harness/world", help="built world directory (default .harness/world)")
    ap.add_argument("--steps", type=int, default=5, help="steps timed, then as many profiled, per repetition (default 5)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2, help="repetitions, each in a fresh process (default 2)")
    ap.add_argument("--out", default="bench/results_world_profile.json")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench.common import in_tree
    from bench.peak import measure as peak_of
    from bench.run_all import load_avg, machine, versions
    from bench.world_step import flops, world_size

    world = str(Path(a.world).resolve())
    size = world_size(world)
    res: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), "versions": versions(),
                 "argv": sys.argv[1:], "load_before": load_avg(), "peak": [peak_of(threads=1)], "reps": []}
    for rep in range(a.reps):
        r = in_tree(REPO, "world_profile", f"child({world!r}, {a.steps}, {a.warmup})")
        res["reps"].append(r)
        print(f"[bench] rep {rep}: median step {statistics.median(s['step_s'] for s in r['timed']):.3f} s", flush=True)
    res["peak"].append(peak_of(threads=1))
    pk = max(p["peak_gflops"] for p in res["peak"]) * 1e9
    med = statistics.median
    rows = []
    for r in res["reps"]:
        f_timed = med(sum(flops(s, r["config"], size).values()) for s in r["timed"])
        f_prof = med(sum(flops(s, r["config"], size).values()) for s in r["profiled"])
        t = med(s["step_s"] for s in r["timed"])
        prof_total = sum(r["self_s"].values())
        mm = r["self_s"].get("matmul", 0.0)
        rows.append({"step_s": t, "gflop": f_timed / 1e9, "mfu": f_timed / t / pk,
                     "matmul_s": mm, "matmul_gflops": f_prof / mm / 1e9, "ceiling_mfu": f_prof / mm / pk,
                     "shares": {k: v / prof_total for k, v in r["self_s"].items()}})
    res["peak_fp32_gflops_1thread"] = pk / 1e9
    res["summary"] = {k: med(x[k] for x in rows) for k in ("step_s", "gflop", "mfu", "matmul_s", "matmul_gflops", "ceiling_mfu")}
    res["summary"]["shares"] = {k: med(x["shares"].get(k, 0.0) for x in rows) for k in rows[0]["shares"]}
    res["load_after"] = load_avg()
    Path(a.out).write_text(json.dumps(res, indent=1))
    s = res["summary"]
    print(f"\nfp32 matmul peak, 1 thread (best of start/end): {pk / 1e9:.1f} GFLOP/s; load {res['load_before']} -> "
          f"{res['load_after']}; CPU: {res['machine'].get('cpu')} {res['machine'].get('isa')}")
    print(f"step {s['step_s']:.3f} s, {s['gflop']:.2f} GFLOP (real tokens): MFU {100 * s['mfu']:.1f}%")
    print(f"matmul kernels {1e3 * s['matmul_s']:.0f} ms per step at {s['matmul_gflops']:.1f} GFLOP/s: "
          f"MFU ceiling {100 * s['ceiling_mfu']:.1f}% (everything else free)")
    print("| kind | share of profiled time |\n|---|---|")
    for k, v in sorted(s["shares"].items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {100 * v:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
