"""The first line of `make run` and `make test` on a fresh machine: `make venv` (a new venv with the
exact versions of requirements.lock, then the project), timed with cold package caches, against the
Makefile of an older commit, alternating in one benchmark run.

    python -m bench.install [--baseline REV] [--reps 2]

Each measurement runs `make venv` in its own tree (this checkout, or REV's files by git archive)
with a new venv and fresh, empty pip and uv caches, so every wheel is downloaded and installed as on
a new machine; the venvs and caches are removed afterwards. Needs the package registries and about
2 GB of scratch disk. Prints wall and CPU seconds per tree and the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_venv(tree: Path, scratch: Path) -> dict[str, float | str]:
    """`make venv` in `tree` into a new venv under `scratch`, with empty caches; wall and CPU seconds
    and the torch version the venv imports."""
    venv = scratch / "venv"
    env = {**os.environ, "PIP_CACHE_DIR": str(scratch / "pip-cache"), "UV_CACHE_DIR": str(scratch / "uv-cache")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(["make", "-C", str(tree), f"VENV={venv}", "venv"], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise RuntimeError(f"bench.install: make venv in {tree} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    check = subprocess.run([str(venv / "bin/python"), "-c", "import torch, mlflow, transformers, harness; print(torch.__version__)"],
                           capture_output=True, text=True, cwd=scratch)
    if check.returncode:
        raise RuntimeError(f"bench.install: the venv from {tree} does not import:\n{check.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "torch": check.stdout.strip()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.install", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="REV", help="also time this git revision's `make venv` (e.g. a commit before a change)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions, alternating the trees' order (default 2)")
    ap.add_argument("--out", default=None, help="write the JSON results here")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench.common import trees as trees_of
    from bench.run_all import load_avg, machine

    with tempfile.TemporaryDirectory(prefix="bench_install_") as tmp:
        base = Path(tmp, "baseline")
        base.mkdir()
        trees = trees_of(a.baseline, str(base))
        res: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), "argv": sys.argv[1:],
                     "load_before": load_avg(), "runs": {k: [] for k in trees}}
        for rep in range(a.reps):
            for name in (list(trees) if rep % 2 == 0 else list(trees)[::-1]):
                scratch = Path(tmp, f"scratch-{rep}-{len(res['runs'][name])}-{name.split()[0]}")
                scratch.mkdir()
                try:
                    r = make_venv(trees[name], scratch)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
                res["runs"][name].append(r)
                print(f"[bench] rep {rep} {name}: make venv {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU", flush=True)
    res["load_after"] = load_avg()
    med = {name: statistics.median(r["wall_s"] for r in runs) for name, runs in res["runs"].items()}
    res["median_wall_s"] = med
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"\nCPU: {res['machine'].get('cpu')} {' '.join(res['machine'].get('isa', []))}; "
          f"load {res['load_before']} -> {res['load_after']}")
    for name, runs in res["runs"].items():
        print(f"  {name}: median {med[name]:.1f} s wall (each: {', '.join(str(r['wall_s']) for r in runs)})")
    for name in list(med)[1:]:
        print(f"  {name} / current: {med[name] / med['current']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
