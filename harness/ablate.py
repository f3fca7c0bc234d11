"""Run one ablation: every variant x seed (x world) of a figure file, as child MLflow runs of one parent.

    python -m harness.ablate ablations/score_reparam.yaml --workers 2
    python -m harness.ablate score_reparam --dry-run                  # expand + validate only
    python -m harness.ablate kl_eta --seeds 0 --set ppo.steps=20
    python -m harness.ablate score_reparam --scale paper --executor slurm --slurm-partition gpu --slurm-gpus 8
    python -m harness.ablate --list                                   # the whole registry

A figure file becomes tasks here; the study layer (harness.study) runs them: rerunning resumes from
the MLflow store alone, under the grid's one parent run; a lock per grid keeps a second runner off
it. Resume, layout and executors: docs/CONTRACTS.md, "The ablation runner".
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import keys as K
from . import prog, tracking
from . import summary as S
from .registry import (
    Registry,
    UnknownAblation,
    default_ablations_dir,
    find_ablation,
    format_axis_value,
    load_registry,
    parse_seeds,
    registry_files,
)
from .schema import ConfigError, merge, parse_overrides, to_dict
from .study import (
    Outcome,
    Progress,
    Study,
    StudyBusy,
    Task,
    Tasks,
    add_executor_args,
    cluster_params,
    executor_problems,
    fmt_duration,
    plan,
)
from .tracking import redact
from .worlds import ensure_worlds

# CPU cost model (--list, the main job): one PPO step on the default world (32 prompts x 24-token
# cap, 2 epochs) costs about STEP_COST_S on one thread (0.3-0.5 s idle, more once responses reach the
# cap; bench/ablate_score_reparam.py times it), scaling with batch x cap x epochs.
STEP_COST_S = 0.5
EVAL_COST_S_PER_32_PROMPTS = 0.15
RUN_OVERHEAD_S = 8.0  # worker start, model load, MLflow run set-up and final eval/checkpoint
WORLD_BUILD_CPU_MIN = 4.5  # one default embedded-world build (kind: world), single thread: measured 4.4 CPU-min

# The world's models are small: a second torch thread buys little and on shared cores mostly spins
# (3-step runs: 15-90 s with 2 threads vs 2-4 s with 1), so more cores go to --workers.
DEFAULT_THREADS = 1

def estimate_cpu_minutes(reg: Registry) -> float:
    """Rough single-thread CPU minutes for the whole grid (see STEP_COST_S)."""
    if reg.kind == "world":
        return WORLD_BUILD_CPU_MIN * len(reg.runs)
    total = 0.0
    for r in reg.runs:
        c = r.cfg
        cap = c.generation.max_new_tokens / 24
        per_step = STEP_COST_S * (c.ppo.rollout_batch_size / 32) * cap * (c.ppo.ppo_epochs / 2)
        steps = c.ppo.steps + c.ppo.critic_pretrain_steps + c.reward.running_stats_init  # a pretraining step ~ a step
        evals = (c.ppo.steps // c.logging.eval_every + 1) if c.logging.eval_every else 0
        eval_s = evals * EVAL_COST_S_PER_32_PROMPTS * (c.data.eval_prompts / 32) * cap
        total += per_step * steps + eval_s + RUN_OVERHEAD_S
    return total / 60


NOT_STARTED = "not started: the runner was interrupted"


def fmt_changes(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={format_axis_value(v)}" for k, v in d.items()) or "(same as common)"


def default_tracking_uri(reg: Registry, flag: str | None = None) -> str:
    """--tracking-uri, else $MLFLOW_TRACKING_URI, else the grid's logging.tracking_uri, else sqlite:///mlflow.db."""
    return tracking.resolve_uri(flag, getattr(getattr(reg.common, "logging", None), "tracking_uri", None))


GridBusy = StudyBusy
"""Another runner holds this grid's lock (harness.study)."""


def grid_identity(reg: Registry) -> list:
    """What makes two invocations one grid (one parent run): the same runs with the same configs."""
    return sorted((r.variant, r.seed, r.world if r.world is not None else -1, r.config_hash) for r in reg.runs)


def run_tags(reg: Registry, spec: Any) -> dict[str, str]:
    """The tags that find a run of the grid in the store (and that analysis reads)."""
    tags = {K.TAG_ABLATION: reg.name, K.TAG_FIGURE: reg.figure, K.TAG_VARIANT: spec.variant,
            K.TAG_SEED: str(spec.seed), K.TAG_CONFIG_HASH: spec.config_hash}
    return tags | ({} if spec.world is None else {K.TAG_WORLD_SEED: str(spec.world)})


def plan_tasks(reg: Registry, existing: list[Any], *, tracking_uri: str, runs_dir: Path, threads: int,
               progress: bool, nproc: int | None, launcher: str) -> tuple[list[Task], dict[str, Outcome]]:
    """Split the grid into runs already FINISHED (their outcomes, by run name) and runs to do: resume
    the ones last seen KILLED, start the others (new, or FAILED before) from scratch (harness.study.plan)."""
    tasks: list[Task] = []
    done: dict[str, Outcome] = {}
    for spec in reg.runs:
        tags = run_tags(reg, spec)
        out_dir = runs_dir / reg.name / spec.config_hash  # a changed config never shares a checkpoint
        task = Task(spec.run_name, spec.label, to_dict(spec.cfg), kind=reg.kind, tags=tags, nproc=nproc,
                    launcher=launcher)
        earlier = plan(task, [r for r in existing if tags.items() <= r.data.tags.items()],
                       run_dir=out_dir / spec.run_name if reg.kind == "train" else None)
        if earlier is not None:
            done[spec.run_name] = earlier
            continue
        if reg.kind == "world":
            task.world = {"out_dir": str(out_dir / "world"), "tracking_uri": tracking_uri, "experiment": reg.name}
        else:
            task.steps = spec.cfg.ppo.steps
            task.cfg = merge(task.cfg, {
                "threads": task.cfg["threads"] or threads, "logging.tracking_uri": tracking_uri,
                "logging.experiment": reg.name, "logging.run_name": spec.run_name, "logging.output_dir": str(out_dir),
                "logging.tags": {**spec.cfg.logging.tags, **tags}, "logging.progress": progress,
            })
        tasks.append(task)
    return tasks, done


@dataclass
class AblationResult:
    registry: Registry
    outcomes: list[Outcome]
    parent_run_id: str | None
    tracking_uri: str
    wall_s: float
    interrupted: bool = False
    summary: Any = None
    """pandas DataFrame, one row per variant (S.TRAIN_TABLE / S.WORLD_TABLE columns)."""
    per_run: Any = None
    """pandas DataFrame, one row per run."""

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else (1 if self.failed else 0)


def run_ablation(
    reg: Registry,
    *,
    workers: int = 1,
    tracking_uri: str | None = None,
    runs_dir: str | Path = "runs",
    threads: int | None = None,
    progress: bool | None = None,
    executor_kind: str = "local",
    nproc: int | None = None,
    launcher: str = "torchrun",
    cluster: dict[str, Any] | None = None,
) -> AblationResult:
    """Run (or resume) the grid of `reg` on the study layer; returns outcomes, the parent run id and
    summary tables. Raises GridBusy when another runner holds the grid. cluster: submitit parameters."""
    t0 = time.time()
    uri = default_tracking_uri(reg, tracking_uri)
    runs_dir = Path(runs_dir)
    mine = {K.TAG_ABLATION: reg.name}
    # recover: we hold the grid's lock, so what still says RUNNING has no runner (closed KILLED)
    with Study(uri, reg.name, grid_identity(reg), runs_dir=runs_dir, exclusive=True,
               recover=lambda st: st.mark_dead(mine)) as st:
        existing = tracking.find_runs(uri, reg.name, mine)
        threads = threads or DEFAULT_THREADS
        bars = sys.stderr.isatty() if progress is None else progress
        tasks, outcomes = plan_tasks(reg, existing, tracking_uri=uri, runs_dir=runs_dir, threads=threads,
                                     progress=bars and workers == 0, nproc=nproc, launcher=launcher)
        prog = Progress(reg.name, len(reg.runs), done=len(outcomes), bars=bars)
        n_resume = sum(t.resume for t in tasks)
        how = "in this process" if workers == 0 else f"{executor_kind} executor, {min(workers, len(tasks))} at a time"
        worlds = f" x {len(reg.worlds)} worlds" if reg.worlds else ""
        prog.write(f"{reg.name} (Fig. {reg.figure}): {len(reg.runs)} runs = {len(reg.variants)} variants x "
                   f"{len(reg.seeds)} seeds{worlds}; {len(outcomes)} finished earlier, {n_resume} to resume, "
                   f"{len(tasks) - n_resume} to start"
                   + (f"; {how} x {threads} thread(s)" if tasks else " (nothing to run)"))
        for line in reg.warnings:
            prog.write(f"warning: {line}")
        for o in outcomes.values():
            prog.write(f"  skip   {o.label}: finished earlier (run {o.run_id})")

        parent_id = st.parent(
            create=bool(tasks), run_name=f"{reg.name} {time.strftime('%Y-%m-%d %H:%M:%S')}",
            tags={K.TAG_ABLATION: reg.name, K.TAG_FIGURE: reg.figure, "harness.registry_file": str(reg.path),
                  "harness.scale": reg.scale},
            params={"registry_file": str(reg.path), "scale": reg.scale, "seeds": reg.seeds,
                    "variants": reg.variant_names, "runs": len(reg.runs), "worlds": sorted(reg.worlds),
                    **{f"common.{k}": v for k, v in reg.common_changes.items()}},
            note=f"{reg.title}\n\n{reg.description}")
        interrupted = False
        if tasks:
            tracking.set_tags(uri, parent_id, {"harness.workers": str(workers), "harness.executor": executor_kind,
                                               "harness.threads_per_run": str(threads)})
            ran, interrupted = st.execute(Tasks(tasks), executor=executor_kind, workers=workers, progress=prog,
                                          cluster=cluster)
            outcomes |= ran
            st.mark_dead(mine)  # runs whose worker died under them: KILLED, so a rerun resumes them
        else:
            prog.close()

        # an interrupt leaves the runs still queued without an outcome: not started, as a rerun will see them
        ordered = [outcomes.get(r.run_name) or Outcome(r.run_name, r.label, "KILLED", error=NOT_STARTED,
                                                       note=NOT_STARTED) for r in reg.runs]
        result = AblationResult(reg, ordered, parent_id, uri, time.time() - t0, interrupted)
        out = runs_dir / reg.name
        try:  # summary_runs.csv (per run) and summary.csv (per variant), also on the parent run
            result.per_run, result.summary = summarize(result)
            out.mkdir(parents=True, exist_ok=True)
            result.per_run.to_csv(out / "summary_runs.csv", index=False)
            result.summary.to_csv(out / "summary.csv")
            if parent_id and tasks:
                tracking.log_file_artifacts(uri, parent_id, [out / "summary_runs.csv", out / "summary.csv"])
        except Exception as e:  # noqa: BLE001 - a summary problem must not hide the runs' outcome
            print(f"(could not build or write the summary under {out}: {type(e).__name__}: {e})", file=sys.stderr)
        if tasks:  # a rerun that found everything finished leaves the parent as it was
            failed = [o for o in ordered if not o.ok and o.status != "KILLED"]
            tags = {"harness.failed_runs": str(len(failed)), "harness.runs_total": str(len(ordered))}
            if failed:
                tags["harness.failed"] = "; ".join(f"{o.label}: {o.why[:200]}" for o in failed)[:4900]
            st.finish("KILLED" if interrupted else ("FAILED" if failed else "FINISHED"), tags=tags,
                      clear=() if failed else ("harness.failed", K.TAG_FAILURE), metrics={
                          "grid/runs": len(ordered), "grid/failed": len(result.failed),
                          "grid/collapsed": sum(bool(o.collapsed) for o in ordered)})
    return result


def summarize(result: AblationResult) -> tuple[Any, Any]:
    """Per run, each column of S.TRAIN_TABLE / S.WORLD_TABLE (harness.summary.reduce_run over its logged
    steps, the last value if a step was logged twice); per variant, harness.summary.variant_table."""
    import pandas as pd

    reg = result.registry
    columns = S.WORLD_TABLE if reg.kind == "world" else S.TRAIN_TABLE
    specs = {r.run_name: r for r in reg.runs}
    rows = []
    for o in result.outcomes:
        spec = specs[o.key]
        row: dict[str, Any] = {"variant": spec.variant, "seed": spec.seed, "world": spec.world, "status": o.status,
                               "run_id": o.run_id, "collapsed": bool(o.collapsed), "error": o.error or ""}
        for header, key, stat in columns:
            history = tracking.metric_history(result.tracking_uri, o.run_id, key) if o.run_id else []
            if history:
                row[header] = S.reduce_run(S.by_step(history), stat)
        rows.append(row)
    per_run = pd.DataFrame(rows)
    if not reg.worlds:
        per_run = per_run.drop(columns="world")
    return per_run, S.variant_table(per_run, [h for h, _, _ in columns])


def print_summary(result: AblationResult) -> None:
    import pandas as pd

    reg = result.registry
    print(f"\n== {reg.name} (Fig. {reg.figure}) — {len(result.outcomes)} runs in {fmt_duration(result.wall_s)}; "
          f"store {redact(result.tracking_uri)}, experiment {reg.name!r}"
          + (f", parent run {result.parent_run_id}" if result.parent_run_id else ""))
    if result.summary is not None and len(result.summary):
        with pd.option_context("display.max_columns", None, "display.width", 200, "display.max_colwidth", 40):
            print(f"\nmean ± sd over seeds of: final = mean of the last {S.FINAL_TAIL:.0%} of logged steps, "
                  f"peak = largest value (as in the report's table):")
            print(result.summary.to_string())
    if result.failed:
        print(f"\n{len(result.failed)} run(s) did not finish:")
        for o in result.failed:
            run = f"  (run {o.run_id})" if o.run_id else ""
            print(f"  - {o.label}: {o.status}: {o.why}{run}")
    if result.interrupted:
        stopped = sum(o.status == "KILLED" and o.note != NOT_STARTED for o in result.outcomes)
        queued = sum(o.note == NOT_STARTED for o in result.outcomes)
        print(f"\ninterrupted: {len(result.outcomes) - len(result.failed)} of {len(result.outcomes)} runs finished, "
              f"{stopped} stopped (KILLED, resumable), {queued} not started; rerun the same command to resume.")
    elif result.failed:
        print("Rerun the same command to retry them; finished runs are skipped.")
    else:
        print(f"\nall {len(result.outcomes)} runs finished.")


def add_grid_args(ap: argparse.ArgumentParser, workers: int) -> None:
    """The options that pick and run a grid, shared with the main job (harness.main)."""
    ap.add_argument("--workers", type=int, default=workers, metavar="N",
                    help=f"runs at a time, each in its own process or job (0: here, for pdb; default {workers})")
    ap.add_argument("--seeds", metavar="LIST", help="seeds to run instead of the file's, e.g. 0,1 or 0-4")
    ap.add_argument("--worlds", metavar="LIST", help="world seeds to run every variant x seed on instead of the "
                    "file's `worlds`, e.g. 0,1,2 (each world built once, cached by its config hash)")
    ap.add_argument("--set", dest="overrides", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                    help="override a config key in every run, e.g. --set ppo.steps=20 (repeatable)")
    ap.add_argument("--scale", metavar="NAME", help="the file's profiles.NAME, e.g. paper (GPU); default: world (CPU)")
    ap.add_argument("--variant", dest="variants", action="append", default=[], metavar="NAME",
                    help="run only this variant (repeatable; exact legend name)")
    ap.add_argument("--tracking-uri", metavar="URI", help="MLflow store (default: $MLFLOW_TRACKING_URI, else the "
                    "base's logging.tracking_uri, else sqlite:///mlflow.db)")
    ap.add_argument("--runs-dir", default="runs", metavar="DIR", help="run folders under DIR/NAME/ (default: runs)")
    ap.add_argument("--no-progress", action="store_true", help="no bars; a line per finished run (elapsed, ETA) stays")
    ap.add_argument("--threads", type=int, metavar="N", help=f"torch threads per run (default {DEFAULT_THREADS})")
    add_executor_args(ap, DEFAULT_THREADS)


def load_grid(args: argparse.Namespace, name: str) -> Registry | int:
    """The registry `name` (a path or a name under ablations/) with the options of add_grid_args; or
    exit code 2, the problems printed, when it is unknown or invalid."""
    try:
        return load_registry(find_ablation(name, getattr(args, "registry", None)), scale=args.scale,
                             seeds=parse_seeds(args.seeds) if args.seeds is not None else None,
                             overrides=parse_overrides([x for group in args.overrides for x in group]),
                             only=args.variants or None,
                             worlds=parse_seeds(args.worlds, "--worlds") if args.worlds is not None else None)
    except (ConfigError, UnknownAblation) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run_grid(reg: Registry, args: argparse.Namespace) -> AblationResult | int:
    """Preflight, then the grid with the options of add_grid_args, its summary printed; or the exit
    code when it cannot run (2: not runnable on this machine, 3: another runner holds the grid)."""
    problems = executor_problems(args) or preflight(reg, args.nproc)
    if problems:
        print("error: " + "\n".join(problems), file=sys.stderr)
        return 2
    if reg.worlds:
        ensure_worlds(reg, default_tracking_uri(reg, args.tracking_uri), max(1, args.workers))
    cluster = cluster_params(args, f"ablate-{reg.name}", DEFAULT_THREADS)
    try:
        result = run_ablation(reg, workers=args.workers, tracking_uri=args.tracking_uri, runs_dir=args.runs_dir,
                              threads=args.threads, progress=False if args.no_progress else None,
                              executor_kind=args.executor, nproc=args.nproc, launcher=args.launcher, cluster=cluster)
    except GridBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    print_summary(result)
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog("harness.ablate"), formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run an ablation grid (one registry YAML = one paper figure) as MLflow child runs; "
                    "rerunning resumes it.",
        epilog="examples:\n" + "\n".join(f"  {line.strip()}" for line in (__doc__ or "").splitlines()[2:7])
        + "\n\nRegistry format: docs/CONTRACTS.md. Config keys for --set: `python -m harness.train --help`.",
    )
    ap.add_argument("file", nargs="?", help="registry YAML (ablations/NAME.yaml) or just NAME")
    ap.add_argument("--list", action="store_true", help="list every registry file, its runs and estimated CPU minutes")
    ap.add_argument("--dry-run", action="store_true", help="print the expanded runs, check every config; train nothing")
    ap.add_argument("--registry", metavar="DIR", help="figure-file folder (default: ./ablations, else the checkout's)")
    add_grid_args(ap, workers=1)
    return ap


def list_registry(ablations_dir: str | None = None) -> int:
    head = ("file", "fig", "kind", "variants", "seeds", "steps", "est. CPU min", "variant names")
    rows = [head]
    files = registry_files(ablations_dir)
    if not files:
        print(f"error: no figure files (*.yaml) in {ablations_dir or default_ablations_dir()}; run from the folder "
              "that holds ablations/ or pass --registry DIR", file=sys.stderr)
        return 2
    for p in files:
        try:
            reg = load_registry(p)
        except ConfigError as e:
            rows.append((p.name, *["?"] * 6, f"INVALID: {e.problems[0]} (run --dry-run on it for all problems)"))
            continue
        rows.append((p.name, reg.figure, reg.kind, len(reg.variants), len(reg.seeds),
                     reg.common.ppo.steps if reg.kind == "train" else "-", f"{estimate_cpu_minutes(reg):.0f}",
                     "; ".join(reg.variant_names)))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head) - 1)]
    for r in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)) + "  " + str(r[-1]))
    print(f"\nest. CPU min = single-thread minutes for the whole grid at the default (world) scale: "
          f"steps x variants x seeds x {STEP_COST_S} s/step (+ evals, + {RUN_OVERHEAD_S:.0f} s per run); "
          f"divide by the cores you give it.")
    return 1 if any(r[1] == "?" for r in rows) else 0


def print_dry_run(reg: Registry, tracking_uri: str, runs_dir: Path) -> None:
    print(f"{reg.path}: {reg.name!r} (Fig. {reg.figure}, kind {reg.kind}, scale {reg.scale}) — {reg.title}")
    print(f"base: {reg.base}")
    print(f"every run: {fmt_changes(reg.common_changes)}")
    print(f"seeds: {reg.seeds}; panels: {', '.join(reg.panels)}")
    if reg.worlds:
        from .world import built_hash, world_config_hash

        for w, (cfg, d) in reg.worlds.items():
            state = "built" if built_hash(d) == world_config_hash(cfg) else "to be built by the runner"
            print(f"world {w}: {d} ({state})")
    print(f"MLflow: experiment {reg.name!r} at {redact(tracking_uri)}; run folders under {runs_dir / reg.name}/")
    on_gpu = any(getattr(r.cfg, "device", "cpu") == "cuda" for r in reg.runs)
    cost = f"est. {estimate_cpu_minutes(reg):.0f} single-thread CPU-minutes"
    cost = "GPU runs (no CPU-minute estimate)" if on_gpu else cost
    worlds = f" x {len(reg.worlds)} worlds" if reg.worlds else ""
    print(f"{len(reg.runs)} runs ({len(reg.variants)} variants x {len(reg.seeds)} seeds{worlds}), {cost}:")
    w = max(len(r.variant) for r in reg.runs)
    for r in reg.runs:
        where = "" if r.world is None else f"  world {r.world}"
        print(f"  {r.variant:<{w}}  seed {r.seed}{where}  {r.run_name:<32} hash {r.config_hash}  {fmt_changes(r.changed)}")
    for line in reg.warnings:
        print(f"warning: {line}")
    print("all configs valid (dry run: nothing trained)")


def preflight(reg: Registry, nproc: int | None = None) -> list[str]:
    """What would fail runs after they start (hardware, world, data, models, a batch that does not split over
    `nproc` ranks), found before any run exists."""
    if reg.kind != "train":
        return []
    from .models import preflight as check_inputs
    from .parallel import validate as check_hardware

    problems: dict[str, None] = {}
    seen = set()
    built_by_runner = {str(d) for _, d in reg.worlds.values()}  # a grid over worlds builds its own
    for r in reg.runs:  # the hardware rules read every section; the inputs only model and data
        d = to_dict(r.cfg)
        def hardware(cfg: Any) -> list[str]:  # at --nproc ranks, when given (else as launched: 1)
            return check_hardware(cfg, world_size=nproc)

        for check, key in ((hardware, {k: v for k, v in d.items() if k not in ("seed", "logging")}),
                           (check_inputs, [d["model"], d["data"], d["generation"]])):
            if (k := (check.__name__, json.dumps(key, sort_keys=True, default=str))) not in seen:
                seen.add(k)
                found = [p for p in check(r.cfg) if not (r.cfg.data.world_dir in built_by_runner and "no built world" in p
                                                          or r.cfg.data.world_dir in built_by_runner and "world:" in p)]
                problems |= {f"{r.variant}: {p}" if len(reg.variants) > 1 else p: None for p in found}
    if any("no built world" in p for p in problems):
        problems["or run the whole main job (world + ablation + figures + report): python -m harness.main"] = None
    return list(problems)


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.list:
        return list_registry(args.registry)
    if not args.file:
        ap.error("give a registry file (e.g. ablations/score_reparam.yaml) or --list")
    if args.workers < 0:
        ap.error("--workers must be 0 (in this process) or more")
    reg = load_grid(args, args.file)
    if isinstance(reg, int):
        return reg
    if args.dry_run:
        print_dry_run(reg, default_tracking_uri(reg, args.tracking_uri), Path(args.runs_dir))
        problems = executor_problems(args) or preflight(reg, args.nproc)
        if problems:
            print("not runnable on this machine yet:\n  - " + "\n  - ".join(problems), file=sys.stderr)
            return 2
        return 0
    try:
        result = run_grid(reg, args)
    except KeyboardInterrupt:  # before or after the runs (the runs' own interrupt is the result's)
        print("\ninterrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return result if isinstance(result, int) else result.exit_code

if __name__ == "__main__":
    sys.exit(main())
