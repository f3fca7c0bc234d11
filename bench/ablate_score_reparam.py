"""Wall time of the main job's ablation: `python -m harness.ablate ablations/score_reparam.yaml`
(paper Fig. 6: 5 variants x the file's seeds) with the embedded world already built, at
--workers 1 and 2. Each timing starts from an empty MLflow store, so nothing is skipped.

    python -m bench.ablate_score_reparam                      # full default budget (minutes)
    python -m bench.ablate_score_reparam --steps 5 --seeds 0  # smoke: seconds per run

The README promises <= 15 min wall (target 10) for the full grid on 2 cores. Don't run the full
bench while other jobs share the CPU: the numbers would measure them too.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REGISTRY = REPO / "ablations" / "score_reparam.yaml"


def time_ablation(workers: int, world_dir: Path, steps: int | None, seeds: str | None, keep: Path | None,
                  threads: int | None = None) -> dict:
    """One timed `harness.ablate` of the whole grid into a fresh store. threads=None keeps the
    runner's default (cores split among the workers, at most 1 each)."""
    root = Path(tempfile.mkdtemp(prefix=f"bench-ablate-w{workers}-", dir=keep)) if keep else Path(tempfile.mkdtemp(prefix=f"bench-ablate-w{workers}-"))
    cmd = [sys.executable, "-m", "harness.ablate", str(REGISTRY), "--workers", str(workers),
           "--tracking-uri", f"sqlite:///{root / 'mlflow.db'}", "--runs-dir", str(root / "runs"), "--no-progress",
           "--set", f"data.world_dir={world_dir}"]
    if steps is not None:
        cmd += ["--set", f"ppo.steps={steps}"]
    if seeds:
        cmd += ["--seeds", seeds]
    if threads:
        cmd += ["--threads", str(threads)]
    print(f"$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[") or "runs finished" in ln or "did not finish" in ln]
    print("\n".join("  " + ln for ln in lines))
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
    runs = sum(1 for ln in lines if ln.startswith("["))
    return {"workers": workers, "threads": threads or "default", "wall_s": round(wall, 1), "runs": runs, "exit_code": proc.returncode, "store": str(root)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ablate_score_reparam", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-dir", default=str(REPO / ".harness" / "world"), help="built embedded world (default .harness/world)")
    ap.add_argument("--workers", default="1,2", help="settings to time, comma-separated: W (the runner's default threads) or "
                                                     "WxT (W workers with T torch threads each), e.g. 1,2,1x2 (default 1,2)")
    ap.add_argument("--steps", type=int, default=None, help="override ppo.steps (smoke runs); default: the file's budget")
    ap.add_argument("--seeds", default=None, help="override the seeds, e.g. 0 (smoke runs)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the stores under this folder (default: temp folders)")
    args = ap.parse_args(argv)
    world = Path(args.world_dir)
    if not world.is_dir():
        print(f"error: no built world at {world}; build it first: python -m harness.world build --out {world}", file=sys.stderr)
        return 2
    print(f"cores available: {len(os.sched_getaffinity(0))}; load average: {os.getloadavg()[0]:.1f} "
          f"(numbers are only meaningful on an otherwise idle machine)")
    settings = []
    for item in args.workers.split(","):
        w, _, t = item.strip().partition("x")
        if not w.isdigit() or (t and not t.isdigit()):
            ap.error(f"--workers: {item!r} is not W or WxT (e.g. 2 or 1x2)")
        settings.append((int(w), int(t) if t else None))
    load0 = os.getloadavg()
    results = [time_ablation(w, world, args.steps, args.seeds, args.keep, t) for w, t in settings]
    print("\nworkers  threads  runs  wall")
    for r in results:
        print(f"{r['workers']:>7}  {str(r['threads']):>7}  {r['runs']:>4}  {r['wall_s'] / 60:5.1f} min ({r['wall_s']:.0f} s)" + ("" if r["exit_code"] == 0 else f"  exit {r['exit_code']}"))
    base = next((r["wall_s"] for r in results if r["workers"] == 1 and r["threads"] == "default"), None)
    if base:
        for r in results:
            print(f"  {r['workers']} worker(s) x {r['threads']} thread(s): {base / r['wall_s']:.2f}x the --workers 1 default")
    print(json.dumps({"bench": "ablate_score_reparam", "date": time.strftime("%Y-%m-%d %H:%M"), "steps": args.steps,
                      "seeds": args.seeds, "load_before": load0, "load_after": os.getloadavg(), "results": results}))
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
