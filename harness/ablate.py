"""Run one ablation: every variant x seed of a registry file, as child MLflow runs of one parent.

    python -m harness.ablate ablations/score_reparam.yaml --workers 2
    python -m harness.ablate ablations/score_reparam.yaml --dry-run        # expand + validate only
    python -m harness.ablate ablations/kl_eta.yaml --seeds 0 --set ppo.steps=20
    python -m harness.ablate --list                                        # the whole registry

Rerunning the same command resumes the grid: runs that already FINISHED with the same resolved
config (tag harness.config_hash) are skipped, runs that were killed continue from their last
checkpoint (train(cfg, resume=True) in a run folder fixed by the config hash and variant x seed),
and runs that FAILED start over. One failing variant never stops the others; the exit code is 1
and the summary names each failed run and why.

Runs execute in worker processes (multiprocessing, spawn): `--workers N` runs N at a time and
splits the CPU threads among them (at most DEFAULT_MAX_THREADS each unless --threads says more);
`--workers 0` runs everything in this process (for pdb).

Layout: MLflow experiment = registry name; run folders under
`{--runs-dir}/{name}/{config hash}/{variant-slug}-s{seed}/` (checkpoints, run.json);
`{--runs-dir}/{name}/summary.csv` per-run final/peak metrics.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import keys as K
from . import tracking
from .config import ConfigError, from_dict, parse_overrides, to_dict
from .registry import (
    ABLATIONS_DIR, Registry, RegistryError, RunSpec, load_registry, parse_seeds, registry_files, validate_config,
    with_runner_settings,
)

# -- CPU cost model for --list -----------------------------------------------------------------
# One PPO step on the default embedded world (rollout of 32 prompts x 24-token cap, RM + gold
# scoring, 2 epochs x 2 minibatches of policy and critic updates) costs about STEP_COST_S seconds
# on one CPU thread: 0.3-0.5 s on an idle core, more once a collapsing run's responses reach the
# cap (measured: ~0.6 CPU-s and 1.0 s wall per step with the dev box 3x oversubscribed; time it
# yourself with bench/ablate_score_reparam.py). Cost scales roughly linearly with rollout batch x
# response cap x epochs; a critic-pretraining step costs about as much as a step; an eval pass
# generates over data.eval_prompts.
STEP_COST_S = 0.5
EVAL_COST_S_PER_32_PROMPTS = 0.15
RUN_OVERHEAD_S = 8.0  # worker start, model load, MLflow run set-up and final eval/checkpoint
WORLD_BUILD_CPU_MIN = 4.5  # one default embedded-world build (kind: world), single thread: measured 4.4 CPU-min

# The world's models are small: a second torch thread buys little, and on shared cores extra
# threads mostly spin (measured: 3-step runs 15-90 s with 2 threads vs 2-4 s with 1 thread while
# the box was oversubscribed). So more cores are used through --workers, not threads.
DEFAULT_MAX_THREADS = 1

TEST_KILL_ENV = "HARNESS_ABLATE_TEST_KILL_AT"
"""Test hook: 'VARIANT|SEED|STEP' makes the worker running that run SIGKILL the runner and then
itself at that step, as a machine crash would (the MLflow runs stay RUNNING)."""

SUMMARY_METRICS = {
    "train": [(K.RM_SCORE, "rm_score"), (K.GOLD_SCORE, "gold_score"), (K.KL, "kl"), (K.PPL, "ppl"), (K.LENGTH, "length")],
    "world": [(K.RM_TRAIN_ACC, "rm_train_acc"), (K.RM_EVAL_ACC, "rm_eval_acc"), (K.RM_TRAIN_LOSS, "rm_train_loss")],
}
PEAK_IS_MIN = {K.PPL, K.RM_TRAIN_LOSS}  # "peak" of perplexity / loss = its lowest value


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------
def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def estimate_cpu_minutes(reg: Registry) -> float:
    """Rough single-thread CPU minutes for the whole grid (see STEP_COST_S)."""
    if reg.kind == "world":
        return WORLD_BUILD_CPU_MIN * len(reg.runs)
    total = 0.0
    for r in reg.runs:
        c = r.cfg
        per_step = STEP_COST_S * (c.ppo.rollout_batch_size / 32) * (c.generation.max_new_tokens / 24) * (c.ppo.ppo_epochs / 2)
        steps = c.ppo.steps + c.ppo.critic_pretrain_steps + c.reward.running_stats_init
        evals = (c.ppo.steps // c.logging.eval_every + 1) if c.logging.eval_every else 0
        eval_s = evals * EVAL_COST_S_PER_32_PROMPTS * (c.data.eval_prompts / 32) * (c.generation.max_new_tokens / 24)
        total += per_step * steps + eval_s + RUN_OVERHEAD_S
    return total / 60


def fmt_duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def fmt_changes(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={fmt_value(v)}" for k, v in d.items()) or "(same as common)"


def resolve_registry_path(text: str) -> Path:
    """A path, or a bare registry name (`score_reparam`) looked up in ablations/."""
    p = Path(text)
    if p.is_file() or p.suffix in (".yaml", ".yml"):
        return p
    cand = ABLATIONS_DIR / f"{text}.yaml"
    return cand if cand.is_file() else p


# --------------------------------------------------------------------------------------------
# Planning: what each run needs and whether it is done already
# --------------------------------------------------------------------------------------------
@dataclass
class Task:
    """A run handed to a worker (plain data: it crosses a process boundary)."""

    index: int
    kind: str
    variant: str
    seed: int
    run_name: str
    config_hash: str
    cfg: dict[str, Any]
    resume: bool
    total_steps: int
    note: str
    tracking_uri: str
    experiment: str
    tags: dict[str, str]
    parent_run_id: str | None = None
    world_out: str | None = None


@dataclass
class Outcome:
    variant: str
    seed: int
    status: str  # FINISHED | FAILED | KILLED | SKIPPED(finished before)
    run_id: str | None = None
    steps_done: int = 0
    collapsed: bool = False
    collapse_step: int | None = None
    error: str | None = None
    wall_s: float = 0.0
    note: str = ""
    skipped: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "FINISHED"


def runner_tags(reg: Registry, spec: RunSpec) -> dict[str, str]:
    return {
        K.TAG_ABLATION: reg.name, K.TAG_FIGURE: reg.figure, K.TAG_VARIANT: spec.variant,
        K.TAG_SEED: str(spec.seed), K.TAG_CONFIG_HASH: spec.config_hash,
    }


def run_folder(runs_dir: Path, reg: Registry, spec: RunSpec) -> Path:
    """Output dir of one run: the config hash in the path means a changed config never resumes
    from (or overwrites) the checkpoint of a different one."""
    return Path(runs_dir) / reg.name / spec.config_hash


def existing_child_runs(tracking_uri: str, experiment_id: str, ablation: str) -> list[Any]:
    c = tracking.client(tracking_uri)
    out, token = [], None
    while True:
        page = c.search_runs([experiment_id], filter_string=f"tags.`{K.TAG_ABLATION}` = '{ablation}'",
                             max_results=1000, page_token=token)
        out += list(page)
        token = page.token
        if not token:
            return out


def _run_key(run: Any) -> tuple[str, str, str]:
    t = run.data.tags
    return t.get(K.TAG_VARIANT, ""), t.get(K.TAG_SEED, ""), t.get(K.TAG_CONFIG_HASH, "")


def plan_tasks(reg: Registry, *, tracking_uri: str, runs_dir: Path, existing: list[Any],
               progress: bool = False) -> tuple[list[Task], list[Outcome]]:
    """Split the grid into runs to do (with resume decisions) and runs already FINISHED.
    Configs keep threads=0 ("decide later"); run_ablation fills it once it knows the parallelism."""
    known_ids = {r.info.run_id for r in existing}
    finished: dict[tuple[str, str, str], Any] = {}
    failed_before: set[tuple[str, str, str]] = set()
    for run in existing:
        key = _run_key(run)
        if run.info.status == "FINISHED":
            prev = finished.get(key)
            if prev is None or run.info.start_time > prev.info.start_time:
                finished[key] = run
        elif run.info.status == "FAILED":
            failed_before.add(key)

    tasks: list[Task] = []
    done: list[Outcome] = []
    for i, spec in enumerate(reg.runs):
        key = (spec.variant, str(spec.seed), spec.config_hash)
        if key in finished:
            run = finished[key]
            done.append(Outcome(spec.variant, spec.seed, "FINISHED", run_id=run.info.run_id, skipped=True,
                                collapsed=run.data.tags.get(K.TAG_COLLAPSED) == "true", note="finished earlier"))
            continue
        out_dir = run_folder(runs_dir, reg, spec)
        tags = runner_tags(reg, spec)
        resume, note = False, "new"
        world_out = None
        if reg.kind == "train":
            settings = {
                "logging.tracking_uri": tracking_uri, "logging.experiment": reg.name,
                "logging.run_name": spec.run_name, "logging.output_dir": str(out_dir),
                "logging.tags": {**spec.cfg.logging.tags, **tags}, "logging.progress": progress,
            }
            cfg = with_runner_settings(spec.cfg, settings)
            run_dir = out_dir / spec.run_name
            info = _read_run_json(run_dir / "run.json")
            if info is not None and (info.get("status") in ("FAILED", "FINISHED") or info.get("run_id") not in known_ids):
                # FAILED: start over. FINISHED here but not in this store, or a run this store never
                # saw (the store was moved or wiped): log it again from scratch; an old checkpoint
                # must not short-cut it, and train() could not reopen a run id the store lacks.
                shutil.rmtree(run_dir, ignore_errors=True)
                note = "rerun after failure" if info.get("status") == "FAILED" else "rerun (not in this MLflow store)"
            elif run_dir.exists():
                resume = True
                step = (info or {}).get("step", 0)
                note = f"resume from step {step}" if step else "restart (killed before its first checkpoint)"
            elif key in failed_before:
                note = "rerun after failure"
            total = cfg.ppo.steps
        else:
            cfg = spec.cfg
            world_out = str(out_dir / "world")
            note = "rerun after failure" if key in failed_before else "new"
            total = 0
        tasks.append(Task(
            index=i, kind=reg.kind, variant=spec.variant, seed=spec.seed, run_name=spec.run_name,
            config_hash=spec.config_hash, cfg=to_dict(cfg), resume=resume, total_steps=total, note=note,
            tracking_uri=tracking_uri, experiment=reg.name, tags=tags, world_out=world_out,
        ))
    return tasks, done


def _read_run_json(p: Path) -> dict[str, Any] | None:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# Executing one run (in a worker process or in this one)
# --------------------------------------------------------------------------------------------
ProgressFn = Callable[[int, dict[str, float]], None]


def execute(task: Task, on_progress: ProgressFn) -> Outcome:
    """Run one task to the end; never raises except KeyboardInterrupt."""
    t0 = time.time()
    out = Outcome(task.variant, task.seed, "FAILED", note=task.note)
    try:
        if task.kind == "train":
            from .train import train

            cfg = from_dict(task.cfg)

            def on_step(step: int, metrics: dict[str, float]) -> bool:
                on_progress(step, metrics)
                return False

            res = train(cfg, resume=task.resume, on_step=on_step)
            out.status, out.run_id, out.steps_done = res.status, res.run_id, res.steps_done
            out.collapsed, out.collapse_step, out.error = res.collapsed, res.collapse_step, res.error
        else:
            out = _execute_world(task, out)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - one broken run must not take the grid down
        out.status, out.error = "FAILED", f"{type(e).__name__}: {e}"
        out.note += "\n" + traceback.format_exc(limit=8)
    out.wall_s = time.time() - t0
    if task.kind == "train":
        _retire_stale_runs(task, out)
    return out


def _execute_world(task: Task, out: Outcome) -> Outcome:
    """kind: world: build (or reuse) a world for this variant; its RM training is the child run."""
    from .world import build_world
    from .world.config import WorldConfig

    wcfg = validate_config(task.cfg, WorldConfig)
    try:
        # force: we only get here when the store has no finished run of this world, so a cached
        # build (which build_world would return without logging) must be rebuilt to be logged.
        build_world(wcfg, task.world_out, tracking_uri=task.tracking_uri, experiment=task.experiment,
                    parent_run_id=task.parent_run_id, tags=task.tags, progress=False, force=True)
        out.status = "FINISHED"
    except Exception as e:  # noqa: BLE001
        out.status, out.error = "FAILED", f"{type(e).__name__}: {e}"
    # Find the run build_world logged (by our tags) so the summary can read its metrics.
    runs = _runs_with_tags(task)
    if runs:
        latest = max(runs, key=lambda r: r.info.start_time)
        out.run_id = latest.info.run_id
        if out.status == "FAILED" and latest.info.status == "RUNNING":
            tracking.set_tags(task.tracking_uri, out.run_id, {K.TAG_FAILURE: (out.error or "")[:4000]})
            tracking.end_run(task.tracking_uri, out.run_id, "FAILED")
        elif out.status == "FINISHED" and latest.info.status != "FINISHED":
            out.status, out.error = "FAILED", f"world run ended {latest.info.status}"
    elif out.status == "FINISHED":
        # build_world returned from its cache without logging: this store has no record of the
        # world, so the figure would be empty. Say how to get one.
        out.status = "FAILED"
        out.error = (f"build_world reused {task.world_out} without logging a run to {task.tracking_uri}; "
                     f"delete that folder and rerun to log the reward-model training")
    return out


def _runs_with_tags(task: Task) -> list[Any]:
    exp = tracking.client(task.tracking_uri).get_experiment_by_name(task.experiment)
    if exp is None:
        return []
    return [r for r in existing_child_runs(task.tracking_uri, exp.experiment_id, task.tags[K.TAG_ABLATION])
            if _run_key(r) == (task.variant, str(task.seed), task.config_hash)]


def _retire_stale_runs(task: Task, out: Outcome) -> None:
    """A run killed before its first checkpoint restarts as a new MLflow run; mark the old one
    KILLED so the store holds one live run per variant x seed."""
    try:
        for r in _runs_with_tags(task):
            if r.info.run_id != out.run_id and r.info.status == "RUNNING":
                tracking.set_tags(task.tracking_uri, r.info.run_id, {"harness.superseded_by": str(out.run_id)})
                tracking.end_run(task.tracking_uri, r.info.run_id, "KILLED")
    except Exception:  # noqa: BLE001 - bookkeeping only
        pass


# -- worker process -------------------------------------------------------------------------------
def _worker_main(worker_id: int, task_q: Any, event_q: Any, runner_pid: int) -> None:
    """Loop: take a task, run it, report progress and the outcome. Exits on None or when the runner
    is gone (an orphaned worker stops its run as KILLED so it can be resumed later)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    kill_at = os.environ.get(TEST_KILL_ENV, "")
    try:
        from . import train  # noqa: F401 - import torch/transformers now, while the runner plans

        while True:
            task = task_q.get()
            if task is None:
                return

            def on_progress(step: int, metrics: dict[str, float], task: Task = task) -> None:
                if os.getppid() != runner_pid:
                    raise KeyboardInterrupt("the ablation runner is gone")
                if kill_at and kill_at == f"{task.variant}|{task.seed}|{step}":
                    os.kill(runner_pid, signal.SIGKILL)
                    os.kill(os.getpid(), signal.SIGKILL)
                small = {k: float(metrics[k]) for k in (K.RM_SCORE, K.KL, K.LENGTH, K.GOLD_SCORE) if k in metrics}
                event_q.put(("step", worker_id, task.index, step, small))

            out = execute(task, on_progress)
            event_q.put(("done", worker_id, task.index, dataclasses.asdict(out)))
    except KeyboardInterrupt:
        return


# --------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------
@dataclass
class AblationResult:
    registry: Registry
    outcomes: list[Outcome]
    parent_run_id: str | None
    tracking_uri: str
    wall_s: float
    summary: Any = None  # pandas DataFrame, one row per variant
    per_run: Any = None  # pandas DataFrame, one row per run
    interrupted: bool = False

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else (1 if self.failed else 0)


class _Bars:
    """An overall bar plus one bar per worker slot (tqdm), and one line per finished run."""

    def __init__(self, reg: Registry, total: int, initial: int, slots: int, enabled: bool | None):
        from tqdm.auto import tqdm

        self.tqdm = tqdm
        self.enabled = enabled
        self.total = total
        self.done = initial
        disable = (not sys.stderr.isatty()) if enabled is None else (not enabled)  # auto: bars only on a terminal
        self.overall = tqdm(total=total, initial=initial, desc=reg.name, unit="run", position=0,
                            dynamic_ncols=True, disable=disable)
        self.disabled = self.overall.disable
        self.slots: dict[int, Any] = {}
        self.nslots = slots

    def start(self, slot: int, task: Task) -> None:
        if self.disabled:
            return
        old = self.slots.pop(slot, None)
        if old is not None:
            old.close()
        self.slots[slot] = self.tqdm(total=task.total_steps or None, desc=f"  {task.variant} · s{task.seed}",
                                     unit="step", position=slot + 1, leave=False, dynamic_ncols=True)

    def step(self, slot: int, step: int, small: dict[str, float]) -> None:
        bar = self.slots.get(slot)
        if bar is None:
            return
        if step > bar.n:
            bar.update(step - bar.n)
        post = {"rm": f"{small[K.RM_SCORE]:.2f}"} if K.RM_SCORE in small else {}
        if K.KL in small:
            post["kl"] = f"{small[K.KL]:.3f}"
        if K.LENGTH in small:
            post["len"] = f"{small[K.LENGTH]:.1f}"
        bar.set_postfix(post, refresh=False)

    def finish(self, slot: int | None, out: Outcome) -> None:
        bar = self.slots.pop(slot, None) if slot is not None else None
        if bar is not None:
            bar.close()
        self.done += 1
        self.overall.update(1)
        self.write(f"[{self.done:>{len(str(self.total))}}/{self.total}] {describe_outcome(out)}")

    def write(self, line: str) -> None:
        self.tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        for b in self.slots.values():
            b.close()
        self.overall.close()


def describe_outcome(o: Outcome) -> str:
    who = f"{o.variant} · seed {o.seed}"
    if o.ok:
        bits = [f"{o.steps_done} steps" if o.steps_done else "", fmt_duration(o.wall_s) if o.wall_s else "",
                f"collapsed at step {o.collapse_step}" if o.collapsed and o.collapse_step else ("collapsed" if o.collapsed else ""),
                o.note if o.note != "new" else ""]
        return f"done   {who}: " + ", ".join(b for b in bits if b)
    why = (o.error or "no reason recorded").strip().splitlines()[0]
    return f"{o.status:<6} {who}: {why}"


def _mark_dead_parents(tracking_uri: str, experiment_id: str, ablation: str) -> None:
    """A runner killed outright leaves its parent run RUNNING; mark those KILLED (same host, pid gone)."""
    host = socket.gethostname()
    try:
        runs = tracking.client(tracking_uri).search_runs(
            [experiment_id], filter_string=f"tags.`{K.TAG_ROLE}` = 'parent' and attributes.status = 'RUNNING'", max_results=200)
    except Exception:  # noqa: BLE001
        return
    for r in runs:
        t = r.data.tags
        if t.get(K.TAG_ABLATION) != ablation or t.get("harness.runner_host") != host:
            continue
        try:
            os.kill(int(t.get("harness.runner_pid", "0")), 0)
            continue  # still alive: another runner is working on this grid
        except (ProcessLookupError, ValueError):
            pass
        except PermissionError:
            continue
        tracking.end_run(tracking_uri, r.info.run_id, "KILLED")


def run_ablation(
    reg: Registry,
    *,
    workers: int = 1,
    tracking_uri: str | None = None,
    runs_dir: str | Path = "runs",
    threads: int | None = None,
    progress: bool | None = None,
) -> AblationResult:
    """Run (or resume) the grid of `reg`; returns outcomes, the parent run id and summary tables."""
    t0 = time.time()
    uri = tracking_uri or _default_tracking_uri(reg)
    runs_dir = Path(runs_dir)
    exp_id = tracking.ensure_experiment(uri, reg.name)
    _mark_dead_parents(uri, exp_id, reg.name)
    existing = existing_child_runs(uri, exp_id, reg.name)
    tasks, done = plan_tasks(reg, tracking_uri=uri, runs_dir=runs_dir, existing=existing)
    # CPU threads per run: the cores split among the runs in flight, at most DEFAULT_MAX_THREADS
    # (a config's own nonzero `threads` and --threads win).
    slots = max(1, min(max(workers, 1), len(tasks)))
    threads = threads or max(1, min(DEFAULT_MAX_THREADS, cpu_count() // slots))
    for t in tasks:
        if t.cfg.get("threads") == 0:
            t.cfg["threads"] = threads

    bars = _Bars(reg, total=len(reg.runs), initial=len(done), slots=slots, enabled=progress)
    n_resume = sum(t.resume for t in tasks)
    how = ("in this process" if workers == 0 else f"{slots} worker(s)") + f" x {threads} thread(s)"
    bars.write(f"{reg.name} (Fig. {reg.figure}): {len(reg.runs)} runs = {len(reg.variants)} variants x {len(reg.seeds)} seeds; "
               f"{len(done)} finished earlier, {n_resume} to resume, {len(tasks) - n_resume} to start"
               + (f"; {how}" if tasks else " (nothing to run)"))
    for o in done:
        bars.write(f"  skip   {o.variant} · seed {o.seed}: finished earlier (run {o.run_id})")

    parent_id = None
    outcomes: dict[int, Outcome] = {}
    interrupted = False
    if tasks:
        parent_id = tracking.start_run(uri, reg.name, f"{reg.name} {time.strftime('%Y-%m-%d %H:%M:%S')}", tags={
            K.TAG_ROLE: "parent", K.TAG_ABLATION: reg.name, K.TAG_FIGURE: reg.figure, K.TAG_COMMIT: tracking.git_commit(),
            "harness.registry_file": str(reg.path), "harness.scale": reg.scale,
            "harness.runner_pid": str(os.getpid()), "harness.runner_host": socket.gethostname(),
        })
        tracking.log_params(uri, parent_id, {
            "registry_file": str(reg.path), "scale": reg.scale, "seeds": reg.seeds, "variants": [v.name for v in reg.variants],
            "runs": len(reg.runs), "skipped_finished": len(done), "workers": workers, "threads_per_run": threads,
            **{f"common.{k}": v for k, v in reg.common_changes.items()},
        })
        for t in tasks:
            t.parent_run_id = parent_id
            if t.kind == "train":
                # keep the parent link for new runs; resumed runs keep the parent they were born under
                t.cfg["logging"]["parent_run_id"] = parent_id
        try:
            if workers == 0:
                _run_inline(tasks, outcomes, bars)
            else:
                _run_pool(tasks, outcomes, bars, slots)
        except KeyboardInterrupt:
            interrupted = True
            bars.write("\ninterrupted: runs in flight were marked KILLED; rerun the same command to resume them")
    bars.close()

    all_out = done + [outcomes[t.index] for t in tasks if t.index in outcomes]
    if interrupted:
        all_out += [Outcome(t.variant, t.seed, "KILLED", note="interrupted") for t in tasks if t.index not in outcomes]
    order = {(s.variant, s.seed): i for i, s in enumerate(reg.runs)}
    all_out.sort(key=lambda o: order.get((o.variant, o.seed), 0))
    result = AblationResult(reg, all_out, parent_id, uri, time.time() - t0, interrupted=interrupted)
    try:
        result.per_run, result.summary = summarize(result)
    except Exception as e:  # noqa: BLE001 - a summary problem must not hide the runs' outcome
        print(f"(could not build the summary table: {type(e).__name__}: {e})", file=sys.stderr)
    _write_summary_files(result, runs_dir)
    if parent_id:
        failed = result.failed
        tags = {"harness.failed_runs": str(len(failed)), "harness.runs_total": str(len(all_out))}
        if failed:
            tags["harness.failed"] = "; ".join(f"{o.variant} s{o.seed}: {(o.error or o.status)[:200]}" for o in failed)[:4900]
        tracking.set_tags(uri, parent_id, tags)
        tracking.end_run(uri, parent_id, "KILLED" if interrupted else ("FAILED" if failed else "FINISHED"))
    return result


def _default_tracking_uri(reg: Registry) -> str:
    return getattr(getattr(reg.common, "logging", None), "tracking_uri", None) or "sqlite:///mlflow.db"


def _run_inline(tasks: list[Task], outcomes: dict[int, Outcome], bars: _Bars) -> None:
    for t in tasks:
        bars.start(0, t)
        out = execute(t, lambda step, m, t=t: bars.step(0, step, m))
        outcomes[t.index] = out
        bars.finish(0, out)


@dataclass
class _Slot:
    proc: Any
    task_q: Any
    task: Task | None = None


def _run_pool(tasks: list[Task], outcomes: dict[int, Outcome], bars: _Bars, nslots: int) -> None:
    """Long-lived spawn workers (one torch import each), one task at a time per worker. A worker
    that dies (OOM kill, segfault) fails only its current run and is replaced."""
    ctx = mp.get_context("spawn")
    event_q = ctx.Queue()
    pending = list(tasks)
    slots: list[_Slot | None] = [None] * min(nslots, len(tasks))

    def spawn(i: int) -> _Slot:
        tq = ctx.Queue()
        p = ctx.Process(target=_worker_main, args=(i, tq, event_q, os.getpid()), daemon=True, name=f"ablate-worker-{i}")
        p.start()
        return _Slot(p, tq)

    def handle(ev: tuple) -> None:
        kind, wid, index = ev[0], ev[1], ev[2]
        if kind == "step":
            bars.step(wid, ev[3], ev[4])
        elif kind == "done":
            out = Outcome(**ev[3])
            outcomes[index] = out
            s = slots[wid]
            if s is not None and s.task is not None and s.task.index == index:
                s.task = None
            bars.finish(wid, out)

    try:
        for i in range(len(slots)):
            slots[i] = spawn(i)
        while pending or any(s is not None and s.task is not None for s in slots):
            for i, s in enumerate(slots):
                if s is not None and s.task is None and pending:
                    s.task = pending.pop(0)
                    bars.start(i, s.task)
                    s.task_q.put(s.task)
            try:
                handle(event_q.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            for i, s in enumerate(slots):
                if s is None or s.proc.is_alive():
                    continue
                # Drain first: the worker may have reported before dying.
                while True:
                    try:
                        handle(event_q.get_nowait())
                    except queue.Empty:
                        break
                if s.task is not None:
                    code = s.proc.exitcode
                    why = f"worker process died (exit code {code}{'; -9 = killed, often out of memory' if code == -9 else ''})"
                    out = Outcome(s.task.variant, s.task.seed, "FAILED", error=why, note=s.task.note)
                    outcomes[s.task.index] = out
                    bars.finish(i, out)
                    s.task = None
                slots[i] = spawn(i) if pending else None
    finally:
        for s in slots:
            if s is not None and s.proc.is_alive():
                try:
                    s.task_q.put(None)
                except Exception:  # noqa: BLE001
                    pass
        deadline = time.time() + 30
        for s in slots:
            if s is not None:
                s.proc.join(timeout=max(0.1, deadline - time.time()))
                if s.proc.is_alive():
                    s.proc.terminate()


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------
def summarize(result: AblationResult) -> tuple[Any, Any]:
    """Per-run final/peak metrics (from the store) and a per-variant table of mean ± std over seeds."""
    import pandas as pd

    reg, uri = result.registry, result.tracking_uri
    metrics = SUMMARY_METRICS[reg.kind]
    c = tracking.client(uri)
    rows = []
    for o in result.outcomes:
        row: dict[str, Any] = {"variant": o.variant, "seed": o.seed, "status": o.status, "run_id": o.run_id,
                               "collapsed": bool(o.collapsed), "error": o.error or ""}
        if o.run_id:
            try:
                run = c.get_run(o.run_id)
                row["status"] = run.info.status if o.status != "KILLED" else o.status
                row["collapsed"] = run.data.tags.get(K.TAG_COLLAPSED) == "true"
                row["error"] = row["error"] or run.data.tags.get(K.TAG_FAILURE, "")
                for key, short in metrics:
                    hist = sorted((m.step, m.timestamp, m.value) for m in c.get_metric_history(o.run_id, key))
                    vals = [v for *_, v in hist if math.isfinite(v)]
                    if vals:
                        row[f"{short} final"] = vals[-1]
                        row[f"{short} peak"] = min(vals) if key in PEAK_IS_MIN else max(vals)
            except Exception as e:  # noqa: BLE001
                row["error"] = row["error"] or f"(could not read run: {e})"
        rows.append(row)
    per_run = pd.DataFrame(rows)

    order = [v.name for v in reg.variants]
    table = []
    for name in order:
        g = per_run[per_run["variant"] == name] if len(per_run) else per_run
        if not len(g):
            continue
        r: dict[str, Any] = {"variant": name, "runs": len(g), "finished": int((g["status"] == "FINISHED").sum()),
                             "failed": int((g["status"] != "FINISHED").sum()), "collapsed": int(g["collapsed"].sum())}
        for _, short in metrics:
            for which in ("final", "peak"):
                col = f"{short} {which}"
                r[col] = _mean_pm(g[col]) if col in g else "-"
        table.append(r)
    return per_run, pd.DataFrame(table).set_index("variant") if table else pd.DataFrame()


def _mean_pm(s: Any) -> str:
    v = s.dropna()
    if not len(v):
        return "-"
    if len(v) == 1:
        return f"{v.iloc[0]:.3g}"
    return f"{v.mean():.3g} ± {v.std(ddof=1):.2g}"


def _write_summary_files(result: AblationResult, runs_dir: Path) -> None:
    if result.per_run is None:
        return
    out = Path(runs_dir) / result.registry.name
    try:
        out.mkdir(parents=True, exist_ok=True)
        result.per_run.to_csv(out / "summary_runs.csv", index=False)
        if result.summary is not None and len(result.summary):
            result.summary.to_csv(out / "summary.csv")
        if result.parent_run_id:
            files = [out / "summary_runs.csv"] + ([out / "summary.csv"] if (out / "summary.csv").exists() else [])
            tracking.log_file_artifacts(result.tracking_uri, result.parent_run_id, files)
    except Exception as e:  # noqa: BLE001
        print(f"(could not write the summary files under {out}: {e})", file=sys.stderr)


def print_summary(result: AblationResult) -> None:
    import pandas as pd

    reg = result.registry
    print(f"\n== {reg.name} (Fig. {reg.figure}) — {len(result.outcomes)} runs in {fmt_duration(result.wall_s)}; "
          f"store {result.tracking_uri}, experiment {reg.name!r}" + (f", parent run {result.parent_run_id}" if result.parent_run_id else ""))
    if result.summary is not None and len(result.summary):
        with pd.option_context("display.max_columns", None, "display.width", 200, "display.max_colwidth", 40):
            cols = list(result.summary.columns)
            counts = [c for c in cols if c in ("runs", "finished", "failed", "collapsed")]
            finals = [c for c in cols if c.endswith(" final")]
            peaks = [c for c in cols if c.endswith(" peak")]
            print("\nfinal value at the last step (mean ± std over seeds):")
            print(result.summary[counts + finals].to_string())
            print("\npeak over training (max; for ppl / loss: min), mean ± std over seeds:")
            print(result.summary[peaks].to_string())
    failed = result.failed
    if failed:
        print(f"\n{len(failed)} run(s) did not finish:")
        for o in failed:
            why = (o.error or o.status).strip().splitlines()[0]
            print(f"  - {o.variant} · seed {o.seed}: {o.status}: {why}" + (f"  (run {o.run_id})" if o.run_id else ""))
        print("Rerun the same command to retry them; finished runs are skipped.")
    elif result.interrupted:
        print("\ninterrupted; rerun the same command to resume.")
    else:
        print(f"\nall {len(result.outcomes)} runs finished.")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m harness.ablate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run an ablation grid (one registry YAML = one paper figure) as MLflow child runs; "
                    "rerunning resumes it.",
        epilog=(
            "examples:\n"
            "  python -m harness.ablate --list\n"
            "  python -m harness.ablate ablations/score_reparam.yaml --dry-run\n"
            "  python -m harness.ablate ablations/score_reparam.yaml --workers 2\n"
            "  python -m harness.ablate kl_eta --seeds 0 --set ppo.steps=20   # quick smoke run\n"
            "  mlflow ui --backend-store-uri sqlite:///mlflow.db                # browse the runs\n"
            "\nRegistry format: docs/CONTRACTS.md. Config keys for --set: harness/config.py "
            "(or `python -m harness.train --help`)."
        ),
    )
    ap.add_argument("file", nargs="?", help="registry YAML (ablations/NAME.yaml) or just NAME")
    ap.add_argument("--list", action="store_true", help="list every registry file with its figure, variants and estimated CPU minutes")
    ap.add_argument("--dry-run", action="store_true", help="print the expanded runs and validate every config; train nothing")
    ap.add_argument("--workers", type=int, default=1, metavar="N",
                    help="runs at a time, each in its own process, CPU threads split among them (0 = in this process, for pdb)")
    ap.add_argument("--seeds", metavar="LIST", help="seeds to run instead of the file's, e.g. 0,1 or 0-4")
    ap.add_argument("--set", dest="overrides", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                    help="override a config key in every run, e.g. --set ppo.steps=20 (repeatable)")
    ap.add_argument("--scale", default=None, metavar="NAME",
                    help="use the file's profiles.NAME settings, e.g. `paper` (the paper's own scale, GPU); default: the embedded world on CPU")
    ap.add_argument("--variant", dest="variants", action="append", default=[], metavar="NAME",
                    help="run only this variant (repeatable; exact legend name)")
    ap.add_argument("--tracking-uri", default=None, metavar="URI",
                    help="MLflow store (default: the base config's logging.tracking_uri, sqlite:///mlflow.db)")
    ap.add_argument("--runs-dir", default="runs", metavar="DIR", help="checkpoints and run files go under DIR/NAME/ (default: runs)")
    ap.add_argument("--threads", type=int, default=None, metavar="N", help=f"torch threads per run (default: CPU cores / workers, at most {DEFAULT_MAX_THREADS}: "
                         "small models gain little from threads, use --workers for more cores)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (one line per finished run is still printed)")
    return ap


def list_registry(ablations_dir: Path | None = None) -> int:
    rows = []
    bad = 0
    for p in registry_files(ablations_dir):
        try:
            reg = load_registry(p)
        except RegistryError as e:
            rows.append((p.name, "?", "?", "?", "?", "?", "?", f"INVALID: {e.problems[0]} (run --dry-run on it for all problems)"))
            bad += 1
            continue
        steps = reg.steps if reg.kind == "train" else "-"
        rows.append((p.name, reg.figure, reg.kind, str(len(reg.variants)), f"{len(reg.seeds)}", str(steps),
                     f"{estimate_cpu_minutes(reg):.0f}", "; ".join(v.name for v in reg.variants)))
    head = ("file", "fig", "kind", "variants", "seeds", "steps", "est. CPU min", "variant names")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head) - 1)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  " + head[-1])
    for r in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)) + "  " + str(r[-1]))
    print(f"\nest. CPU min = single-thread minutes for the whole grid at the default (world) scale: "
          f"steps x variants x seeds x {STEP_COST_S} s/step (+ evals, + {RUN_OVERHEAD_S:.0f} s per run); "
          f"divide by the cores you give it.")
    return 1 if bad else 0


def print_dry_run(reg: Registry, tracking_uri: str, runs_dir: Path, workers: int) -> None:
    print(f"{reg.path}: {reg.name!r} (Fig. {reg.figure}, kind {reg.kind}, scale {reg.scale}) — {reg.title}")
    print(f"base: {reg.base}")
    print(f"every run: {fmt_changes(reg.common_changes)}")
    print(f"seeds: {reg.seeds}; panels: {', '.join(reg.panels) or '(analysis defaults)'}")
    print(f"MLflow: experiment {reg.name!r} at {tracking_uri}; run folders under {Path(runs_dir) / reg.name}/")
    print(f"{len(reg.runs)} runs ({len(reg.variants)} variants x {len(reg.seeds)} seeds), "
          f"est. {estimate_cpu_minutes(reg):.0f} single-thread CPU-minutes:")
    w = max(len(r.variant) for r in reg.runs)
    for r in reg.runs:
        print(f"  {r.variant:<{w}}  seed {r.seed}  {r.run_name:<32} hash {r.config_hash}  {fmt_changes(r.changed)}")
    for line in reg.warnings:
        print(f"warning: {line}")
    print("all configs valid (dry run: nothing trained)")


def preflight(reg: Registry) -> list[str]:
    """Problems that would fail every run at once, caught before any run starts."""
    problems = []
    if reg.kind != "train":
        return problems
    dirs = set()
    for r in reg.runs:
        c = r.cfg
        uses_world = c.data.source == "world" or any(
            str(p).startswith("world:") for p in (c.model.sft_path, c.model.reward_path, c.model.pretrained_path))
        if uses_world:
            dirs.add(c.data.world_dir)
    for d in sorted(dirs):
        if not Path(d).is_dir():
            problems.append(f"the embedded world is not built at data.world_dir={d!r}. Build it first:\n"
                            f"    python -m harness.world build --out {d}\n"
                            f"or run the whole main job (world + ablation + figures + report): python -m harness.main")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        return list_registry()
    if not args.file:
        build_parser().print_usage(sys.stderr)
        print("error: give a registry file (e.g. ablations/score_reparam.yaml) or --list", file=sys.stderr)
        return 2
    if args.workers < 0:
        print("error: --workers must be 0 (in this process) or more", file=sys.stderr)
        return 2
    try:
        overrides = parse_overrides([x for group in args.overrides for x in group])
        seeds = parse_seeds(args.seeds) if args.seeds else None
        reg = load_registry(resolve_registry_path(args.file), scale=args.scale, seeds=seeds,
                            overrides=overrides, only=args.variants or None)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    uri = args.tracking_uri or _default_tracking_uri(reg)
    if args.dry_run:
        print_dry_run(reg, uri, Path(args.runs_dir), args.workers)
        return 0
    for line in reg.warnings:
        print(f"warning: {line}", file=sys.stderr)
    problems = preflight(reg)
    if problems:
        print("error: " + "\n".join(problems), file=sys.stderr)
        return 2
    result = run_ablation(reg, workers=args.workers, tracking_uri=uri, runs_dir=args.runs_dir,
                          threads=args.threads, progress=False if args.no_progress else None)
    print_summary(result)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
