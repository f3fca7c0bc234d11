"""Rerun the reference results from scratch: the embedded world, every figure file and sweep under
ablations/ (in the paper's order, the sweeps last) at its own seeds and on its `reference_worlds`,
all into one MLflow store, then the committed reports rebuilt from that store
(`python -m reports.build --reference`).

    python -m reports.rerun                          # ~10 hours on 2 cores (the design study 1.4); store in reference-runs/
    python -m reports.rerun --only score_reparam     # some files only: runs, no reports (they need all)
    python -m reports.rerun --no-build               # runs only; build later with reports.build

Resumable: the same command again skips what finished (each grid resumes its own runs, a sweep its
study), so a stop costs at most the runs in flight. The store and run folders are ignored by git;
a file that fails is reported at the end and the others still run. Run it from a clean checkout
of the commit the reference should name: every run records its commit.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from harness import ablate, sweep, tracking
from harness.registry import load_registry, paper_key, registry_files
from harness.schema import ConfigError, read_yaml
from harness.study import fmt_duration

STORE = "reference-runs"


def paper_order(files: list[Path], sweeps: set[Path]) -> list[Path]:
    """The files in the paper's order (each file's `order`, as the combined report), files without
    one after them by name, the sweeps last: a stopped rerun has then done the paper's figures first."""
    def key(f: Path) -> tuple[bool, bool, int, str]:
        try:
            order = read_yaml(f).get("order")
        except ConfigError:  # an invalid file runs last; ablate.main says what is wrong with it
            order = None
        return (f in sweeps, *paper_key(order, f.stem))

    return sorted(files, key=key)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m reports.rerun", description=__doc__.split("\n\n")[0],
                                 epilog="Then: git diff reports/ shows what the new reference changed.")
    ap.add_argument("--store", default=STORE, metavar="DIR",
                    help=f"folder of the MLflow store (mlflow.db), Optuna's optuna.db and the run folders (default {STORE})")
    ap.add_argument("--workers", type=int, default=2, metavar="N", help="runs at a time (default 2)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="only this figure file or sweep, by name (repeatable); runs only: the reference "
                         "reports are built from every file's runs")
    ap.add_argument("--ablations", metavar="DIR", help="folder of the figure files (default: ./ablations or the repo's)")
    ap.add_argument("--no-build", action="store_true", help="runs only, no reports")
    ap.add_argument("--out", metavar="DIR", help="where the reports go (default: the committed reports/)")
    return ap


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    a = build_parser().parse_args(argv)
    files = registry_files(a.ablations, sweeps=True)
    sweeps = set(files) - set(registry_files(a.ablations))
    if a.only:
        unknown = sorted(set(a.only) - {f.stem for f in files})
        if unknown:
            print(f"error: --only {', '.join(unknown)}: no such figure file or sweep; allowed: "
                  f"{', '.join(f.stem for f in files)}", file=sys.stderr)
            return 2
        files = [f for f in files if f.stem in a.only]
    files = paper_order(files, sweeps)
    store = Path(a.store).resolve()
    store.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{store / 'mlflow.db'}"
    t0 = time.time()
    print(f"reference rerun: {len(files)} files into {uri}", flush=True)
    failed = []
    for i, f in enumerate(files, 1):
        print(f"\n[{i}/{len(files)}] {f.stem} ({fmt_duration(time.time() - t0)} elapsed)", flush=True)
        common = ["--workers", str(a.workers), "--tracking-uri", uri]
        if f in sweeps:
            rc = sweep.main([str(f), *common, "--storage", f"sqlite:///{store / 'optuna.db'}"])
        else:  # the world it reads, built when missing and logged to the same store (Fig. 2 / 3 read it)
            worlds = []  # the file's reference_worlds: built by the grid itself, cached by config hash
            with contextlib.suppress(ConfigError):  # an invalid file: ablate.main says what is wrong
                reg = load_registry(f)
                ablate.ensure_worlds(reg, uri, a.workers, missing_default=True)
                worlds = ["--worlds", ",".join(map(str, reg.reference_worlds))] if reg.reference_worlds else []
            rc = ablate.main([str(f), *common, *worlds, "--runs-dir", str(store / "runs"), "--no-progress"])
        if rc == 130:  # Ctrl-C or SIGTERM: its runs ended KILLED; the files after it wait for the rerun
            print(f"\ninterrupted in {f.stem}; rerun the same command to resume", flush=True)
            return 130
        if rc:
            failed.append(f"{f.stem} (exit {rc})")
    print(f"\nruns done in {fmt_duration(time.time() - t0)}"
          + (f"; FAILED: {', '.join(failed)} (rerun the same command to retry them)" if failed else ""), flush=True)
    if a.no_build or a.only or failed:
        if a.only and not failed:
            print(f"reports not rebuilt (--only); when every file has run: python -m reports.build --reference "
                  f"--tracking-uri {uri} --no-log")
        return 1 if failed else 0
    from reports.build import main as build

    return build(["--reference", "--tracking-uri", uri, "--no-log", *(["--out", a.out] if a.out else []),
                  *(["--ablations-dir", a.ablations] if a.ablations else [])])


if __name__ == "__main__":
    sys.exit(main())
