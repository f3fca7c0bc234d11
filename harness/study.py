"""The one layer under every runner: a study is a set of tasks (training runs, world builds) logged
as MLflow child runs of one parent run, executed on one of harness.launch's executors, resumable
from the store alone. `harness.ablate` turns a figure file into tasks, `harness.sweep` an Optuna
study's ask/tell; this module does the rest for both:

    with Study(uri, experiment, identity, runs_dir=..., exclusive=True, recover=...) as st:   # the lock
        done = plan(task, runs, run_dir=...)          # each task against the store: an outcome, or resume/new
        parent = st.parent(create=True, run_name=..., tags=..., params=...)
        outcomes, interrupted = st.execute(Tasks(tasks), executor=..., workers=2, progress=Progress(...))
        st.finish("FINISHED", tags={...}, metrics={...})

- The lock beside the store (a sqlite store's file, else the runs folder): a grid's is exclusive
  (a second runner is refused, naming it), a sweep's is shared by every runner of the study. A
  runner that holds it alone knows that whatever the store shows RUNNING is dead (`alone`); a
  sweep's runner closes those (`recover`) on entry, before it lets another runner in.
- The parent run is found again by its identity (tag harness.study_hash), so a rerun continues
  under the same parent; stale failure tags of an earlier attempt are removed when it finishes.
- A task runs in a worker (a fresh process, a Slurm job, or a torchrun job inside one) that
  watches the runner: when the runner dies (kill -9 of it alone), the worker ends its run KILLED
  (resumable) within a second or two and exits, so a rerun never trains the same steps twice.
  SIGTERM of the runner (`kill PID`, a scheduler's stop) is a Ctrl-C: it asks its workers to stop
  (`Runner.stop_file`), waits for their runs to end KILLED, closes the parent KILLED, exits 130.
- One line per finished task, with elapsed time and ETA when not on a terminal (`Progress`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import filelock

from . import keys as K
from . import tracking
from .launch import EXECUTORS, LAUNCHERS, launch_train, nproc_problems
from .launch import executor as make_executor
from .lease import SETTLE_S, Lease, LeaseHeld

TAG_STUDY_HASH = "harness.study_hash"
"""On a parent run: the identity of its study (a grid's runs, a sweep's name); a rerun reopens it."""
POLL_S = 2.0  # seconds between reads of the store while tasks run (progress bar, sweep pruning)
WATCH_S = 1.0  # seconds between a worker's looks at its runner
GRACE_S = 60.0  # after the runner died: how long a worker waits for its run to end KILLED before it exits


class StudyBusy(RuntimeError):
    """Another runner holds this study's exclusive lock."""


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM that arrive inside this block act when it ends, through the handler they had.
    The runner's reads and writes of the store run inside one: a KeyboardInterrupt raised in the middle of
    a SQLAlchemy fetch makes SQLAlchemy drop the connection and then log the failed close of its cursor
    as an error with two tracebacks ('Error closing cursor'), on the researcher's terminal under the
    runner's own summary. Outside the main thread (no signal handlers there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler not in (signal.SIG_IGN, None):  # an ignored signal stays ignored (a job started with `&`)
            previous[sig] = signal.signal(sig, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if arrived:
            signal.raise_signal(arrived[0])  # the handler it had: a KeyboardInterrupt here, after the store call


# ------------------------------------------------------------------ tasks and outcomes
@dataclass(frozen=True)
class Runner:
    """The runner process that tasks belong to, as a worker on the same machine can check it: a pid
    is reused, a pid with its start time is not."""

    pid: int
    started: float
    host: str
    stop_file: str = ""
    """Created by the runner when it is interrupted (Ctrl-C, SIGTERM): its tasks stop as if it were gone,
    though it is still alive, waiting for them to end KILLED before it closes the parent run."""

    @classmethod
    def this(cls, stop_file: str | Path = "") -> "Runner":
        import psutil

        return cls(os.getpid(), psutil.Process().create_time(), socket.gethostname(), str(stop_file))

    def stopping(self) -> bool:
        """True once the runner asked its tasks to stop (its stop file exists)."""
        return bool(self.stop_file) and os.path.exists(self.stop_file)

    def alive(self) -> bool:
        """False once the runner is gone; True when it cannot be seen from here (another machine:
        a Slurm job outlives a runner on the login node, and `scancel` is the way to stop it)."""
        import psutil

        if self.host != socket.gethostname():
            return True
        try:  # a zombie has died: killed, its parent not waiting for it yet (a test that kills it, a shell)
            p = psutil.Process(self.pid)
            return p.create_time() == self.started and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


@dataclass
class Task:
    """One run of a study, handed to an executor (plain data: it crosses a process boundary)."""

    key: str
    """Unique within the study (e.g. the run name); outcomes are keyed by it."""
    label: str
    """How progress lines name it, e.g. 'vanilla PPO · seed 0'."""
    cfg: dict[str, Any]
    """The run's resolved config (TrainConfig or WorldConfig as a dict), runner settings applied."""
    kind: str = "train"
    """train: harness.train; world: harness.world.build_world (its reward-model training is the run)."""
    resume: bool = False
    note: str = "new"
    """Why it runs: new, resume from its last checkpoint, rerun after FAILED, ..."""
    tags: dict[str, str] = field(default_factory=dict)
    """The tags that find its run in the store (train runs carry them in cfg's logging.tags too)."""
    steps: int = 0
    """Training steps, for progress (0: unknown)."""
    nproc: int | None = None
    """Ranks per run (None: every visible GPU for a CUDA DeepSpeed config, else 1)."""
    launcher: str = "torchrun"
    world: dict[str, Any] | None = None
    """kind world: build_world's out_dir, tracking_uri and experiment."""
    parent_run_id: str | None = None
    runner: Runner | None = None
    """Set by Study.execute: the worker stops when this process dies."""


@dataclass
class Outcome:
    key: str
    label: str
    status: str  # FINISHED | FAILED | KILLED
    run_id: str | None = None
    steps_done: int = 0
    collapsed: bool = False
    collapse_step: int | None = None
    error: str | None = None
    wall_s: float = 0.0
    note: str = ""
    worker_died: bool = False
    """The worker process or job died under the run (killed, out of memory): not the run's fault."""

    @property
    def ok(self) -> bool:
        return self.status == "FINISHED"

    @property
    def why(self) -> str:
        return tracking.redact((self.error or "no reason recorded").strip().splitlines()[0])

    def describe(self) -> str:
        if not self.ok:
            return f"{self.status:<6} {self.label}: {self.why}"
        collapsed = f"collapsed at step {self.collapse_step}" if self.collapse_step else "collapsed"
        bits = [f"{self.steps_done} steps" if self.steps_done else "", fmt_duration(self.wall_s) if self.wall_s else "",
                collapsed if self.collapsed else "", self.note if self.note != "new" else ""]
        return f"done   {self.label}: " + ", ".join(b for b in bits if b)


def fmt_duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


# ------------------------------------------------------------------ a task in its worker
class Watchdog:
    """In a worker: looks at the runner every WATCH_S. Once it is gone or asks its tasks to stop
    (`Runner.stopping`: interrupted by a SIGTERM that reached it alone), `gone` is set (the training
    callback then stops the run: KILLED, resumable) and, should the run not end within GRACE_S (a
    world build, a step that takes minutes), the worker exits; its run, left RUNNING, is marked
    KILLED by the next runner. It keeps watching after its task ended: a pool process whose runner died
    between the result and the pool's shutdown would otherwise wait for work forever (its queue's
    write end is its own), holding the multiprocessing server and the runner's output pipe open."""

    def __init__(self, runner: Runner | None):
        self.gone = threading.Event()
        self.done = threading.Event()
        if runner is not None and runner.pid != os.getpid():  # in the runner's own process (--workers 0): no one
            threading.Thread(target=self._watch, args=(runner,), name="runner-watchdog", daemon=True).start()

    def _watch(self, runner: Runner) -> None:
        while runner.alive() and not runner.stopping():
            time.sleep(WATCH_S)
        self.gone.set()
        self.done.wait(GRACE_S)  # the run ends KILLED at its next step (or was over): nobody waits for this process
        os._exit(0 if self.done.is_set() else 70)

    def check(self, *_: Any) -> bool:
        """The training callback (on_step): raises KeyboardInterrupt once the runner is gone."""
        if self.gone.is_set():
            raise KeyboardInterrupt("the runner of this study is gone")
        return False


def run_task(task: Task, work: "TaskWork | None" = None) -> Outcome:
    """Run one task to its end in this process with `work` (its kind's, `task_kind`); never raises
    except KeyboardInterrupt. A worker whose runner died exits once its run has ended KILLED."""
    t0, dog = time.time(), Watchdog(task.runner)
    work = work or task_kind(task.kind)
    try:  # the runner's store is in the task (a run's logging.tracking_uri, a world's tracking_uri)
        out = work(task, dog.check)
    except KeyboardInterrupt:
        if dog.gone.is_set():  # nobody waits for this outcome: leave
            os._exit(0)
        raise
    except Exception as e:  # noqa: BLE001 - one broken run must not take the study down
        out = Outcome(task.key, task.label, "FAILED", error=tracking.redact(f"{type(e).__name__}: {e}"))
    finally:
        dog.done.set()
    out.note, out.wall_s = task.note, time.time() - t0
    return out


def _train(task: Task, on_step: Callable[..., bool]) -> Outcome:
    """harness.train.train in this process, or launch_train when the run needs several ranks."""
    import torch

    from .config import from_dict
    from .schema import merge
    from .train import train

    cfg = from_dict(merge(task.cfg, {"logging.parent_run_id": task.parent_run_id}))  # resumed runs keep theirs
    # a DeepSpeed config on a GPU machine takes every visible GPU (the paper scale); else one process
    nproc = task.nproc or (torch.cuda.device_count() if cfg.device != "cpu" and cfg.distributed.deepspeed else 1)
    if nproc > 1:
        res = launch_train(cfg, nproc=nproc, resume=task.resume, on_step=on_step, launcher=task.launcher)
    else:
        res = train(cfg, resume=task.resume, on_step=on_step)
    return Outcome(task.key, task.label, res.status, res.run_id, res.steps_done, res.collapsed, res.collapse_step,
                   res.error)


def _build_world(task: Task, on_step: Callable[..., bool] | None = None) -> Outcome:
    """kind world: build the world of this task; its RM training is the run."""
    from .world import build_world
    from .world.config import world_config_from_dict

    error, w = None, task.world or {}
    try:
        # force: only tasks without a finished run get here, so a cached build (which build_world
        # would return without logging) must be rebuilt to be logged
        build_world(world_config_from_dict(task.cfg), w["out_dir"], tracking_uri=w["tracking_uri"],
                    experiment=w["experiment"], tags=task.tags, parent_run_id=task.parent_run_id, progress=False,
                    force=True)
    except Exception as e:  # noqa: BLE001 - build_world has ended its run FAILED
        error = f"{type(e).__name__}: {e}"
    runs = tracking.find_runs(w["tracking_uri"], w["experiment"], task.tags)  # the run build_world logged, by our tags
    status = runs[-1].info.status if runs and not error else "FAILED"
    return Outcome(task.key, task.label, status, runs[-1].info.run_id if runs else None, error=error)


TaskWork = Callable[[Task, Callable[..., bool]], Outcome]
"""What runs a task of one kind in its worker: (task, on_step) -> its outcome; on_step is the training
callback that raises KeyboardInterrupt once the runner is gone (Watchdog.check). A module-level function:
it travels to the worker by reference (pickled by its module and name)."""
TASK_KINDS: dict[str, TaskWork] = {"train": _train, "world": _build_world}
"""Task.kind -> its work: harness.train, or a world build (whose reward-model training is the run)."""
BUILT_IN_KINDS = tuple(TASK_KINDS)


def register_task_kind(kind: str, work: TaskWork) -> None:
    """Make `work` the task kind `kind` in this process (and in the workers it starts, which get it with
    each task): the test suite's fake tasks, which sleep, fail or log metrics in milliseconds, so that a
    runner's locks, kill -9 and resume, SIGTERM and dead-run recovery are tested without training. Refused
    outside the test suite (pytest sets PYTEST_VERSION): a runner trains and builds worlds, nothing else."""
    if "PYTEST_VERSION" not in os.environ:
        raise RuntimeError(f"task kind {kind!r}: got a task kind registered outside the test suite; allowed: "
                           f"the built-in kinds {', '.join(BUILT_IN_KINDS)} (fake kinds: only under pytest)")
    TASK_KINDS[kind] = work


def task_kind(kind: str) -> TaskWork:
    """The work of a task kind (TASK_KINDS); ValueError naming the kinds known."""
    try:
        return TASK_KINDS[kind]
    except KeyError:
        raise ValueError(f"task kind: got {kind!r}; allowed: {', '.join(TASK_KINDS)}") from None


REUSED = "finished earlier"
"""The note of a task whose run FINISHED earlier: its outcome is taken from the store, nothing runs."""


def plan(task: Task, runs: list[Any], *, run_dir: Path | None, steps: int = 0, prune_stops: bool = False
         ) -> Outcome | None:
    """Plan a task against the store, for every runner: `runs` are those carrying its tags, oldest first.
    A run FINISHED -> its outcome (the newest; nothing to run). Else the task resumes the newest run when it
    was left KILLED or RUNNING (its runner died) and the task trains, or starts afresh (new, or after FAILED),
    its `run_dir` cleared so it never picks up the checkpoint of a run the store no longer continues.
    `prune_stops`: a run ended early by its training callback (a pruned trial: harness.stopped_by=callback)
    is not its configuration's whole run, so it is no outcome to reuse."""
    def status(r: Any) -> str:
        cut = prune_stops and r.info.status == "FINISHED" and r.data.tags.get(K.TAG_STOPPED) == "callback"
        return "stopped early (pruned)" if cut else r.info.status

    finished = [r for r in runs if status(r) == "FINISHED"]
    if finished:
        r = finished[-1]
        m = r.data.metrics
        return Outcome(task.key, task.label, "FINISHED", r.info.run_id, steps, r.data.tags.get(K.TAG_COLLAPSED) == "true",
                       int(m[K.COLLAPSE_STEP]) if K.COLLAPSE_STEP in m else None, note=REUSED)
    last = status(runs[-1]) if runs else None
    task.resume = task.kind == "train" and last in ("KILLED", "RUNNING")
    task.note = "resume from its last checkpoint" if task.resume else (f"rerun after {last}" if last else "new")
    if run_dir is not None and not task.resume:
        shutil.rmtree(run_dir, ignore_errors=True)
    return None


# ------------------------------------------------------------------ where tasks come from
class TaskSource(Protocol):
    """What a study executes: a fixed list (a grid), or tasks made as workers free up (a sweep's
    trials, asked from Optuna one at a time)."""

    total: int
    """Tasks expected in all (for progress; a sweep's estimate)."""

    def take(self, free: int) -> list[Task]:
        """Up to `free` tasks to start now ([] when none can start now)."""

    def exhausted(self) -> bool:
        """No task will come any more."""

    def done(self, task: Task, outcome: Outcome) -> None:
        """A task ended (its outcome recorded)."""

    def poll(self, running: list[Task]) -> None:
        """Called every POLL_S while tasks run (a sweep reports to its pruner here)."""


class Tasks:
    """A fixed list of tasks (a grid)."""

    def __init__(self, tasks: list[Task]):
        self.todo, self.total = list(tasks), len(tasks)

    def take(self, free: int) -> list[Task]:
        out, self.todo = self.todo[:free], self.todo[free:]
        return out

    def exhausted(self) -> bool:
        return not self.todo

    def done(self, task: Task, outcome: Outcome) -> None:
        pass

    def poll(self, running: list[Task]) -> None:
        pass


# ------------------------------------------------------------------ progress
class Progress:
    """One line per finished task. On a terminal also a tqdm bar, its postfix the train runs in
    flight (step, RM score, KL, length: read from the store every POLL_S, whichever executor runs
    them); elsewhere each line ends with the elapsed time and an ETA (elapsed / tasks done here x
    tasks left)."""

    SHOWN = ((K.RM_SCORE, "rm"), (K.KL, "kl"), (K.LENGTH, "len"))

    def __init__(self, name: str, total: int, done: int, bars: bool):
        from tqdm.auto import tqdm

        self.name, self.on = name, bars
        self.total, self.done, self.t0, self.finished_here = total, done, time.time(), 0
        self.bar = tqdm(total=total, initial=done, desc=name, unit="run", dynamic_ncols=True, disable=not bars)

    def write(self, line: str) -> None:
        from tqdm.auto import tqdm

        tqdm.write(tracking.redact(line), file=sys.stdout)
        sys.stdout.flush()

    def finish(self, out: Outcome) -> None:
        self.done += 1
        self.finished_here += 1
        self.total = max(self.total, self.done)
        self.bar.total = self.total
        self.bar.update(1)
        line = f"[{self.done:>{len(str(self.total))}}/{self.total}] {out.describe()}"
        if not self.on:
            el = time.time() - self.t0
            eta = el / self.finished_here * (self.total - self.done)
            line += f"  | elapsed {fmt_duration(el)}, ETA {fmt_duration(eta)}"
        self.write(line)

    def show(self, uri: str, running: list[Task]) -> None:
        """The train runs in flight, in the bar's postfix: latest step and scores from the store."""
        if not self.on:
            return
        shown = []
        for t in running:
            if t.kind != "train" or not (runs := _running_run(uri, t)):
                continue
            m = runs.data.metrics
            step = max((s for s, _ in tracking.metric_history(uri, runs.info.run_id, K.RM_SCORE)), default=0)
            scores = "".join(f" {short}={m[k]:.3g}" for k, short in self.SHOWN if k in m)
            shown.append(f"{t.label} {step}/{t.steps or '?'}{scores}")
        self.bar.set_postfix_str("; ".join(shown))

    def close(self) -> None:
        self.bar.close()


def _running_run(uri: str, task: Task) -> Any:
    logging = task.cfg.get("logging") or {}
    runs = tracking.find_runs(uri, logging.get("experiment") or "", task.tags, "attributes.status = 'RUNNING'")
    return runs[-1] if runs else None


# ------------------------------------------------------------------ command-line options
def add_executor_args(ap: Any, threads_default: int = 1) -> None:
    """Where a runner's tasks execute: the options of every runner (grids, sweeps, the main job)."""
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
    ex.add_argument("--slurm-cpus", type=int, metavar="N", help=f"CPUs per job (default: --threads, else {threads_default})")


def executor_problems(args: Any) -> list[str]:
    """What add_executor_args' options ask for that cannot run here, found before a runner creates anything
    (study, parent run): ranks below 1, negative Slurm options, `--executor slurm` where Slurm's commands are
    missing (submitit would find out only at the first submission, with a parent run already RUNNING)."""
    problems = nproc_problems(args.nproc)
    for flag, value, low in (("--slurm-time-min", args.slurm_time_min, 1), ("--slurm-gpus", args.slurm_gpus, 0),
                             ("--slurm-cpus", args.slurm_cpus, 1)):
        if value is not None and value < low:
            problems.append(f"{flag}: got {value}; allowed: an integer >= {low}")
    if args.executor == "slurm" and not (shutil.which("sbatch") and shutil.which("srun")):
        problems.append("--executor: got 'slurm' but Slurm's sbatch/srun are not on this machine's PATH; allowed: "
                        "slurm on a Slurm login node, local, or submitit-local (the same job path without Slurm)")
    return problems


def cluster_params(args: Any, name: str, threads_default: int = 1) -> dict[str, Any]:
    """submitit's parameters from the options of add_executor_args (used by --executor slurm / submitit-local)."""
    return {"timeout_min": args.slurm_time_min, "gpus_per_node": args.slurm_gpus,
            "cpus_per_task": args.slurm_cpus or getattr(args, "threads", None) or threads_default, "name": name,
            **({"slurm_partition": args.slurm_partition} if args.slurm_partition else {})}


# ------------------------------------------------------------------ the study
def study_hash(identity: Any) -> str:
    """A short, stable hash of what identifies a study (JSON-serializable)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def lock_file(uri: str, runs_dir: Path, name: str) -> Path:
    """Beside a sqlite store's file (one lock per store and study), else in the study's runs folder
    (which a cluster's nodes share)."""
    db = tracking.sqlite_path(uri)
    return db.parent / f"{name}.study.{db.name}.lock" if db else runs_dir / name / "study.lock"


class Study:
    """One study in one MLflow store: lock, parent run, dead-run recovery, execution, the end."""

    def __init__(self, uri: str, experiment: str, identity: Any, *, runs_dir: str | Path = "runs",
                 exclusive: bool = True, what: str = "python -m harness.ablate", noun: str = "grid",
                 recover: Callable[["Study"], Any] | None = None):
        self.uri, self.experiment, self.hash = uri, experiment, study_hash(identity)
        self.runs_dir, self.exclusive, self.what, self.noun = Path(runs_dir), exclusive, what, noun
        self.lock_path = lock_file(uri, self.runs_dir, experiment)
        self.parent_run_id: str | None = None
        self.alone = False
        """True while no other runner of this study is alive: a grid's for its whole run (its lock is
        exclusive), a sweep's only inside `recover` at entry (other runners may join after it)."""
        self.recover = recover
        """Called on entry while no other runner is alive or can start (a shared lock's runners): closes
        what the store shows RUNNING, which can only be a dead runner's then. Its value: `recovered`."""
        self.recovered: Any = None
        self._stack = ExitStack()

    # -- the lock
    def __enter__(self) -> "Study":
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        if self.exclusive:
            try:
                self._stack.enter_context(filelock.FileLock(self.lock_path).acquire(timeout=0))
            except filelock.Timeout:
                raise StudyBusy(f"another `{self.what}` is running {self.noun} {self.experiment!r} on store "
                                f"{tracking.redact(self.uri)} (lock {self.lock_path}); wait for it to finish, or stop "
                                "it, then rerun") from None
            if tracking.sqlite_path(self.uri) is None:  # a server store: the lock above is this machine's only
                try:
                    self._stack.enter_context(Lease(self.uri, self.experiment, self.hash, Runner.this()))
                except LeaseHeld as e:
                    self._stack.close()
                    raise StudyBusy(f"another `{self.what}` is running {self.noun} {self.experiment!r} on store "
                                    f"{tracking.redact(self.uri)}: {e}; wait for it to finish, or stop it, "
                                    "then rerun") from None
            self.alone = True
            self.recovered = self.recover(self) if self.recover else None
            self._terminate_as_interrupt()
            return self
        # A shared lock. The recovery runs while we hold it exclusively: a runner started meanwhile
        # waits for its shared hold until the recovery is done, and is not alone. (Checked first and
        # recovered later, a runner started a moment after us could start a trial in between, and we
        # would close its live trial as a dead runner's.)
        rw = filelock.ReadWriteLock(str(self.lock_path), is_singleton=False)
        try:
            exclusive = rw.acquire_write(blocking=False)
        except filelock.Timeout:  # another runner holds it: what shows RUNNING may be its
            exclusive = None
        if exclusive is not None:
            with exclusive:
                self.alone = True
                try:
                    self.recovered = self.recover(self) if self.recover else None
                finally:
                    self.alone = False
        self._stack.enter_context(rw.read_lock())
        self._terminate_as_interrupt()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _terminate_as_interrupt(self) -> None:
        """SIGTERM (`kill PID`, a scheduler's stop) ends the runner as Ctrl-C does: runs in flight end
        KILLED, the parent run too, nothing left RUNNING (only SIGKILL leaves that to the next runner)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def interrupt(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

        previous = signal.signal(signal.SIGTERM, interrupt)
        self._stack.callback(signal.signal, signal.SIGTERM, previous)

    def creation_lock(self) -> filelock.FileLock:
        """Serializes find-or-create of shared things (the parent run) between runners started at once."""
        # named like the lock itself (*.db.lock beside a sqlite store: a checkout's .gitignore has it)
        return filelock.FileLock(self.lock_path.with_name(self.lock_path.name.replace("study", "create", 1)))

    # -- the store
    def mark_dead(self, tags: dict[str, str]) -> list[str]:
        """Runs carrying `tags` still RUNNING while no other runner is alive belong to a runner that died
        (or a worker that crashed): close them as KILLED (resuming reopens a train run)."""
        if not self.alone:
            return []
        dead = [r.info.run_id for r in tracking.find_runs(self.uri, self.experiment, tags, "attributes.status = 'RUNNING'")]
        for rid in dead:
            tracking.end_run(self.uri, rid, "KILLED")
        return dead

    def parent(self, *, create: bool, run_name: str, tags: dict[str, str], params: dict[str, Any] | None = None,
               note: str | None = None) -> str | None:
        """The study's parent run, found by its identity; else a new one when `create`. `create` says there
        is work to do: only then is a found parent reopened (RUNNING until `finish`), so a rerun with nothing
        to run leaves it as it ended."""
        with self.creation_lock():
            same = tracking.find_runs(self.uri, self.experiment, {K.TAG_ROLE: "parent", TAG_STUDY_HASH: self.hash})
            if same:
                self.parent_run_id = same[-1].info.run_id
                if create:
                    tracking.reopen_run(self.uri, self.parent_run_id)
                return self.parent_run_id
            if not create:
                return None
            pid = tracking.start_run(self.uri, self.experiment, run_name, tags={
                K.TAG_ROLE: "parent", TAG_STUDY_HASH: self.hash, K.TAG_COMMIT: tracking.git_commit(), **tags})
        if tracking.sqlite_path(self.uri) is None:  # the lock above is this machine's: settle with the others
            time.sleep(SETTLE_S)
            same = tracking.find_runs(self.uri, self.experiment, {K.TAG_ROLE: "parent", TAG_STUDY_HASH: self.hash})
            first = min((r.info.run_id for r in same), default=pid)  # what every runner that created one picks
            if first != pid:  # another machine created it at the same moment: ours goes
                tracking.client(self.uri).delete_run(pid)
                self.parent_run_id = first
                return first
        if note:  # the experiment's description in the MLflow UI
            c = tracking.client(self.uri)
            c.set_experiment_tag(c.get_run(pid).info.experiment_id, "mlflow.note.content", note)
        if params:
            tracking.log_params(self.uri, pid, params)
        self.parent_run_id = pid
        return pid

    # -- execution
    def execute(self, source: TaskSource, *, executor: str = "local", workers: int = 1,
                progress: Progress | None = None, cluster: dict[str, Any] | None = None) -> tuple[dict[str, Outcome], bool]:
        """Run the source's tasks, `workers` at a time (0: one at a time in this process); returns
        (outcomes by task key, interrupted). A Ctrl-C ends the runs in flight KILLED (resumable)."""
        outcomes: dict[str, Outcome] = {}
        stop = self.lock_path.with_name(self.lock_path.name.replace("study", f"stop-{os.getpid()}", 1))
        runner, interrupted = Runner.this(stop), False
        ex = make_executor(executor, workers, self.runs_dir / self.experiment / "submitit", **(cluster or {}))
        futures: dict[Future, Task] = {}

        def collect(f: Future, t: Task) -> None:
            with interrupts_held():
                collect_held(f, t)

        def collect_held(f: Future, t: Task) -> None:
            try:
                out = f.result()
            except Exception as e:  # noqa: BLE001 - a dead worker process, or submitit's FailedJobError
                why = (f"{type(e).__name__}: {e}" if not isinstance(e, BrokenProcessPool)
                       else "worker process died (killed, often for memory, or crashed); rerun to resume it")
                out = Outcome(t.key, t.label, "FAILED", error=why, note=t.note, worker_died=True)
            outcomes[t.key] = out
            source.done(t, out)
            if progress is not None:
                progress.finish(out)

        try:
            while True:
                free = (max(1, workers) - len(futures))
                with interrupts_held():
                    taken = source.take(free) if free > 0 else []
                for t in taken:
                    t.parent_run_id, t.runner = t.parent_run_id or self.parent_run_id, runner
                    outcomes[t.key] = Outcome(t.key, t.label, "KILLED", error="interrupted", note="interrupted")
                    # --workers 0 trains right here, in submit: a Ctrl-C there must reach the training
                    with interrupts_held() if workers > 0 else nullcontext():
                        f = ex.submit(run_task, t, task_kind(t.kind))
                    futures[f] = t
                    if f.done():  # --workers 0 ran it already
                        collect(f, futures.pop(f))
                if not futures:
                    if source.exhausted():
                        break
                    time.sleep(0.1)  # a source that waits (a sweep whose other runners hold the last trials)
                    continue
                for f in wait(futures, timeout=POLL_S, return_when=FIRST_COMPLETED).done:
                    collect(f, futures.pop(f))
                if futures:
                    running = list(futures.values())
                    with interrupts_held():
                        source.poll(running)
                        if progress is not None:
                            progress.show(self.uri, running)
            ex.shutdown()
        except BaseException as e:  # Ctrl-C / SIGTERM, or the runner cannot go on (its study's database lost)
            interrupted = isinstance(e, KeyboardInterrupt)
            if interrupted and progress is not None:
                progress.write("\ninterrupted: runs in flight end KILLED; rerun the same command to resume them")
            stop.touch()  # the workers stop their runs KILLED, resumable (a Ctrl-C reached them too; a SIGTERM only us)
            ex.shutdown(cancel=True)
            if not interrupted:  # an error: said by the caller once the runs in flight have ended
                raise
        finally:
            stop.unlink(missing_ok=True)
            if progress is not None:
                progress.close()
        return outcomes, interrupted

    # -- the end
    def finish(self, status: str, *, tags: dict[str, str] | None = None, clear: tuple[str, ...] = (),
               metrics: dict[str, float] | None = None) -> None:
        """Close the parent run `status` (FINISHED, FAILED or KILLED) for every runner: `tags` set, the tags
        in `clear` removed where it has them (an earlier attempt's failure, when nothing failed now), the
        `metrics` logged once per invocation (at the step after the last one logged)."""
        if self.parent_run_id is None:
            return
        uri, pid = self.uri, self.parent_run_id
        if tags:
            tracking.set_tags(uri, pid, tags)
        if clear:
            tracking.delete_tags(uri, pid, list(clear))
        if metrics:
            tracking.MetricLogger(uri, pid).log(metrics, step=tracking.next_step(uri, pid, next(iter(metrics))))
        tracking.end_run(uri, pid, status)
