"""Hyperparameter sweeps: an Optuna study over TrainConfig keys, every trial an MLflow child run.

    python -m harness.sweep ablations/sweep_delta_eta.yaml --trials 16 --workers 2
    python -m analysis.sweep_plots sweep_delta_eta      # plots, trials table, best trial

A sweep file becomes tasks here (Optuna's ask/tell on a shared RDB storage: every runner asks the
next trial, each seed of it is a task); the study layer (harness.study) runs them on any executor
(`--executor slurm` as for grids). A trial scores the mean over its seeds (score_run); collapsed
trials stay COMPLETE, a FAILED run fails its trial, the pruner stops weak ones. `--trials` is the
study's TOTAL of trials with an outcome: rerunning continues the study and makes up trials cut off
by Ctrl-C, a dead worker or a dead runner; several runners may share one study. A run is found by
its configuration (not trained again once FINISHED, resumed when KILLED). A sweep with a design
sampler (random, sobol), choices drawn only `when` others allow them, `group`s, `worlds` and
`objectives` is a study over many choices at once (harness.design; ablations/study_tricks.yaml;
analysis.tricks reads it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from harness import design, keys, prog, schema, tracking
from harness.schema import ConfigError
from harness.study import Progress, Study, StudyBusy, add_executor_args, cluster_params, executor_problems
from harness.sweepfile import (
    Dimension,
    StudyObjective,
    SweepFile,
    SweepSpec,
    build_config,
    fmt_value,
    load_sweep,
    make_pruner,
    make_sampler,
)
from harness.sweepstore import (
    ATTR_PARENT_RUNS,
    ATTR_SWEEP,
    HEARTBEAT_S,
    database_identity,
    database_problem,
    default_storage_url,
    make_storage,
)
from harness.trials import Heartbeat, TrialSource, made_up, make_up, trial_counts
from harness.worlds import build_worlds


def open_study(spec: SweepSpec, storage_url: str, heartbeat_s: int = HEARTBEAT_S) -> tuple[Any, Any]:
    """Create the study (named after the sweep) and queue the sweep file's first trials, or load it to continue;
    (study, storage). The storage keeps a heartbeat per running trial (harness.trials: a stale one is made up by
    the next runner to look)."""
    storage = make_storage(storage_url, heartbeat_s=heartbeat_s, on_stale=lambda study, trial: make_up(spec, study, trial))
    quiet = warnings.catch_warnings(action="ignore", category=optuna.exceptions.ExperimentalWarning)
    with tracking.sqlite_lock(storage_url), quiet:  # multivariate TPE is experimental in Optuna
        try:  # one row under the study name's unique key: exactly one runner, on any machine, creates it
            study = optuna.create_study(storage=storage, study_name=spec.name, direction=spec.direction,
                                        sampler=make_sampler(spec), pruner=make_pruner(spec))
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(study_name=spec.name, storage=storage, sampler=make_sampler(spec),
                                      pruner=make_pruner(spec))
            created = False
    stored = study.direction.name.lower()
    if stored != spec.direction:
        raise ConfigError([f"{spec.path}: direction: got {spec.direction!r} but study {spec.name!r} in "
                           f"{tracking.redact(storage_url)} was created with {stored!r}; allowed: {stored!r} "
                           "(or a new sweep name)"])
    if created:  # its creator queues the first trials: runners opening it at the same moment queue none
        for i, point in enumerate(spec.file.first_trials):  # enqueued: not the design's points (design_index)
            study.enqueue_trial(point, user_attrs={"first_trial": i})
    return study, storage


def run_sweep(spec: SweepSpec, *, workers: int = 1, storage_url: str | None = None, threads: int | None = None,
              executor: str = "local", nproc: int | None = None, launcher: str = "torchrun",
              cluster: dict[str, Any] | None = None, runs_dir: str | Path = "runs",
              heartbeat_s: int = HEARTBEAT_S) -> dict[str, Any]:
    """Run the study up to spec.trials total trials on the study layer; returns counts, best trial,
    parent run, the errors of workers that died. Torch threads per trial: `threads`, else the config's
    `threads`, else the CPUs split between workers."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    uri = spec.tracking_uri
    storage_url = storage_url or default_storage_url(uri)
    for line in spec.warnings:
        print(f"[sweep {spec.name}] warning: {line}", flush=True)
    tracking.client(uri)  # the store answers (StoreError), before a study is made in the storage
    if spec.worlds:  # built once each (cached by config hash), as a grid over worlds does
        build_worlds(spec.worlds, uri, max(1, workers))
    study, storage = open_study(spec, storage_url, heartbeat_s)
    try:
        status, interrupted = "FINISHED", False
        # one study, however its URL is spelled (password in it or in PGPASSWORD): the database's own identity
        with Study(uri, spec.name, ("sweep", spec.name, database_identity(storage)), runs_dir=runs_dir,
                   exclusive=False, what="python -m harness.sweep", noun="sweep") as st:
            with st.creation_lock():  # one parent run when two sweeps start at once on this machine
                stored = study.user_attrs.get(ATTR_SWEEP)
                if stored and stored["search_space"] != (now := json.loads(json.dumps(spec.to_attr()["search_space"]))):
                    added = sorted(set(now) - set(stored["search_space"]))
                    if added and set(added) <= set(spec.file.sampler.added) and all(
                            now.get(k) == v for k, v in stored["search_space"].items()):
                        print(f"[sweep {spec.name}] choices added to the study (sampler.added): {', '.join(added)}; its "
                              "earlier trials keep their draws and ran without them")
                    else:
                        print(f"[sweep {spec.name}] warning: the search space differs from the one this study was started "
                              "with; continuing the same study")
                study.set_user_attr(ATTR_SWEEP, spec.to_attr())
            parent_run_id = st.parent(create=True, run_name=f"sweep {spec.name}", tags={
                keys.TAG_SWEEP: spec.name, "harness.optuna_study": spec.name,
                "harness.optuna_storage": tracking.redact(storage_url), "harness.sweep_file": str(spec.path)}, params={
                "sweep.direction": spec.direction, "sweep.objective": spec.metric,
                **{f"sweep.objective.{k}": v for k, v in dataclasses.asdict(spec.file.objective).items() if k != "metric"},
                "sweep.search_space": spec.to_attr()["search_space"], "sweep.sampler": dataclasses.asdict(spec.file.sampler),
                "sweep.pruner": dataclasses.asdict(spec.file.pruner), "sweep.seeds": spec.seeds, "sweep.steps": spec.steps})
            with st.creation_lock():
                runs = dict(study.user_attrs.get(ATTR_PARENT_RUNS) or {})
                if runs.get(tracking.redact(uri)) != parent_run_id:
                    tracking.log_text_artifact(uri, parent_run_id, spec.path.read_text(), "sweep.yaml")
                    study.set_user_attr(ATTR_PARENT_RUNS, {**runs, tracking.redact(uri): parent_run_id})
            lost = made_up(spec, study, storage)  # dead runners' trials (harness.trials): made up here
            counts = trial_counts(study)
            remaining = max(0, spec.trials - counts["counted"] - counts["running"])  # queued ones are run here
            n_workers = max(0, min(workers, remaining * len(spec.units))) if workers else 0
            print(f"[sweep {spec.name}] study in {tracking.redact(storage_url)}: {counts['counted']} finished, "
                  f"{counts['running']} running elsewhere, {counts['interrupted']} interrupted"
                  + (f" (trials {lost} of a runner that died: made up)" if lost else "")
                  + f"; target {spec.trials} total -> running {remaining} now with {max(1, n_workers) if remaining else 0}"
                  " worker(s)", flush=True)
            cpus = max(1, (os.cpu_count() or 1) // n_workers) if n_workers > 1 else None
            threads = threads or spec.base_config.get("threads") or cpus
            heartbeat = Heartbeat(storage, spec.name, heartbeat_s)
            source = TrialSource(spec, study, storage, threads, nproc, launcher, parent_run_id, heartbeat)
            progress = Progress(spec.name, source.total, 0, bars=False)
            try:
                outcomes, interrupted = st.execute(source, executor=executor, workers=n_workers if remaining else 0,
                                                   progress=progress, cluster=cluster)
            except optuna.exceptions.StorageInternalError as e:  # the study's database stopped answering: it
                source.open.clear()  # cannot be told; its open trials go stale and are made up by the next runner
                st.finish("FAILED", tags={keys.TAG_FAILURE: f"the study's database stopped answering: "
                                                            f"{database_problem(e)}"[:4000]})
                raise
            finally:
                if source.open:  # Ctrl-C, or a runner-side error: made up next time
                    source.interrupt()
                    interrupted = True
                heartbeat.stop()
            tags: dict[str, str] = {}
            if interrupted:
                status = "KILLED"
            elif source.worker_died:
                status = "FAILED"
                reason = "; ".join(dict.fromkeys(source.worker_died)) + "; rerun the same command to make them up"
                tags[keys.TAG_FAILURE] = reason[:4000]
                print(f"[sweep {spec.name}] warning: {reason}", file=sys.stderr)
            counts = trial_counts(study)
            best = next(iter(study.best_trials), None) if any(
                t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)) else None
            if best:
                tags |= {"harness.best_trial": str(best.number), "harness.best_params": json.dumps(best.params)[:5000]}
            st.finish(status, tags=tags, clear=(keys.TAG_FAILURE,) if status == "FINISHED" else ())
        return {"counts": counts, "best": best, "parent_run_id": parent_run_id, "worker_errors": source.worker_died,
                "storage_url": storage_url, "interrupted": interrupted}
    finally:  # its connections closed now, not when the process ends (a caller in-process: tests, notebooks)
        storage.engine.dispose()


def hardware_problems(spec: SweepSpec, nproc: int | None) -> list[str]:
    """What the trials' base config cannot do on this hardware at `nproc` ranks (harness.parallel.validate: a
    batch that does not split over them, a device or precision not here), before a study or run exists."""
    from harness.parallel import validate  # lazy: torch

    cfg, _ = build_config(spec.base_config)  # searched keys at their defaults; a trial's own values fail that trial
    return [] if cfg is None else [f"{spec.path}: {p}" for p in validate(cfg, world_size=nproc)]


def print_dry_run(spec: SweepSpec) -> None:
    """The plan: trials x runs each, the search space, the objectives, and for a design (random, sobol) how
    often the planned trials draw each value."""
    worlds = f" x {len(spec.worlds)} world(s) {sorted(spec.worlds)}" if spec.worlds else ""
    print(f"sweep {spec.name}: {spec.trials} trials x {len(spec.seeds)} seed(s){worlds} = "
          f"{spec.trials * len(spec.units)} runs x {spec.steps} steps, objective {spec.metric} ({spec.direction}), "
          f"sampler {spec.file.sampler.name}")
    for k, v in spec.to_attr()["search_space"].items():
        print(f"  {k}: {json.dumps(v)}")
    for o in spec.objectives:
        print(f"  objective {o.name}: " + ("collapsed (the run's collapse flag)" if o.stat == "collapsed"
                                            else f"{o.stat} of {o.metric}"))
    for w, (_, d) in sorted(spec.worlds.items()):
        print(f"  world {w}: {d}")
    if spec.design:
        print(f"the design's {spec.trials} trials draw (trials per value):")
        for k, counts in design.coverage(spec.space, spec.design).items():
            print(f"  {k}: " + ", ".join(f"{v} {n}" for v, n in counts.items()))
    for line in spec.warnings:
        print(f"warning: {line}")


DESIGN_HELP = """A design (sampler random or sobol, e.g. ablations/study_tricks.yaml): every trial's values are a
function of the seed and its design index, so --dry-run prints how often each value will be drawn, and every
configuration the design will run is checked before the first one. A run is found by its configuration (tags
harness.sweep + harness.config_hash): a configuration FINISHED in the store is not trained again, one left
KILLED resumes from its checkpoint. Analysis: python -m analysis.tricks NAME."""


def build_parser() -> argparse.ArgumentParser:
    dims = schema.help_text(Dimension).replace("[top level]", "[search_space.<TrainConfig key>]")
    objs = schema.help_text(StudyObjective).replace("[top level]", "[objectives: each item]")
    p = argparse.ArgumentParser(prog=prog("harness.sweep"), description=__doc__,
                                epilog=f"Sweep file (YAML):\n{schema.help_text(SweepFile)}\n{dims}\n{objs}\n{DESIGN_HELP}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="sweep YAML, e.g. ablations/sweep_delta_eta.yaml")
    p.add_argument("--trials", type=int, help="TOTAL trials the study should hold (overrides `trials:`)")
    p.add_argument("--workers", type=int, default=1, help="runs at a time, each in its own process or job "
                   "(0: in this process, for pdb; default 1); several runners may share one study")
    p.add_argument("--storage", help="Optuna RDB URL (default: optuna.db next to MLflow's sqlite file)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the train "
                   "config's, else sqlite:///mlflow.db)")
    p.add_argument("--threads", type=int, help="torch threads per trial (default: `threads`, else CPUs / workers)")
    p.add_argument("--runs-dir", default="runs", metavar="DIR", help="the runner's own files (submitit jobs, the lock "
                   "of a store that is no sqlite file) under DIR/NAME/ (default: runs)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="train-config override for every trial (ppo.steps=50), or sweep.<field>=v for the sweep "
                   "file (sweep.seeds=2, sweep.pruner.name=none); repeatable")
    p.add_argument("--heartbeat", type=int, default=HEARTBEAT_S, metavar="S", help="seconds between a runner's "
                   f"heartbeats for its trials, in the study's database (default {HEARTBEAT_S}); a trial without one "
                   "for 4x as long is dead, made up by the next runner to look, on any machine")
    p.add_argument("--dry-run", action="store_true", help="validate the sweep file and print the search space; "
                   "nothing is created")
    add_executor_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    args = build_parser().parse_args(argv)
    try:
        for flag, v in (("--workers", args.workers), ("--threads", args.threads), ("--trials", args.trials),
                        ("--heartbeat", args.heartbeat)):
            if v is not None and v < (0 if flag == "--workers" else 1):
                raise ConfigError([f"{flag}: got {v}; allowed: an integer >= {0 if flag == '--workers' else 1}"])
        if problems := executor_problems(args):
            raise ConfigError(problems)
        trials = [] if args.trials is None else [f"sweep.trials={args.trials}"]
        spec = load_sweep(args.file, args.overrides + trials, args.tracking_uri)
        if problems := hardware_problems(spec, args.nproc):
            raise ConfigError(problems)
        if args.dry_run:
            print_dry_run(spec)
            return 0
        result = run_sweep(spec, workers=args.workers, storage_url=args.storage, threads=args.threads,
                           executor=args.executor, nproc=args.nproc, launcher=args.launcher,
                           cluster=cluster_params(args, f"sweep-{spec.name}"), runs_dir=args.runs_dir,
                           heartbeat_s=args.heartbeat)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except tracking.StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StudyBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except optuna.exceptions.StorageInternalError as e:
        print(f"error: the study's database {tracking.redact(args.storage or 'beside the MLflow store')} stopped "
              f"answering ({database_problem(e)}); the runs in flight ended KILLED and finished trials are kept: rerun "
              "the same command once it answers, and the study goes on where it stopped", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; rerun the same command to continue the study", file=sys.stderr)
        return 130
    c, best = result["counts"], result["best"]
    print(f"\n== sweep {spec.name}: {c['counted']} trials finished, {c['interrupted']} interrupted, "
          f"{c['running']} running elsewhere ==")
    if best:
        params = ", ".join(f"{k}={fmt_value(v)}" for k, v in best.params.items())
        print(f"best trial {best.number}: {spec.metric} = {best.value:.6g} ({spec.direction}) at {params}"
              + (" (collapsed)" if best.user_attrs.get("collapsed") else ""))
    else:
        print("no completed trial yet")
    print(f"MLflow parent run {result['parent_run_id']} in {tracking.redact(spec.tracking_uri)}")
    print(f"plots and tables: python -m analysis.sweep_plots {spec.name} "  # a masked secret is given again
          f"--tracking-uri {tracking.redact(spec.tracking_uri)} --storage {tracking.redact(result['storage_url'])}")
    if result["interrupted"]:
        return 130
    # Failed, pruned and collapsed trials are results (exit 0); a dead worker process is not.
    return 1 if result["worker_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
