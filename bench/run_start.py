"""A grid run's fixed cost: wall seconds per 1-step world-scale run through the local engine (each
run in its own process, forked by the fork server, as `harness.ablate` runs a grid), so what a run
pays before and after its steps: its imports, the models, the MLflow run.

    python -m bench.run_start [--baseline REV] [--runs 6] [--reps 3]

Against --baseline REV (e.g. a commit before a change) the two trees alternate in one benchmark
run, each in its own Python process and store. The world must be built (`python -m harness.world build`).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(world: str, runs: int) -> list[float]:
    """`runs` 1-step runs of the vanilla base config into a fresh store; wall seconds of each."""
    from harness import launch, tracking, train
    from harness.config import load_config

    out = []
    with tempfile.TemporaryDirectory(prefix="bench_start_") as d:
        uri = f"sqlite:///{d}/mlflow.db"
        tracking.client(uri)  # the grid's parent creates the store before any run
        for seed in range(runs):
            cfg = load_config("ablations/bases/vanilla.yaml", [
                "ppo.steps=1", f"seed={seed}", "threads=1", f"data.world_dir={world}", f"logging.tracking_uri={uri}",
                f"logging.output_dir={d}/runs", "logging.progress=false", "logging.eval_every=0",
            ])
            t = time.perf_counter()
            res = launch.in_own_process(train.train, cfg)
            out.append(time.perf_counter() - t)
            assert res.status == "FINISHED", res.error
    return out


def measure(tree: Path, world: str, runs: int) -> list[float]:
    from bench.common import in_tree

    return in_tree(tree, "run_start", f"child({world!r}, {runs})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run_start", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default=".harness/world", help="built world directory (default .harness/world)")
    ap.add_argument("--baseline", metavar="REV", help="also measure this git revision")
    ap.add_argument("--runs", type=int, default=6, help="1-step runs per repetition (default 6)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions, alternating the trees' order (default 3)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench.common import trees as trees_of
    from harness.provenance import cpu

    world = str(Path(a.world).resolve())
    if not (Path(world) / "world.json").exists():
        raise SystemExit(f"bench.run_start: no built world at {world}; build it: python -m harness.world build")
    tmp = tempfile.TemporaryDirectory(prefix="bench_base_")
    trees = trees_of(a.baseline, tmp.name)
    times: dict[str, list[float]] = {k: [] for k in trees}
    for rep in range(a.reps):
        for name in (list(trees) if rep % 2 == 0 else list(trees)[::-1]):
            t = measure(trees[name], world, a.runs)
            times[name] += t[1:]  # the first run also starts the fork server
            print(f"[bench] rep {rep} {name}: median {statistics.median(t[1:]):.2f} s per 1-step run", flush=True)
    c = cpu()
    print(f"\nCPU: {c['model']} ({c['flags']}), {c['logical_cpus']} logical CPUs")
    print("| tree | runs | median s per 1-step run | min |\n|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {len(t)} | {statistics.median(t):.2f} | {min(t):.2f} |")
    for name in list(trees)[1:]:
        d = statistics.median(times[name]) - statistics.median(times["current"])
        print(f"\n{name} takes {d:+.2f} s per run more than current")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
