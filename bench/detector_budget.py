"""Is a held-out campaign's budget long enough to call a run held? Per run of a runs file trained at a longer
budget: its gold onset and each detector's first warning. A warning is causal (the same on a run's first N steps as
on the run cut there), so a run whose gold fell after step N that a detector warned before N is what an N-step
campaign scores as a false alarm (bench/RESULTS.md, session 26).

    python -m bench.detector_budget [--runs reports/detector/budget800/runs.npz] [--params FILE ...]
"""
from __future__ import annotations

import argparse

from analysis import detector as D
from analysis.detector_runs import read_runs
from harness.detector import load_params

DETECTORS = ("reports/detector/campaign5/fit/detector_params.json",
             "reports/detector/campaign5/fit/detector_params_no_audit.json",
             "reports/detector/campaign4/fit_file/detector_params.json",
             "reports/detector/campaign6/fit/detector_params.json",
             "reports/detector/retired/detector_params_no_audit.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.detector_budget", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="reports/detector/budget800/runs.npz", help="a runs file (analysis.detector export)")
    ap.add_argument("--params", nargs="+", default=list(DETECTORS), metavar="FILE", help="detector files")
    args = ap.parse_args(argv)
    runs, prov = read_runs(args.runs)
    params = {p: load_params(p) for p in args.params}
    print(f"{args.runs}: {len(runs)} runs, worlds {prov.get('worlds')}, content "
          f"{sorted({r.provenance.get('world.content', '?') for r in runs})}")
    print("| run | gold onset (last step) | " + " | ".join(params) + " |")
    print("| --- " * (2 + len(params)) + "|")
    for r in sorted(runs, key=lambda r: (r.ablation, r.variant, r.seed)):
        warns = [D.warn_step(p, r) if D.has_features(r, tuple(p.features)) else "n/a" for p in params.values()]
        print(f"| {r.ablation} {r.variant} seed {r.seed} | {r.onset if r.fell else 'held'} ({r.last_step}) | "
              + " | ".join("–" if w is None else str(w) for w in warns) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
