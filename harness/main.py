"""The main job (`make run`): world -> ablation -> figure and report PDF, with progress shown.

    python -m harness.main                                   # Fig. 6 (score_reparam), 2 workers
    python -m harness.main --ablation kl_eta --workers 2

Outputs go to results/ (ignored by git). Failed runs do not stop the figure and report (they show
what finished); the exit code is non-zero when any run failed or a step could not complete.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import ablate, tracking
from .registry import REPO_ROOT
from .study import fmt_duration
from .tracking import redact

DEFAULT_ABLATION = "score_reparam"
RESULTS = "results"  # figures and reports of this run (ignored by git)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m harness.main",
        description="The main job: unpack (or build) the embedded world if missing, run an ablation grid, draw its "
                    "figure and build its report PDF. Rerunning resumes where it stopped.",
        epilog="Each step alone: python -m harness.world build | python -m harness.ablate FILE | "
               "python -m analysis.figures NAME | python -m reports.build NAME",
    )
    ap.add_argument("--ablation", default=DEFAULT_ABLATION, metavar="FILE",
                    help=f"registry YAML or name (default: {DEFAULT_ABLATION}, paper Fig. 6)")
    ablate.add_grid_args(ap, workers=2)
    return ap


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    args = build_parser().parse_args(argv)
    t0 = time.time()
    if not all((REPO_ROOT / m / "__init__.py").is_file() for m in ("analysis", "reports")):  # before hours of runs
        print("error: the main job draws with analysis/ and reports/, which a checkout has and `pip install` "
              "does not ship; run it from a checkout, or run the grid alone: harness-ablate FILE", file=sys.stderr)
        return 2
    reg = ablate.load_grid(args, args.ablation)
    if isinstance(reg, int):
        return reg
    uri = args.tracking_uri = ablate.default_tracking_uri(reg, args.tracking_uri)
    print(f"main job: {reg.name} (Fig. {reg.figure}): {reg.title}")
    print(f"  {len(reg.runs)} runs, est. {ablate.estimate_cpu_minutes(reg):.0f} single-thread CPU-minutes, "
          f"{args.workers} worker(s); MLflow store {redact(uri)}")

    if args.executor == "local" and args.workers > 0:  # its imports on the core the world build leaves idle
        from .launch import start_fork_server

        start_fork_server()
    print("\n[1/3] embedded world", flush=True)
    ablate.ensure_worlds(reg, uri, max(1, args.workers), missing_default=True)
    print(f"\n[2/3] ablation {reg.name}: {len(reg.variants)} variants x {len(reg.seeds)} seeds", flush=True)
    result = ablate.run_grid(reg, args)
    if isinstance(result, int) or result.interrupted:
        return result if isinstance(result, int) else result.exit_code

    print(f"\n[3/3] figure and report: python -m reports.build {reg.name}", flush=True)
    from reports.build import build

    pdf, errors = None, []
    try:  # results/<name>/report.pdf and figure.png|pdf, also logged to the parent run
        res = build([str(reg.path)], uri, RESULTS)
        pdf, errors = res.reports.get(reg.name), list(res.errors.values())  # build printed them
    except Exception as e:  # noqa: BLE001 - the runs are done; say what failed
        errors = [f"{type(e).__name__}: {e}"]
        print(f"  FAILED: {errors[0]}", file=sys.stderr)
    from analysis.compare import after_run

    print("\nagainst the committed reference results (python -m analysis.compare):")
    after_run(reg.name, uri)  # per claim: the reference's verdict and this run's; per metric: in the band or not
    print(f"\ndone in {fmt_duration(time.time() - t0)}.")
    if pdf is not None:
        print(f"report: {pdf.resolve()}\n  open it:    xdg-open {pdf}   (macOS: open {pdf})")
    fig_png = Path(RESULTS, reg.name, "figure.png")
    if fig_png.exists():
        print(f"figure: {fig_png.resolve()}")
    print(f"runs:   mlflow server --backend-store-uri {redact(uri)}   then {tracking.ui_url(uri, reg.name)}\n"
          f"  (the parent run {reg.name!r} <date> holds report.pdf and claims.json; the claims' verdicts are its tags)")
    if result.failed:
        print(f"{len(result.failed)} run(s) failed (see the summary above); rerun the same command to retry them.")
    return 1 if (result.failed or errors) else 0


if __name__ == "__main__":
    sys.exit(main())
