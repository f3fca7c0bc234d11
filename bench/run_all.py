"""Issue 8's benchmark in one invocation: harness PPO step vs TRL 1.12's PPOTrainer, MFU against a
measured fp32 matmul peak, per-phase times, MLflow logging share, peak RSS, and (optionally) the
Fig. 6 grid at --workers 1 vs 2.

    .venv/bin/python -m bench.run_all                     # full run (tens of minutes)
    .venv/bin/python -m bench.run_all --quick             # 1 repetition, 2 steps: checks the plumbing
    .venv/bin/python -m bench.run_all --grid              # also time the ablation grid (needs .harness/world)

Work per step (both sides): 32 prompts x 16 tokens, 48 sampled tokens without early stop, 4 PPO
epochs, 1 minibatch, fp32, 2 torch threads; GPT-2 models built from the same configs, separate
policy / reference / reward / value models. TRL runs in its own venv (default .venv-bench, or
$BENCH_TRL_PYTHON); it logs to no tracker, the harness logs to MLflow (sqlite) as in a real run.

Each repetition runs every variant once, each in a fresh process, in an order that alternates
between repetitions (A B C, then C B A, ...) so slow drift of the machine's load hits all variants
alike. Per variant: the median step time within a run (after warm-up steps), then the median over
repetitions. Ratios are TRL step time / harness step time (>1 = harness faster).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAIN_PY = sys.executable
TRL_PY = os.environ.get("BENCH_TRL_PYTHON", str(REPO / ".venv-bench" / "bin" / "python"))

# variant name -> (implementation, extra harness --set overrides)
VARIANTS = {
    "trl": ("trl", []),
    # harness default math: old log-probs from a teacher-forced policy pass
    "harness": ("harness", []),
    # TRL's math: old log-probs (and the entropy metric) from the sampling pass
    "harness_reuse": ("harness", ["ppo.reuse_rollout_logprobs=true"]),
    # optional mixed precision (separate benchmark: not the fp32 comparison)
    "harness_reuse_bf16": ("harness", ["ppo.reuse_rollout_logprobs=true", "model.autocast=bf16"]),
}


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + (f[4] if len(f) > 4 else 0)  # idle + iowait
    return sum(f) - idle, sum(f)


def busy_cores(seconds: float = 3.0) -> float:
    """How many cores other processes keep busy right now (we are idle while sampling)."""
    b0, t0 = _cpu_ticks()
    time.sleep(seconds)
    b1, t1 = _cpu_ticks()
    return (b1 - b0) / max(1, t1 - t0) * (os.cpu_count() or 1)


def wait_quiet(max_busy: float, max_wait: float) -> float:
    """Wait (up to max_wait s) until other processes use less than max_busy cores; returns the last reading."""
    t_end = time.time() + max_wait
    while True:
        b = busy_cores()
        if b < max_busy or time.time() > t_end:
            return b
        time.sleep(10)


def run_json(cmd: list[str], timeout: float) -> dict:
    """Run one benchmark process; also measure how many cores *other* processes used meanwhile
    (all CPUs' busy time from /proc/stat minus this child's own CPU time)."""
    import resource

    # this checkout first, then what the caller had (a --target folder of carried wheels, say)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    b0, _ = _cpu_ticks()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, timeout=timeout, env=env)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    b1, _ = _cpu_ticks()
    wall = time.perf_counter() - t0
    mine = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    total = (b1 - b0) / os.sysconf("SC_CLK_TCK")
    for line in p.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            out = json.loads(line[len("BENCH_JSON "):])
            out["process_s"] = wall
            out["own_cores"] = mine / wall
            out["other_cores"] = max(0.0, (total - mine) / wall)
            return out
    raise RuntimeError(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def versions() -> dict:
    def pkg(py: str, names: list[str]) -> dict:
        code = ("import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in %r}))" % names)
        try:
            return json.loads(subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120).stdout)
        except Exception as e:  # noqa: BLE001
            return {"error": str(e)}

    return {"main": pkg(MAIN_PY, ["torch", "transformers", "mlflow", "tokenizers"]),
            "bench": pkg(TRL_PY, ["torch", "transformers", "trl", "accelerate"]) if Path(TRL_PY).exists() else "missing"}


def machine() -> dict:
    """The CPU (model and kernel-relevant flags, as every run's provenance tags record them), memory,
    Python and kernel."""
    from harness.provenance import FLAGS_OF_INTEREST, cpu

    c = cpu()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": c["model"], "cores": os.cpu_count(), "isa": [f for f in c["flags"].split() if f in FLAGS_OF_INTEREST],
            "mem_gib": round(mem, 1), "python": platform.python_version(), "kernel": platform.release()}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="A/B repetitions (default 5)")
    ap.add_argument("--steps", default="small=6,medium=4", help="timed steps per run and size (after warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--variants", default="trl,harness,harness_reuse", help=f"from {', '.join(VARIANTS)}")
    ap.add_argument("--bf16", action="store_true", help="also run harness_reuse_bf16 (the optional autocast mode)")
    ap.add_argument("--grid", action="store_true", help="also time ablations/score_reparam.yaml at --workers 1, --workers 2 and --workers 1 --threads 2")
    ap.add_argument("--grid-steps", type=int, default=None, help="ppo.steps for the grid (default: the file's budget)")
    ap.add_argument("--grid-seeds", default=None)
    ap.add_argument("--models-dir", default=str(REPO / ".harness" / "bench_models"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results.json"))
    ap.add_argument("--quick", action="store_true", help="1 repetition of 2 steps: plumbing check, not a measurement")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark process")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per benchmark process (the issue's setting: 2)")
    ap.add_argument("--max-busy", type=float, default=0.3,
                    help="before each process, wait until other processes use fewer cores than this (default 0.3)")
    ap.add_argument("--max-wait", type=float, default=900, help="longest wait for a quiet machine per process, s")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from bench.common import SIZES, build, ppo_step_flops

    if args.quick:
        args.reps, args.steps = 1, "small=2,medium=2"
    steps = dict(kv.split("=") for kv in args.steps.split(","))
    sizes = args.sizes.split(",")
    variants = args.variants.split(",") + (["harness_reuse_bf16"] if args.bf16 else [])
    if "trl" in variants and not Path(TRL_PY).exists():
        print(f"error: no TRL venv at {TRL_PY}; create it:\n  python3 -m venv .venv-bench && .venv-bench/bin/pip install "
              "torch==2.13.0 && .venv-bench/bin/pip install trl==1.12.0", file=sys.stderr)
        return 2

    res: dict = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine(), "versions": versions(),
                 "argv": sys.argv[1:], "threads": args.threads, "load_before": load_avg(), "runs": [], "peak": []}
    print(f"[bench] load average before: {res['load_before']}", flush=True)
    for s in sizes:
        build(s, args.models_dir)

    def peak(tag: str) -> None:
        for dtype in ("float32", "bfloat16"):
            wait_quiet(args.max_busy, args.max_wait)
            r = run_json([MAIN_PY, "-m", "bench.peak", "--threads", str(args.threads), "--dtype", dtype], 600)
            r["when"] = tag
            res["peak"].append(r)
            print(f"[bench] peak {dtype} ({tag}): {r['peak_gflops']:.1f} GFLOP/s", flush=True)

    peak("start")
    for rep in range(args.reps):
        if rep:
            peak(f"rep {rep}")
        order = variants if rep % 2 == 0 else variants[::-1]
        for s in sizes:
            for v in order:
                impl, over = VARIANTS[v]
                models = str(Path(args.models_dir) / s)
                n = str(steps[s])
                if impl == "trl":
                    cmd = [TRL_PY, "-m", "bench.trl_step", "--models", models, "--steps", n, "--warmup", str(args.warmup),
                           "--threads", str(args.threads)]
                else:
                    cmd = [MAIN_PY, "-m", "bench.harness_step", "--models", models, "--steps", n, "--warmup", str(args.warmup),
                           "--set", f"threads={args.threads}"]
                    for o in over:
                        cmd += ["--set", o]
                busy = wait_quiet(args.max_busy, args.max_wait)
                la = load_avg()[0]
                r = run_json(cmd, args.timeout)
                r.update(rep=rep, size=s, variant=v, load1_before=la, load1_after=load_avg()[0], other_cores_before=busy)
                res["runs"].append(r)
                Path(args.out).with_suffix(".partial.json").write_text(json.dumps(res, indent=1))
                print(f"[bench] rep {rep} {s:6s} {v:20s} median step {med(r['step_s']):.3f}s "
                      f"(steps {', '.join(f'{x:.2f}' for x in r['step_s'])}) other procs: {busy:.2f} cores before, "
                      f"{r['other_cores']:.2f} during; load1 {la:.1f}", flush=True)
    peak("end")

    # ---------------------------------------------------------------- summary
    fp32_peak = max(p["peak_gflops"] for p in res["peak"] if p["dtype"] == "float32")
    bf16_peak = max(p["peak_gflops"] for p in res["peak"] if p["dtype"] == "bfloat16")
    summary = {}
    for s in sizes:
        for v in variants:
            rs = [r for r in res["runs"] if r["size"] == s and r["variant"] == v]
            if not rs:
                continue
            step = med([med(r["step_s"]) for r in rs])
            fl = ppo_step_flops(SIZES[s])
            pk = bf16_peak if v.endswith("bf16") else fp32_peak
            row = {"step_s": step, "steps_per_s": 1 / step, "per_rep_step_s": [med(r["step_s"]) for r in rs],
                   "gflop_per_step": fl["total"] / 1e9, "achieved_gflops": fl["total"] / step / 1e9,
                   "mfu": fl["total"] / step / 1e9 / pk, "peak_used": "bf16" if v.endswith("bf16") else "fp32",
                   "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                   "load1_range": [min(r["load1_before"] for r in rs), max(r["load1_before"] for r in rs)],
                   "other_cores_during": [round(r["other_cores"], 2) for r in rs],
                   "cpu_s_per_step": med([med(r["cpu_s"]) for r in rs if r.get("cpu_s")])}
            if rs[0]["impl"] == "harness":
                ph = {k.split("/")[-1]: med([med(r["phases"][k]) for r in rs]) for k in rs[0]["phases"]}
                ph["logging_s"] = med([med(r["logging_s"]) for r in rs])
                row["phases"] = ph
                row["logging_share"] = med([med(r["logging_s"]) / med(r["step_s"]) for r in rs])
            summary[f"{s}/{v}"] = row
        t = summary.get(f"{s}/trl")
        for v in variants:
            if v != "trl" and t and f"{s}/{v}" in summary:
                summary[f"{s}/{v}"]["speedup_vs_trl"] = t["step_s"] / summary[f"{s}/{v}"]["step_s"]
                # paired: TRL and this variant ran back to back in each repetition, under about the same load
                pairs = []
                for rep in range(args.reps):
                    a = [r for r in res["runs"] if r["rep"] == rep and r["size"] == s and r["variant"] == "trl"]
                    b = [r for r in res["runs"] if r["rep"] == rep and r["size"] == s and r["variant"] == v]
                    if a and b:
                        pairs.append(med(a[0]["step_s"]) / med(b[0]["step_s"]))
                summary[f"{s}/{v}"]["paired_speedups"] = pairs
                summary[f"{s}/{v}"]["paired_speedup_median"] = med(pairs)
    res["summary"] = summary
    res["peak_fp32_gflops"], res["peak_bf16_gflops"] = fp32_peak, bf16_peak

    if args.grid:
        res["grid"] = grid(args)
    res["load_after"] = load_avg()
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"\n[bench] load average after: {res['load_after']}; results in {args.out}\n")
    print(table(res))
    return 0


def grid(args) -> dict:
    """Fig. 6 grid at --workers 1 vs 2 (bench/ablate_score_reparam.py does the timing)."""
    world = REPO / ".harness" / "world"
    try:
        import harness.ablate  # noqa: F401
        from bench.ablate_score_reparam import time_ablation
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"harness.ablate not importable: {e}"}
    if not world.is_dir():
        return {"skipped": f"no built world at {world} (python -m harness.world build --out {world})"}
    out = {"load_before": load_avg()}
    # 1 worker x 2 threads is the fair single-worker rival: it also uses both cores
    for name, w, t in (("workers1", 1, None), ("workers2", 2, None), ("workers1_threads2", 1, 2)):
        out[name] = time_ablation(w, world, args.grid_steps, args.grid_seeds, None, t)
        print(f"[bench] grid {name}: {out[name]}", flush=True)
    out["load_after"] = load_avg()
    w1, w2, w1t2 = (out[k]["wall_s"] for k in ("workers1", "workers2", "workers1_threads2"))
    out["speedup_w2"] = w1 / w2 if w2 else None
    out["speedup_w2_vs_w1_threads2"] = w1t2 / w2 if w2 else None
    return out


def table(res: dict) -> str:
    lines = [f"threads per process: {res.get('threads', 2)}; fp32 matmul peak (torch.mm 2048^2, same threads, best of runs): {res['peak_fp32_gflops']:.1f} GFLOP/s; "
             f"bf16: {res['peak_bf16_gflops']:.1f} GFLOP/s",
             "", "| size | variant | step s (median) | steps/s | vs TRL | GFLOP/step | GFLOP/s | MFU | logging share | peak RSS MB | CPU s/step | load1 at start (min-max) | other procs' cores during (max) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in res["summary"].items():
        s, v = k.split("/")
        vs = (f"{r['speedup_vs_trl']:.2f}x (paired {r['paired_speedup_median']:.2f}x)" if "speedup_vs_trl" in r else "-")
        ls = f"{100 * r['logging_share']:.2f}%" if "logging_share" in r else "-"
        lines.append(f"| {s} | {v} | {r['step_s']:.3f} | {r['steps_per_s']:.3f} | {vs} | {r['gflop_per_step']:.1f} | "
                     f"{r['achieved_gflops']:.1f} | {100 * r['mfu']:.1f}% ({r['peak_used']}) | {ls} | {r['peak_rss_mb']:.0f} | "
                     f"{r['cpu_s_per_step']:.2f} | {r['load1_range'][0]:.1f}-{r['load1_range'][1]:.1f} | "
                     f"{max(r['other_cores_during']):.2f} |")
    lines += ["", "| size | variant | rollout s | scoring s | advantage s | update s | logging s | step s (trainer) |",
              "|---|---|---|---|---|---|---|---|"]
    for k, r in res["summary"].items():
        if "phases" in r:
            p = r["phases"]
            s, v = k.split("/")
            lines.append(f"| {s} | {v} | {p['time_rollout_s']:.3f} | {p['time_score_s']:.3f} | {p['time_advantage_s']:.4f} | "
                         f"{p['time_update_s']:.3f} | {p['logging_s']:.4f} | {p['step_s']:.3f} |")
    if "grid" in res:
        lines += ["", f"grid: {json.dumps(res['grid'])}"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
