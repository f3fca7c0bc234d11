"""Measured fp32 (and bf16) matmul peak of this machine: torch.mm on large square matrices.

`python -m bench.peak [--threads 2] [--n 2048] [--seconds 3] [--device cuda]` prints one JSON line.
The best of several timed repetitions is the peak (the machine is shared: the best run is the one
least disturbed by other processes). On a GPU each product is timed between two device
synchronizations (a GPU runs asynchronously to the host); use a large --n there (8192).
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def measure(n: int = 2048, threads: int = 2, seconds: float = 3.0, dtype: str = "float32", device: str = "cpu") -> dict:
    import torch

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    a = torch.randn(n, n).to(device=device, dtype=dt)
    b = torch.randn(n, n).to(device=device, dtype=dt)
    c = torch.empty(n, n, dtype=dt, device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    torch.mm(a, b, out=c)  # warm up (packing buffers, thread pool; the GPU's clocks and kernel choice)
    sync()
    flop = 2.0 * n**3
    best, reps, t_end = float("inf"), [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(reps) < 3:
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        sync()
        dt_s = time.perf_counter() - t0
        reps.append(dt_s)
        best = min(best, dt_s)
    reps.sort()
    return {"dtype": dtype, "n": n, "threads": threads, "device": device, "reps": len(reps),
            "peak_gflops": flop / best / 1e9, "median_gflops": flop / reps[len(reps) // 2] / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    a = ap.parse_args(argv)
    print("BENCH_JSON " + json.dumps(measure(a.n, a.threads, a.seconds, a.dtype, a.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
