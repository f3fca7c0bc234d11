"""The main job (`make run`): world -> ablation -> figure and report PDF, with progress shown.

    python -m harness.main                                   # Fig. 6 (score_reparam), 2 workers
    python -m harness.main --ablation ablations/kl_eta.yaml --workers 2

1. build the embedded world if it is missing (cached: a built world is reused at once),
2. run the ablation grid (`python -m harness.ablate`; rerunning resumes it),
3. draw its figure and build its report PDF (reports.build, = `python -m reports.build NAME`;
   the figure alone is `python -m analysis.figures NAME`),
4. print where the PDF is and how to browse the runs in the MLflow UI.

Figures and reports go to results/ (ignored by git), so a run leaves `git status` clean; the
committed reports/ change only with `python -m reports.build --reference`.

Failed runs do not stop the figure and report (they show what finished); the exit code is
non-zero when any run failed or a step could not complete.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .config import ConfigError, parse_overrides
from .tracking import redact

DEFAULT_ABLATION = "ablations/score_reparam.yaml"
RESULTS = "results"  # figures and reports of this run (ignored by git)


def _banner(i: int, n: int, text: str) -> None:
    print(f"\n[{i}/{n}] {text}", flush=True)


def build_world_if_missing(reg, tracking_uri: str) -> Path | None:
    """The world every run of this grid reads (data.world_dir), built with default settings."""
    if reg.kind != "train":
        return None
    dirs = sorted({r.cfg.data.world_dir for r in reg.runs if r.cfg.data.source == "world"
                   or str(r.cfg.model.sft_path).startswith("world:")})
    if not dirs:
        print("  this grid does not use the embedded world; nothing to build")
        return None
    from .world import WorldConfig, build_world, built_hash, world_config_hash

    default = WorldConfig()
    for d in dirs:
        have = built_hash(d)
        if have is not None:
            if have == world_config_hash(default):
                print(f"  world at {d}: built (default config {have}), reusing it")
            else:
                print(f"  world at {d}: built from a non-default config ({have}); using it as is. "
                      f"To rebuild with the defaults: python -m harness.world build --out {d} --force")
            continue
        t0 = time.time()
        print(f"  world at {d}: not built yet; building it (pretrain, SFT, preference pairs, reward model: "
              f"several CPU minutes, once)", flush=True)
        build_world(default, d, tracking_uri=tracking_uri, experiment="world", progress=True)
        print(f"  world ready at {d} ({time.time() - t0:.0f} s)")
    return Path(dirs[0])


def build_report(ablation: str, tracking_uri: str, name: str) -> Path | None:
    """reports.build for this one ablation: results/<name>/report.pdf (figure, metrics, claims) and
    results/<name>/figure.png|pdf, also logged to the parent run; None when the store holds no run of it."""
    from reports.build import build

    res = build([ablation], tracking_uri, RESULTS)
    if res.errors:
        raise RuntimeError("; ".join(f"{k}: {v}" for k, v in res.errors.items()))
    return res.reports.get(name)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m harness.main",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The main job: build the embedded world if missing, run an ablation grid, draw its "
                    "figure and build its report PDF. Rerunning resumes where it stopped.",
        epilog="Each step alone: python -m harness.world build | python -m harness.ablate FILE | "
               "python -m analysis.figures NAME | python -m reports.build NAME",
    )
    ap.add_argument("--ablation", default=DEFAULT_ABLATION, metavar="FILE",
                    help=f"registry YAML or name (default: {DEFAULT_ABLATION}, paper Fig. 6)")
    ap.add_argument("--workers", type=int, default=2, metavar="N", help="runs in parallel (default 2)")
    ap.add_argument("--seeds", default=None, metavar="LIST", help="seeds instead of the file's, e.g. 0,1")
    ap.add_argument("--set", dest="overrides", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                    help="override a config key in every run (repeatable), e.g. --set ppo.steps=20")
    ap.add_argument("--scale", default=None, metavar="NAME", help="registry profile, e.g. paper (GPU); default: the embedded world")
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow.db", metavar="URI", help="MLflow store (default: sqlite:///mlflow.db)")
    ap.add_argument("--runs-dir", default="runs", metavar="DIR", help="run folders and checkpoints (default: runs)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap


def main(argv: list[str] | None = None) -> int:
    from . import ablate
    from .registry import load_registry, parse_seeds

    args = build_parser().parse_args(argv)
    t0 = time.time()
    try:
        overrides = parse_overrides([x for g in args.overrides for x in g])
        seeds = parse_seeds(args.seeds) if args.seeds else None
        reg = load_registry(ablate.resolve_registry_path(args.ablation), scale=args.scale, seeds=seeds, overrides=overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in reg.warnings:
        print(f"warning: {line}", file=sys.stderr)
    uri = args.tracking_uri
    steps = 3
    print(f"main job: {reg.name} (Fig. {reg.figure}): {reg.title}")
    print(f"  {len(reg.runs)} runs, est. {ablate.estimate_cpu_minutes(reg):.0f} single-thread CPU-minutes, "
          f"{args.workers} worker(s); MLflow store {redact(uri)}")

    _banner(1, steps, "embedded world")
    build_world_if_missing(reg, uri)
    problems = ablate.preflight(reg)
    if problems:
        print("error: " + "\n".join(problems), file=sys.stderr)
        return 2

    _banner(2, steps, f"ablation {reg.name}: {len(reg.variants)} variants x {len(reg.seeds)} seeds")
    try:
        result = ablate.run_ablation(reg, workers=args.workers, tracking_uri=uri, runs_dir=args.runs_dir,
                                     progress=False if args.no_progress else None)
    except ablate.GridBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    ablate.print_summary(result)
    if result.interrupted:
        return result.exit_code
    problems_after: list[str] = []

    _banner(3, steps, f"figure and report: python -m reports.build {reg.name}")
    pdf = None
    try:
        pdf = build_report(str(reg.path), uri, reg.name)
    except Exception as e:  # noqa: BLE001
        problems_after.append(f"report: {type(e).__name__}: {e}")
        print(f"  FAILED: {type(e).__name__}: {e}", file=sys.stderr)

    print(f"\ndone in {ablate.fmt_duration(time.time() - t0)}.")
    if pdf is not None:
        print(f"report: {pdf.resolve()}")
        print(f"  open it:    xdg-open {pdf}   (macOS: open {pdf})")
    fig_png = Path(RESULTS, reg.name, "figure.png")
    if fig_png.exists():
        print(f"figure: {fig_png.resolve()}")
    print(f"runs:   mlflow ui --backend-store-uri {redact(uri)}   then http://127.0.0.1:5000 -> experiment {reg.name!r}")
    if result.failed:
        print(f"{len(result.failed)} run(s) failed (see the summary above); rerun the same command to retry them.")
    for p in problems_after:
        print(f"problem: {p}", file=sys.stderr)
    return 1 if (result.failed or problems_after) else 0


if __name__ == "__main__":
    sys.exit(main())
