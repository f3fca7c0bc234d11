"""Where runs execute: one executor interface (`submit(fn, *args) -> Future`) over three engines,
and `launch_train`, the multi-rank engine for one training (contract: docs/CONTRACTS.md).

    ex = executor("local", workers=2)            # each call in its own fresh process, 2 at a time
    ex = executor("slurm", workers=8, folder="runs/x/slurm", slurm_partition="gpu", gpus_per_node=8)
    ex = executor("submitit-local", workers=2, folder=...)   # the slurm code path, without Slurm
    res = launch_train(cfg, nproc=2)             # a TrainConfig on 2 local ranks (torchrun)
    python -m harness.launch --nproc 2 CONFIG.yaml [--set k=v ...] [--resume] [--launcher deepspeed]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from . import keys, statefile, tracking
from .config import TrainConfig, load_config, to_yaml
from .schema import ConfigError

EXECUTORS = ("local", "slurm", "submitit-local")
LAUNCHERS = ("torchrun", "deepspeed")


class Executor:
    """`submit(fn, *args) -> Future`: at most `workers` calls at a time, each made by
    `engine(fn, *args)` (which blocks until the result) on a thread of this process; workers=0
    calls fn at once in the caller's thread (for pdb). An engine's `cancel()`, if it has one, stops
    its calls in flight (cluster jobs, which a Ctrl-C here does not reach)."""

    def __init__(self, workers: int, engine: Callable[..., Any]):
        self.pool = ThreadPoolExecutor(workers) if workers > 0 else None
        self.engine = engine

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self.pool is not None:
            return self.pool.submit(self.engine, fn, *args)
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - delivered through the future, as from a pool
            fut.set_exception(e)
        return fut

    def shutdown(self, cancel: bool = False) -> None:
        """Wait for the calls in flight; cancel=True first drops those not started and cancels the others."""
        if cancel and hasattr(self.engine, "cancel"):
            self.engine.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=cancel)


# What a run imports, loaded once by the fork server: torch, transformers' GPT-2, MLflow (~3 s of
# CPU), and what a run would otherwise import lazily at its start, every run again (~1 s: MLflow's
# SQL store and its sqlite dialect and migration code, the trainer, the tokenizer loader). None of
# them starts a thread or opens a file. A name that fails to import is skipped by the fork server,
# silently, so a test (tests/test_ablate.py) checks that a run starts with each one imported.
PRELOAD = [
    "harness.train", "harness.trainer", "harness.data",
    "transformers.models.gpt2.modeling_gpt2", "transformers.models.auto.tokenization_auto",
    "mlflow.store.tracking.sqlalchemy_store", "sqlalchemy.dialects.sqlite", "alembic.command",
]


@functools.cache
def run_context() -> mp.context.BaseContext:
    """Where each run's process comes from: forked by a server process that imported PRELOAD once
    (`forkserver`), so a run starts clean (no threads, no store connections: the server only
    imports) without paying the imports again; `spawn` where there is no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def in_own_process(fn: Callable[..., Any], *args: Any) -> Any:
    """Call fn in a fresh process (`run_context`). A pool of one per call: a process that dies (OOM
    kill, segfault) raises BrokenProcessPool for this call only, where one shared pool would break
    and stop every call in flight."""
    with ProcessPoolExecutor(1, mp_context=run_context()) as pool:
        return pool.submit(fn, *args).result()


def start_fork_server() -> threading.Thread:
    """Start the fork server now, in the background: it imports PRELOAD (~5 s of one core) while the
    caller does other work first (the main job builds the world on one core), and the first runs
    then start at once. A no-op call in its own process, so only public multiprocessing API."""
    t = threading.Thread(target=in_own_process, args=(int,), name="fork-server-start", daemon=True)
    t.start()
    return t


class OnCluster:
    """Engine: each call one submitit job (cluster `slurm`, or `local`: subprocesses on this
    machine without Slurm). params: submitit's (timeout_min, gpus_per_node, cpus_per_task,
    slurm_partition, ...). A job that dies raises submitit's FailedJobError / UncompletedJobError."""

    def __init__(self, folder: str | Path, cluster: str, **params: Any):
        import submitit

        self.ex = submitit.AutoExecutor(folder=folder, cluster=cluster)
        self.ex.update_parameters(**params)
        if cluster == "local" and signal.getsignal(signal.SIGINT) is signal.SIG_IGN \
                and threading.current_thread() is threading.main_thread():
            # submitit cancels a local job by SIGINT to its controller process, which inherits this
            # process's disposition: started in the background (`cmd &`), SIGINT is ignored here and
            # a cancel would leave the job running to its end
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self.lock, self.jobs = threading.Lock(), set()  # submissions one at a time; the jobs in flight

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self.lock:
            job = self.ex.submit(fn, *args)
            self.jobs.add(job)
        try:
            return job.result()
        finally:
            self.jobs.discard(job)

    def cancel(self) -> None:
        for job in list(self.jobs):
            job.cancel(check=False)


def executor(kind: str, workers: int, folder: str | Path | None = None, **cluster_params: Any) -> Executor:
    """kind: `local` (each call in its own process), `slurm` or `submitit-local` (jobs; `folder`
    holds submitit's files and logs)."""
    if kind == "local":
        return Executor(workers, in_own_process)
    if kind not in EXECUTORS:
        raise ValueError(f"executor: got {kind!r}; allowed: {', '.join(EXECUTORS)}")
    return Executor(workers, OnCluster(folder or "submitit", "slurm" if kind == "slurm" else "local", **cluster_params))


def launch_command(config_path: str | Path, nproc: int, *, resume: bool = False, launcher: str = "torchrun",
                   nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: int = 29500,
                   program: Sequence[str] | None = None) -> list[str]:
    """The command line that starts the job on this machine (one call per machine when nnodes > 1;
    one machine: torchrun picks a free port, so several jobs can share it)."""
    prog = list(program or ["-m", "harness.train"])
    tail = [str(config_path)] + (["--resume"] if resume else [])
    many = [f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--master_addr={master_addr}"] if nnodes > 1 else []
    if launcher == "torchrun":
        where = [*many, f"--master_port={master_port}"] if many else ["--standalone"]
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *where, *prog, *tail]
    if launcher != "deepspeed":
        raise ValueError(f"launcher: got {launcher!r}; allowed: {', '.join(LAUNCHERS)}")
    beside = Path(sys.executable).with_name("deepspeed")  # the launcher of this environment
    ds = str(beside) if beside.exists() else (shutil.which("deepspeed") or "deepspeed")
    many = [m.replace("--nnodes", "--num_nodes") for m in many]
    module = ["--module", *prog[1:]] if prog[0] == "-m" else prog
    return [ds, f"--num_gpus={nproc}", f"--master_port={master_port}", *many, *module, *tail]


def nproc_problems(nproc: int | None) -> list[str]:
    """--nproc (ranks per run) below 1: refused before anything is created (harness.launch and every runner)."""
    if nproc is not None and nproc < 1:
        return [f"--nproc: got {nproc}; allowed: an integer >= 1 (ranks per run)"]
    return []


def launch_train(
    cfg: TrainConfig | str | Path | None = None,
    overrides: list[str] | dict | None = None,
    *,
    nproc: int,
    resume: bool = False,
    on_step: Callable[[int, dict[str, float]], bool] | None = None,
    watch: Sequence[str] = (keys.RM_SCORE,),
    poll_s: float = 2.0,
    launcher: str = "torchrun",
    env: dict[str, str] | None = None,
    program: Sequence[str] | None = None,
):
    """Train `cfg` (a TrainConfig, or a YAML path plus `overrides`) on `nproc` local ranks as one
    torchrun/deepspeed job of `program` (default `-m harness.train`) on the config written to
    `{run dir}/launch_config.yaml`; returns the `harness.train.RunResult` read back from the job's
    run.json and MLflow run. on_step gets the `watch` metrics polled from MLflow every `poll_s`; when
    it returns True a STOP file stops the job (a step or two late). Raises ConfigError for a config
    that does not validate; a job that fails later returns status FAILED with the reason."""
    from .parallel import validate
    from .train import RunResult, default_run_name

    if problems := nproc_problems(nproc):
        raise ConfigError(problems)
    c = cfg if isinstance(cfg, TrainConfig) else load_config(cfg, overrides)
    if problems := validate(c, world_size=nproc):  # a batch that does not split over nproc ranks: before the run
        raise ConfigError(problems)
    run_name = c.logging.run_name or default_run_name(c)
    c = dataclasses.replace(c, logging=dataclasses.replace(c.logging, run_name=run_name))
    uri = c.logging.tracking_uri or tracking.resolve_uri()  # the config's store (a CLI resolved it at its edge)
    c = dataclasses.replace(c, logging=dataclasses.replace(c.logging, tracking_uri=uri))
    run_dir = Path(c.logging.output_dir) / c.logging.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "launch_config.yaml").write_text(to_yaml(c))
    (run_dir / keys.STOP_FILE).unlink(missing_ok=True)
    run_json, log_path = run_dir / "run.json", run_dir / "launch.log"
    before = run_json.stat().st_mtime_ns if run_json.exists() else None

    def run_id() -> str | None:
        """The job's MLflow run, once its rank 0 wrote a fresh run.json."""
        fresh = run_json.exists() and run_json.stat().st_mtime_ns != before
        return statefile.read_json_object(run_json)["run_id"] if fresh else None

    seen, stopped = 0, on_step is None

    def feed() -> bool:
        """Pass the steps after `seen` with every `watch` key logged to on_step; True (and the STOP
        file) once it says stop."""
        nonlocal seen
        hist: dict[int, dict[str, float]] = {}
        try:
            rid = run_id()
            if rid is None:  # the job has not opened its run yet
                return False
            for k in watch:
                for step, v in tracking.metric_history(uri, rid, k):
                    hist.setdefault(step, {})[k] = v
        except Exception:  # noqa: BLE001 - run.json half written or the store busy: next poll
            return False
        for step in sorted(s for s, m in hist.items() if s > seen and len(m) == len(watch)):
            seen = step
            if on_step(step, hist[step]):
                (run_dir / keys.STOP_FILE).touch()
                return True
        return False

    env = {**os.environ, **(env or {}), "MLFLOW_TRACKING_URI": uri}  # the job's ranks resolve it at their CLI's edge
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = launch_command(run_dir / "launch_config.yaml", nproc, resume=resume, launcher=launcher, program=program)
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while (rc := proc.poll()) is None:
                time.sleep(poll_s)
                stopped = stopped or feed()
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
    if not stopped:
        feed()
    if run_id() is None:
        tail = log_path.read_text(errors="replace")[-3000:]
        if rc == 2 and "invalid config" in tail:
            raise ConfigError([tail[tail.index("invalid config"):].strip()])
        return RunResult(run_id="", status="FAILED", steps_done=0, run_dir=str(run_dir),
                         error=f"job exited with code {rc} before starting a run; see {log_path}:\n{tail}")
    try:
        info = statefile.read_json_object(run_json)
    except statefile.StateFileError as e:  # rank 0 died writing it: the job's outcome is in the store
        return RunResult(run_id="", status="FAILED", steps_done=0, run_dir=str(run_dir),
                         error=f"job exited with code {rc}; {e}; see {log_path}")
    res = RunResult(run_id=info["run_id"], status=info.get("status", "FAILED"), steps_done=int(info.get("step", 0)),
                    error=info.get("error"), run_dir=str(run_dir))
    with contextlib.suppress(Exception):  # the store unreachable: the result from run.json stands
        if res.status == "RUNNING":  # the job died without rank 0 closing the run (killed, or another rank failed)
            res.status, res.error = "FAILED", res.error or f"job exited with code {rc}; see {log_path}"
            tracking.set_tags(uri, res.run_id, {keys.TAG_FAILURE: res.error[:4000]})
            tracking.end_run(uri, res.run_id, res.status)
        run = tracking.client(uri).get_run(res.run_id)
        res.final_metrics = dict(run.data.metrics)
        res.collapsed = run.data.tags.get(keys.TAG_COLLAPSED) == "true"
        if keys.COLLAPSE_STEP in run.data.metrics:
            res.collapse_step = int(run.data.metrics[keys.COLLAPSE_STEP])
    return res


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    ap = argparse.ArgumentParser(prog="python -m harness.launch", description="Run one training as a multi-rank job "
                                 "(torchrun or deepspeed) and wait for it.")
    ap.add_argument("config", nargs="?")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--nproc", type=int, required=True, help="ranks on this machine (GPUs, or CPU processes)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="torchrun")
    args = ap.parse_args(argv)
    try:
        cfg = tracking.at_cli_edge(load_config(args.config, args.overrides))
        res = launch_train(cfg, nproc=args.nproc, resume=args.resume, launcher=args.launcher)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(res), indent=1, default=str))
    return 0 if res.status == "FINISHED" else 1


if __name__ == "__main__":
    sys.exit(main())
