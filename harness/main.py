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
from .registry import REPO_ROOT, Registry
from .tracking import redact

DEFAULT_ABLATION = "score_reparam"
RESULTS = "results"  # figures and reports of this run (ignored by git)


def build_world_if_missing(reg: Registry, tracking_uri: str) -> None:
    """Build the world each run reads (data.world_dir) with default settings, unless one is built
    there: a world built from another config is used as it is (build_world would replace it)."""
    from .world import WorldConfig, build_world, built_hash, world_config_hash

    dirs = sorted({r.cfg.data.world_dir for r in reg.runs if reg.kind == "train" and (
        r.cfg.data.source == "world" or str(r.cfg.model.sft_path).startswith("world:"))})
    if not dirs:
        print("  this grid does not use the embedded world; nothing to build")
    for d in dirs:
        have = built_hash(d)
        if have is not None:
            other = "" if have == world_config_hash(WorldConfig()) else (
                f", not the default config; to rebuild it: python -m harness.world build --out {d} --force")
            print(f"  world at {d}: built ({have}{other}); reusing it")
            continue
        t0 = time.time()
        print(f"  world at {d}: not built yet; building it (pretrain, SFT, preference pairs, reward model: "
              f"several CPU minutes, once)", flush=True)
        build_world(WorldConfig(), d, tracking_uri=tracking_uri, experiment="world", progress=True)
        print(f"  world ready at {d} ({time.time() - t0:.0f} s)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m harness.main",
        description="The main job: build the embedded world if missing, run an ablation grid, draw its "
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
    uri = args.tracking_uri = args.tracking_uri or ablate.default_tracking_uri(reg)
    print(f"main job: {reg.name} (Fig. {reg.figure}): {reg.title}")
    print(f"  {len(reg.runs)} runs, est. {ablate.estimate_cpu_minutes(reg):.0f} single-thread CPU-minutes, "
          f"{args.workers} worker(s); MLflow store {redact(uri)}")

    if args.executor == "local" and args.workers > 0:  # its imports on the core the world build leaves idle
        from .launch import start_fork_server

        start_fork_server()
    print("\n[1/3] embedded world", flush=True)
    build_world_if_missing(reg, uri)
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
    print(f"\ndone in {ablate.fmt_duration(time.time() - t0)}.")
    if pdf is not None:
        print(f"report: {pdf.resolve()}\n  open it:    xdg-open {pdf}   (macOS: open {pdf})")
    fig_png = Path(RESULTS, reg.name, "figure.png")
    if fig_png.exists():
        print(f"figure: {fig_png.resolve()}")
    print(f"runs:   mlflow ui --backend-store-uri {redact(uri)}   then http://127.0.0.1:5000 -> "
          f"experiment {reg.name!r}")
    if result.failed:
        print(f"{len(result.failed)} run(s) failed (see the summary above); rerun the same command to retry them.")
    return 1 if (result.failed or errors) else 0


if __name__ == "__main__":
    sys.exit(main())
