"""Run one ablation: every variant x seed of a registry file, as child MLflow runs of one parent.

    python -m harness.ablate ablations/score_reparam.yaml --workers 2
    python -m harness.ablate score_reparam --dry-run                  # expand + validate only
    python -m harness.ablate kl_eta --seeds 0 --set ppo.steps=20
    python -m harness.ablate score_reparam --scale paper --executor slurm --slurm-partition gpu --slurm-gpus 8
    python -m harness.ablate --list                                   # the whole registry

Rerunning resumes from the MLflow store alone, under the grid's one parent run; a lock per grid
keeps a second runner off it. Resume, layout and executors: docs/CONTRACTS.md, "The ablation runner".
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from . import keys as K
from . import summary as S
from . import prog, tracking
from .launch import EXECUTORS, LAUNCHERS, executor, launch_train
from .registry import (
    Registry, UnknownAblation, default_ablations_dir, find_ablation, format_axis_value, load_registry, parse_seeds,
    registry_files,
)
from .schema import ConfigError, merge, parse_overrides, to_dict
from .tracking import redact

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

# On the parent run: hash of the grid's (variant, seed, config hash) list; a rerun reopens that parent.
TAG_GRID = "harness.grid_hash"
POLL_S = 2.0  # seconds between reads of the store for the progress of runs in flight
SHOWN = ((K.RM_SCORE, "rm"), (K.KL, "kl"), (K.LENGTH, "len"))  # a run in flight on the progress bar


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


def fmt_duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def fmt_changes(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={format_axis_value(v)}" for k, v in d.items()) or "(same as common)"


def default_tracking_uri(reg: Registry) -> str:
    return getattr(getattr(reg.common, "logging", None), "tracking_uri", None) or "sqlite:///mlflow.db"


class GridBusy(RuntimeError):
    """Another runner holds this grid's lock."""


@dataclass
class Task:
    """A run handed to an executor (plain data: it crosses a process boundary)."""

    index: int
    variant: str
    seed: int
    cfg: dict[str, Any]
    """The run's resolved config (TrainConfig or WorldConfig as a dict), runner settings applied."""
    resume: bool
    note: str
    nproc: int | None
    """Ranks per run (None: every visible GPU for a CUDA DeepSpeed config, else 1)."""
    launcher: str
    world: dict[str, Any] | None = None
    """kind world: build_world's out_dir, tracking_uri, experiment and tags (the runner's, by which
    the store finds the run); None for train runs."""
    parent_run_id: str | None = None


@dataclass
class Outcome:
    variant: str
    seed: int
    status: str  # FINISHED | FAILED | KILLED
    run_id: str | None = None
    steps_done: int = 0
    collapsed: bool = False
    collapse_step: int | None = None
    error: str | None = None
    wall_s: float = 0.0
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "FINISHED"

    @property
    def why(self) -> str:
        return (self.error or "no reason recorded").strip().splitlines()[0]

    def describe(self) -> str:
        who = f"{self.variant} · seed {self.seed}"
        if not self.ok:
            return f"{self.status:<6} {who}: {self.why}"
        collapsed = f"collapsed at step {self.collapse_step}" if self.collapse_step else "collapsed"
        bits = [f"{self.steps_done} steps" if self.steps_done else "", fmt_duration(self.wall_s) if self.wall_s else "",
                collapsed if self.collapsed else "", self.note if self.note != "new" else ""]
        return f"done   {who}: " + ", ".join(b for b in bits if b)


def grid_runs(uri: str, name: str, where: str = "") -> list[Any]:
    """Every run (parent and children) grid `name` logged to its experiment, oldest first."""
    query = f"tags.`{K.TAG_ABLATION}` = '{name}'" + (f" and {where}" if where else "")
    runs = tracking.client(uri).search_runs([tracking.ensure_experiment(uri, name)], query, max_results=50000)
    return sorted(runs, key=lambda r: r.info.start_time)


def mark_dead(uri: str, name: str) -> None:
    """Runs of this grid still RUNNING while we hold its lock belong to a runner that died (or a
    worker that crashed): close them as KILLED. Resuming a train run reopens it."""
    for r in grid_runs(uri, name, "attributes.status = 'RUNNING'"):
        tracking.end_run(uri, r.info.run_id, "KILLED")


def plan_tasks(reg: Registry, existing: list[Any], *, tracking_uri: str, runs_dir: Path, threads: int,
               progress: bool, nproc: int | None, launcher: str) -> tuple[list[Task], dict[int, Outcome]]:
    """Split the grid into runs already FINISHED (their outcomes, by index) and runs to do: resume
    the ones last seen KILLED, start the others (new, or FAILED before) from scratch."""
    tasks: list[Task] = []
    done: dict[int, Outcome] = {}
    for i, spec in enumerate(reg.runs):
        tags = {K.TAG_ABLATION: reg.name, K.TAG_FIGURE: reg.figure, K.TAG_VARIANT: spec.variant,
                K.TAG_SEED: str(spec.seed), K.TAG_CONFIG_HASH: spec.config_hash}
        seen = [r for r in existing if tags.items() <= r.data.tags.items()]
        finished = [r for r in seen if r.info.status == "FINISHED"]
        if finished:
            collapsed = finished[-1].data.tags.get(K.TAG_COLLAPSED) == "true"
            done[i] = Outcome(spec.variant, spec.seed, "FINISHED", finished[-1].info.run_id, collapsed=collapsed)
            continue
        last = seen[-1].info.status if seen else None
        resume = reg.kind == "train" and last in ("KILLED", "RUNNING")
        note = "resume from its last checkpoint" if resume else (f"rerun after {last}" if last else "new")
        out_dir = runs_dir / reg.name / spec.config_hash  # a changed config never shares a checkpoint
        task = Task(i, spec.variant, spec.seed, to_dict(spec.cfg), resume, note, nproc, launcher)
        if reg.kind == "world":
            task.world = {"out_dir": str(out_dir / "world"), "tracking_uri": tracking_uri, "experiment": reg.name,
                          "tags": tags}
        else:
            if not resume:  # a fresh start must not pick up the checkpoint of a run the store no longer continues
                shutil.rmtree(out_dir / spec.run_name, ignore_errors=True)
            task.cfg = merge(task.cfg, {
                "threads": task.cfg["threads"] or threads, "logging.tracking_uri": tracking_uri,
                "logging.experiment": reg.name, "logging.run_name": spec.run_name, "logging.output_dir": str(out_dir),
                "logging.tags": {**spec.cfg.logging.tags, **tags}, "logging.progress": progress,
            })
        tasks.append(task)
    return tasks, done


def execute(task: Task) -> Outcome:
    """Run one task to the end; never raises except KeyboardInterrupt."""
    t0 = time.time()
    try:
        out = _build_world(task) if task.world else _train(task)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - one broken run must not take the grid down
        out = Outcome(task.variant, task.seed, "FAILED", error=f"{type(e).__name__}: {e}")
    out.note, out.wall_s = task.note, time.time() - t0
    return out


def _train(task: Task) -> Outcome:
    """harness.train.train in this process, or launch_train when the run needs several ranks."""
    import torch

    from .config import from_dict
    from .train import train

    cfg = from_dict(merge(task.cfg, {"logging.parent_run_id": task.parent_run_id}))  # resumed runs keep theirs
    parent = os.getppid()

    def on_step(step: int, metrics: dict[str, float]) -> bool:
        if os.getppid() != parent:  # orphaned (the runner was killed alone): end KILLED, resumable
            raise KeyboardInterrupt("the ablation runner is gone")
        return False

    # a DeepSpeed config on a GPU machine takes every visible GPU (the paper scale); else one process
    nproc = task.nproc or (torch.cuda.device_count() if cfg.device != "cpu" and cfg.distributed.deepspeed else 1)
    if nproc > 1:
        res = launch_train(cfg, nproc=nproc, resume=task.resume, on_step=on_step, launcher=task.launcher)
    else:
        res = train(cfg, resume=task.resume, on_step=on_step)
    return Outcome(task.variant, task.seed, res.status, res.run_id, res.steps_done, res.collapsed, res.collapse_step,
                   res.error)


def _build_world(task: Task) -> Outcome:
    """kind: world: build a world for this variant; its RM training is the child run."""
    from .world import build_world
    from .world.config import world_config_from_dict

    error, w = None, task.world
    try:
        # force: we only get here when the store has no finished run of this world, so a cached
        # build (which build_world would return without logging) must be rebuilt to be logged.
        build_world(world_config_from_dict(task.cfg), **w, parent_run_id=task.parent_run_id, progress=False, force=True)
    except Exception as e:  # noqa: BLE001 - build_world has ended its run FAILED
        error = f"{type(e).__name__}: {e}"
    # The run build_world logged (found by our tags), so the summary can read its metrics.
    runs = [r for r in grid_runs(w["tracking_uri"], w["experiment"]) if w["tags"].items() <= r.data.tags.items()]
    status = runs[-1].info.status if runs and not error else "FAILED"
    return Outcome(task.variant, task.seed, status, runs[-1].info.run_id if runs else None, error=error)


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


class Progress:
    """One line per finished run. On a terminal also a tqdm bar of the grid, its postfix the train runs
    in flight (step, RM score, KL, length: read from the store every POLL_S, whichever executor runs
    them); elsewhere each line ends with the elapsed time and an ETA (elapsed / runs done here x runs left)."""

    def __init__(self, reg: Registry, done: int, bars: bool):
        self.name, self.on = reg.name, bars
        self.total, self.done, self.t0, self.finished_here = len(reg.runs), done, time.time(), 0
        self.grid = tqdm(total=self.total, initial=done, desc=reg.name, unit="run", dynamic_ncols=True,
                         disable=not bars)
        self.steps = {(r.variant, str(r.seed)): r.cfg.ppo.steps for r in reg.runs if reg.kind == "train"}

    def write(self, line: str) -> None:
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    def finish(self, out: Outcome) -> None:
        self.done += 1
        self.finished_here += 1
        self.grid.update(1)
        line = f"[{self.done:>{len(str(self.total))}}/{self.total}] {out.describe()}"
        if not self.on:
            el = time.time() - self.t0
            eta = el / self.finished_here * (self.total - self.done)
            line += f"  | elapsed {fmt_duration(el)}, ETA {fmt_duration(eta)}"
        self.write(line)

    def poll(self, uri: str) -> None:
        """The train runs in flight, in the grid bar's postfix: latest step and scores from the store."""
        shown = []
        for r in grid_runs(uri, self.name, f"attributes.status = 'RUNNING' and tags.`{K.TAG_ROLE}` = 'train'"):
            v, seed, m = r.data.tags.get(K.TAG_VARIANT), r.data.tags.get(K.TAG_SEED), r.data.metrics
            step = max((s for s, _ in tracking.metric_history(uri, r.info.run_id, K.RM_SCORE)), default=0)
            scores = "".join(f" {short}={m[k]:.3g}" for k, short in SHOWN if k in m)
            shown.append(f"{v} · s{seed} {step}/{self.steps.get((v, seed), '?')}{scores}")
        self.grid.set_postfix_str("; ".join(shown))


def collect(f: Future, t: Task, outcomes: dict[int, Outcome]) -> Outcome:
    """Record the run's Outcome, or FAILED with why when its worker process or job died under it."""
    try:
        outcomes[t.index] = f.result()
    except Exception as e:  # noqa: BLE001 - a dead worker process, or submitit's FailedJobError: a job that died
        why = (f"{type(e).__name__}: {e}" if not isinstance(e, BrokenProcessPool)
               else "worker process died (killed, often for memory, or crashed); rerun to resume it")
        outcomes[t.index] = Outcome(t.variant, t.seed, "FAILED", error=why, note=t.note)
    return outcomes[t.index]


def open_parent(reg: Registry, uri: str, existing: list[Any], create: bool) -> str | None:
    """The grid's parent run: the one an earlier invocation of this grid opened (reopened), else a
    new one if `create`."""
    grid = json.dumps(sorted((r.variant, r.seed, r.config_hash) for r in reg.runs))
    ghash = hashlib.sha256(grid.encode()).hexdigest()[:16]
    same = [r for r in existing if r.data.tags.get(K.TAG_ROLE) == "parent" and r.data.tags.get(TAG_GRID) == ghash]
    if same:
        tracking.reopen_run(uri, same[-1].info.run_id)
        return same[-1].info.run_id
    if not create:
        return None
    pid = tracking.start_run(uri, reg.name, f"{reg.name} {time.strftime('%Y-%m-%d %H:%M:%S')}", tags={
        K.TAG_ROLE: "parent", K.TAG_ABLATION: reg.name, K.TAG_FIGURE: reg.figure, K.TAG_COMMIT: tracking.git_commit(),
        TAG_GRID: ghash, "harness.registry_file": str(reg.path), "harness.scale": reg.scale,
    })
    c = tracking.client(uri)  # the experiment's description in the MLflow UI
    c.set_experiment_tag(c.get_run(pid).info.experiment_id, "mlflow.note.content", f"{reg.title}\n\n{reg.description}")
    tracking.log_params(uri, pid, {
        "registry_file": str(reg.path), "scale": reg.scale, "seeds": reg.seeds, "variants": reg.variant_names,
        "runs": len(reg.runs), **{f"common.{k}": v for k, v in reg.common_changes.items()},
    })
    return pid


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
    """Run (or resume) the grid of `reg`; returns outcomes, the parent run id and summary tables.
    Raises GridBusy when another runner holds the grid. cluster: submitit parameters (--executor slurm)."""
    t0 = time.time()
    uri = tracking_uri or default_tracking_uri(reg)
    runs_dir = Path(runs_dir)
    # one lock per grid and store: beside a sqlite store's file, else in the grid's runs folder
    db, local = Path(uri.removeprefix("sqlite:///")), uri.startswith("sqlite:///")
    lock = db.parent / f"{reg.name}.ablate.{db.name}.lock" if local else runs_dir / reg.name / "ablate.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        held = FileLock(lock).acquire(timeout=0)
    except Timeout:
        raise GridBusy(f"another `python -m harness.ablate` is running grid {reg.name!r} on store {uri} "
                       f"(lock {lock}); wait for it to finish, or stop it, then rerun") from None
    with held:
        mark_dead(uri, reg.name)
        existing = grid_runs(uri, reg.name)
        threads = threads or DEFAULT_THREADS
        bars = sys.stderr.isatty() if progress is None else progress
        tasks, outcomes = plan_tasks(reg, existing, tracking_uri=uri, runs_dir=runs_dir, threads=threads,
                                     progress=bars and workers == 0, nproc=nproc, launcher=launcher)
        prog = Progress(reg, done=len(outcomes), bars=bars)
        n_resume = sum(t.resume for t in tasks)
        how = "in this process" if workers == 0 else f"{executor_kind} executor, {min(workers, len(tasks))} at a time"
        prog.write(f"{reg.name} (Fig. {reg.figure}): {len(reg.runs)} runs = {len(reg.variants)} variants x "
                   f"{len(reg.seeds)} seeds; {len(outcomes)} finished earlier, {n_resume} to resume, "
                   f"{len(tasks) - n_resume} to start"
                   + (f"; {how} x {threads} thread(s)" if tasks else " (nothing to run)"))
        for line in reg.warnings:
            prog.write(f"warning: {line}")
        for o in outcomes.values():
            prog.write(f"  skip   {o.variant} · seed {o.seed}: finished earlier (run {o.run_id})")

        parent_id = open_parent(reg, uri, existing, create=bool(tasks))
        interrupted = False
        if tasks:
            tracking.set_tags(uri, parent_id, {"harness.workers": str(workers), "harness.executor": executor_kind,
                                               "harness.threads_per_run": str(threads)})
            for t in tasks:
                t.parent_run_id = parent_id
                outcomes[t.index] = Outcome(t.variant, t.seed, "KILLED", error="interrupted", note="interrupted")
            ex = executor(executor_kind, workers, runs_dir / reg.name / "submitit", **(cluster or {}))
            futures: dict[Future, Task] = {}
            try:
                for t in tasks:
                    f = ex.submit(execute, t)
                    futures[f] = t
                    if f.done():  # --workers 0 ran it already
                        prog.finish(collect(f, futures.pop(f), outcomes))
                while futures:  # each outcome as it finishes, polling the store for the bar meanwhile
                    for f in wait(futures, timeout=POLL_S if prog.on else None, return_when=FIRST_COMPLETED).done:
                        prog.finish(collect(f, futures.pop(f), outcomes))
                    if prog.on and futures:
                        prog.poll(uri)
                ex.shutdown()
            except KeyboardInterrupt:
                interrupted = True
                prog.write("\ninterrupted: runs in flight end KILLED; rerun the same command to resume them")
                ex.shutdown(cancel=True)
            mark_dead(uri, reg.name)  # runs whose worker died under them: KILLED, so a rerun resumes them
        prog.grid.close()

        ordered = [outcomes[i] for i in sorted(outcomes)]
        result = AblationResult(reg, ordered, parent_id, uri, time.time() - t0, interrupted)
        out = runs_dir / reg.name
        try:  # summary_runs.csv (per run) and summary.csv (per variant), also on the parent run
            result.per_run, result.summary = summarize(result)
            out.mkdir(parents=True, exist_ok=True)
            result.per_run.to_csv(out / "summary_runs.csv", index=False)
            result.summary.to_csv(out / "summary.csv")
            if parent_id:
                tracking.log_file_artifacts(uri, parent_id, [out / "summary_runs.csv", out / "summary.csv"])
        except Exception as e:  # noqa: BLE001 - a summary problem must not hide the runs' outcome
            print(f"(could not build or write the summary under {out}: {type(e).__name__}: {e})", file=sys.stderr)
        if parent_id:
            failed = result.failed
            tags = {"harness.failed_runs": str(len(failed)), "harness.runs_total": str(len(result.outcomes))}
            if failed:
                tags["harness.failed"] = "; ".join(f"{o.variant} s{o.seed}: {o.why[:200]}" for o in failed)[:4900]
            tracking.set_tags(uri, parent_id, tags)
            collapsed = sum(bool(o.collapsed) for o in result.outcomes)
            tracking.MetricLogger(uri, parent_id).log({"grid/runs": len(result.outcomes), "grid/failed": len(failed),
                                                       "grid/collapsed": collapsed}, step=0)
            tracking.end_run(uri, parent_id, "KILLED" if interrupted else ("FAILED" if failed else "FINISHED"))
    return result


def summarize(result: AblationResult) -> tuple[Any, Any]:
    """Per run, each column of S.TRAIN_TABLE / S.WORLD_TABLE (one value per logged step, the last
    if a step was logged twice); per variant, mean ± sd over seeds, as the report's table."""
    import pandas as pd

    reg, c = result.registry, tracking.client(result.tracking_uri)
    columns = S.WORLD_TABLE if reg.kind == "world" else S.TRAIN_TABLE
    rows = []
    for o in result.outcomes:
        row: dict[str, Any] = {"variant": o.variant, "seed": o.seed, "status": o.status, "run_id": o.run_id,
                               "collapsed": bool(o.collapsed), "error": o.error or ""}
        for header, key, stat in columns:
            history = c.get_metric_history(o.run_id, key) if o.run_id else []
            by_step = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}  # the last per step
            if by_step:
                row[header] = S.reduce_run([by_step[s] for s in sorted(by_step)], stat)
        rows.append(row)
    per_run = pd.DataFrame(rows)
    table = []
    for name, g in per_run.groupby("variant", sort=False):
        r: dict[str, Any] = {"variant": name, "runs": len(g), "finished": int((g["status"] == "FINISHED").sum()),
                             "failed": int((g["status"] != "FINISHED").sum()), "collapsed": int(g["collapsed"].sum())}
        for header in (h for h, _, _ in columns if h in per_run):  # no data anywhere (gold on HH-RLHF): no column
            r[header] = S.fmt_mean_sd(S.describe(g[header]))
        table.append(r)
    return per_run, pd.DataFrame(table).set_index("variant")


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
            print(f"  - {o.variant} · seed {o.seed}: {o.status}: {o.why}{run}")
        print("Rerun the same command to retry them; finished runs are skipped.")
    elif result.interrupted:
        print("\ninterrupted; rerun the same command to resume.")
    else:
        print(f"\nall {len(result.outcomes)} runs finished.")


def add_grid_args(ap: argparse.ArgumentParser, workers: int) -> None:
    """The options that pick and run a grid, shared with the main job (harness.main)."""
    ap.add_argument("--workers", type=int, default=workers, metavar="N",
                    help=f"runs at a time, each in its own process or job (0: here, for pdb; default {workers})")
    ap.add_argument("--seeds", metavar="LIST", help="seeds to run instead of the file's, e.g. 0,1 or 0-4")
    ap.add_argument("--set", dest="overrides", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                    help="override a config key in every run, e.g. --set ppo.steps=20 (repeatable)")
    ap.add_argument("--scale", metavar="NAME", help="the file's profiles.NAME, e.g. paper (GPU); default: world (CPU)")
    ap.add_argument("--variant", dest="variants", action="append", default=[], metavar="NAME",
                    help="run only this variant (repeatable; exact legend name)")
    ap.add_argument("--tracking-uri", metavar="URI", help="MLflow store (default: the base's logging.tracking_uri)")
    ap.add_argument("--runs-dir", default="runs", metavar="DIR", help="run folders under DIR/NAME/ (default: runs)")
    ap.add_argument("--no-progress", action="store_true", help="no bars; a line per finished run (elapsed, ETA) stays")
    ap.add_argument("--threads", type=int, metavar="N", help=f"torch threads per run (default {DEFAULT_THREADS})")
    ex = ap.add_argument_group("where runs execute")
    ex.add_argument("--executor", choices=EXECUTORS, default="local",
                    help="local: a process per run; slurm: a Slurm job per run (submitit); submitit-local: that "
                         "path without Slurm (default: local)")
    ex.add_argument("--nproc", type=int, metavar="N", help="ranks per run, via torchrun/deepspeed (default: every "
                    "visible GPU for a CUDA DeepSpeed config, else 1 = the worker's own process)")
    ex.add_argument("--launcher", choices=LAUNCHERS, default="torchrun", help="multi-rank launcher (default: torchrun)")
    ex.add_argument("--slurm-partition", metavar="NAME", help="Slurm partition (--executor slurm)")
    ex.add_argument("--slurm-time-min", type=int, default=24 * 60, metavar="MIN", help="time limit per job (def. 1440)")
    ex.add_argument("--slurm-gpus", type=int, default=0, metavar="N", help="GPUs per job (default: 0)")
    ex.add_argument("--slurm-cpus", type=int, metavar="N", help="CPUs per job (default: --threads)")


def load_grid(args: argparse.Namespace, name: str) -> Registry | int:
    """The registry `name` (a path or a name under ablations/) with the options of add_grid_args; or
    exit code 2, the problems printed, when it is unknown or invalid."""
    try:
        return load_registry(find_ablation(name, getattr(args, "registry", None)), scale=args.scale,
                             seeds=parse_seeds(args.seeds) if args.seeds is not None else None,
                             overrides=parse_overrides([x for group in args.overrides for x in group]),
                             only=args.variants or None)
    except (ConfigError, UnknownAblation) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run_grid(reg: Registry, args: argparse.Namespace) -> AblationResult | int:
    """Preflight, then the grid with the options of add_grid_args, its summary printed; or the exit
    code when it cannot run (2: not runnable on this machine, 3: another runner holds the grid)."""
    problems = preflight(reg)
    if problems:
        print("error: " + "\n".join(problems), file=sys.stderr)
        return 2
    cluster = {"timeout_min": args.slurm_time_min, "gpus_per_node": args.slurm_gpus,
               "cpus_per_task": args.slurm_cpus or args.threads or DEFAULT_THREADS, "name": f"ablate-{reg.name}",
               **({"slurm_partition": args.slurm_partition} if args.slurm_partition else {})}
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
    print(f"MLflow: experiment {reg.name!r} at {redact(tracking_uri)}; run folders under {runs_dir / reg.name}/")
    on_gpu = any(getattr(r.cfg, "device", "cpu") == "cuda" for r in reg.runs)
    cost = f"est. {estimate_cpu_minutes(reg):.0f} single-thread CPU-minutes"
    cost = "GPU runs (no CPU-minute estimate)" if on_gpu else cost
    print(f"{len(reg.runs)} runs ({len(reg.variants)} variants x {len(reg.seeds)} seeds), {cost}:")
    w = max(len(r.variant) for r in reg.runs)
    for r in reg.runs:
        print(f"  {r.variant:<{w}}  seed {r.seed}  {r.run_name:<32} hash {r.config_hash}  {fmt_changes(r.changed)}")
    for line in reg.warnings:
        print(f"warning: {line}")
    print("all configs valid (dry run: nothing trained)")


def preflight(reg: Registry) -> list[str]:
    """What would fail runs after they start (hardware, world, data, models), found before any run exists."""
    if reg.kind != "train":
        return []
    from .models import preflight as check_inputs
    from .parallel import validate as check_hardware

    problems: dict[str, None] = {}
    seen = set()
    for r in reg.runs:  # the hardware rules read every section; the inputs only model and data
        d = to_dict(r.cfg)
        for check, key in ((check_hardware, {k: v for k, v in d.items() if k not in ("seed", "logging")}),
                           (check_inputs, [d["model"], d["data"]])):
            if (k := (check.__name__, json.dumps(key, sort_keys=True, default=str))) not in seen:
                seen.add(k)
                problems |= {f"{r.variant}: {p}" if len(reg.variants) > 1 else p: None for p in check(r.cfg)}
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
        print_dry_run(reg, args.tracking_uri or default_tracking_uri(reg), Path(args.runs_dir))
        problems = preflight(reg)
        if problems:
            print("not runnable on this machine yet:\n  - " + "\n  - ".join(problems))
        return 0
    result = run_grid(reg, args)
    return result if isinstance(result, int) else result.exit_code

if __name__ == "__main__":
    sys.exit(main())
