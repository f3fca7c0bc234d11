"""Where runs execute: one executor interface (`submit(fn, *args) -> Future`) over three engines,
and `launch_train`, the multi-rank engine for one training.

    ex = executor("local", workers=2)            # each call in its own spawned process, 2 at a time
    ex = executor("slurm", workers=8, folder="runs/x/slurm", slurm_partition="gpu", gpus_per_node=8)
    ex = executor("submitit-local", workers=2, folder=...)   # the slurm code path, without Slurm
    fut = ex.submit(fn, task); fut.result(); ex.shutdown()

    res = launch_train(cfg, nproc=2)             # a TrainConfig on 2 local ranks (torchrun)
    res = launch_train("ablations/bases/paper_7b_deepspeed.yaml", ["ppo.steps=10"], nproc=8)

The harness.ablate runner sends every run through an executor; a run whose config needs several
ranks calls `launch_train` inside its worker. `launch_train` writes the resolved config next to the
run (`{output_dir}/{run_name}/launch_config.yaml`), starts `torchrun --standalone --nproc_per_node N
-m harness.train that.yaml` (or the `deepspeed` launcher), and returns the `RunResult` that
`harness.train.train` returns, read back from the trainer's `run.json` and its MLflow run (rank 0
logs one run; other ranks log nothing). Each job picks its own free port, so several share a machine.

`on_step(step, metrics)` works across the process boundary: while the job runs, the metrics named
in `watch` are polled from MLflow and passed to it step by step; when it returns True a STOP file
in the run folder asks the job to stop after its current step (status FINISHED, tag
`harness.stopped_by=callback`, exactly like an in-process callback). Steps may reach the callback
a few seconds late, so the job can run on a step or two past the one the callback stopped.

CLI (prints the RunResult as JSON):
    python -m harness.launch --nproc 2 CONFIG.yaml [--set k=v ...] [--resume] [--launcher deepspeed]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from . import keys, tracking
from .config import ConfigError, TrainConfig, from_dict, load_config, merge, parse_overrides, to_dict, to_yaml

STOP_FILE = "STOP"  # = harness.parallel.STOP_FILE (not imported: this module must stay light, without torch)
EXECUTORS = ("local", "slurm", "submitit-local")


class Executor:
    """`submit(fn, *args) -> Future`: at most `workers` calls at a time, each made by
    `engine(fn, *args)` (which blocks until the result) on a thread of this process; workers=0
    calls fn at once in the caller's thread (for pdb). `cancel()` stops the engine's calls in flight
    (cluster jobs, which a Ctrl-C here does not reach)."""

    def __init__(self, workers: int, engine: Callable[..., Any], cancel: Callable[[], None] | None = None):
        self.pool = ThreadPoolExecutor(workers) if workers > 0 else None
        self.engine, self.cancel = engine, cancel

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
        if cancel and self.cancel is not None:
            self.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=cancel)


def in_own_process(fn: Callable[..., Any], *args: Any) -> Any:
    """Call fn in a fresh spawned process. A pool of one per call: a process that dies (OOM kill,
    segfault) raises BrokenProcessPool for this call only, where one shared pool would break and
    stop every call in flight."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


class OnCluster:
    """Engine: each call one submitit job (cluster `slurm`, or `local`: subprocesses on this
    machine without Slurm). params: submitit's (timeout_min, gpus_per_node, cpus_per_task,
    slurm_partition, ...). A job that dies raises submitit's FailedJobError / UncompletedJobError."""

    def __init__(self, folder: str | Path, cluster: str, **params: Any):
        import submitit

        self.ex = submitit.AutoExecutor(folder=folder, cluster=cluster)
        self.ex.update_parameters(**params)
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
    engine = OnCluster(folder or "submitit", "slurm" if kind == "slurm" else "local", **cluster_params)
    return Executor(workers, engine, engine.cancel)


def launch_command(config_path: str | Path, nproc: int, *, resume: bool = False, launcher: str = "torchrun",
                   nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: int = 29500,
                   program: Sequence[str] | None = None) -> list[str]:
    """The command line that starts the job on this machine (one call per machine when nnodes > 1)."""
    prog = list(program) if program else ["-m", "harness.train"]
    tail = [str(config_path)] + (["--resume"] if resume else [])
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        if nnodes == 1:
            cmd += ["--standalone"]  # picks a free port: several jobs can share a machine
        else:
            cmd += [f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={master_port}"]
        return cmd + prog + tail
    if launcher == "deepspeed":
        beside = Path(sys.executable).with_name("deepspeed")  # the launcher of this environment
        ds = str(beside) if beside.exists() else (shutil.which("deepspeed") or "deepspeed")
        cmd = [ds, f"--num_gpus={nproc}", f"--master_port={master_port}"]
        if nnodes > 1:
            cmd += [f"--num_nodes={nnodes}", f"--node_rank={node_rank}", f"--master_addr={master_addr}"]
        if prog[:1] == ["-m"]:
            return cmd + ["--module", prog[1]] + prog[2:] + tail
        return cmd + prog + tail
    raise ValueError(f"launcher: got {launcher!r}; allowed: 'torchrun' or 'deepspeed'")


def _resolve(cfg: TrainConfig | str | Path | None, overrides: list[str] | dict | None) -> TrainConfig:
    if isinstance(cfg, TrainConfig):
        if overrides:
            over = parse_overrides(overrides) if isinstance(overrides, list) else overrides
            return from_dict(merge(to_dict(cfg), over))
        return cfg
    return load_config(cfg, overrides)


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
    """Train `cfg` (a TrainConfig, or a YAML path plus overrides) on `nproc` local ranks; returns a
    `harness.train.RunResult`. Raises ConfigError for a config that does not validate (checked here,
    before the job starts); a job that fails later returns status FAILED with the reason."""
    from .train import RunResult, default_run_name

    c = _resolve(cfg, overrides)
    run_name = c.logging.run_name or default_run_name(c)
    c = dataclasses.replace(c, logging=dataclasses.replace(c.logging, run_name=run_name))
    run_dir = Path(c.logging.output_dir) / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_file = run_dir / "launch_config.yaml"
    cfg_file.write_text(to_yaml(c))
    (run_dir / STOP_FILE).unlink(missing_ok=True)
    run_json = run_dir / "run.json"
    before = run_json.stat().st_mtime_ns if run_json.exists() else None

    child_env = {**os.environ, **(env or {})}
    if "OMP_NUM_THREADS" not in child_env:
        child_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    cmd = launch_command(cfg_file, nproc, resume=resume, launcher=launcher, program=program)
    log_path = run_dir / "launch.log"
    with open(log_path, "ab") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
        seen, stopped = 0, False
        try:
            while True:
                try:
                    rc = proc.wait(timeout=poll_s)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if on_step is not None and not stopped:
                    seen, stopped = _feed(c, run_json, before, watch, seen, on_step, run_dir)
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
    if on_step is not None and not stopped:
        _feed(c, run_json, before, watch, seen, on_step, run_dir)
    fresh = run_json.exists() and run_json.stat().st_mtime_ns != before
    if not fresh:
        tail = log_path.read_text(errors="replace")[-3000:]
        if rc == 2 and "invalid config" in tail:
            raise ConfigError([tail[tail.index("invalid config"):].strip()])
        return RunResult(run_id="", status="FAILED", steps_done=0,
                         error=f"job exited with code {rc} before starting a run; see {log_path}:\n{tail}", run_dir=str(run_dir))
    info = json.loads(run_json.read_text())
    res = RunResult(run_id=info["run_id"], status=info.get("status", "FAILED"), steps_done=int(info.get("step", 0)),
                    error=info.get("error"), run_dir=str(run_dir))
    if res.status == "RUNNING":  # the job died without rank 0 closing the run (killed, or another rank failed)
        res.status = "FAILED"
        res.error = res.error or f"job exited with code {rc}; see {log_path}"
        try:
            tracking.set_tags(c.logging.tracking_uri, res.run_id, {keys.TAG_FAILURE: res.error[:4000]})
            tracking.end_run(c.logging.tracking_uri, res.run_id, res.status)
        except Exception:
            pass
    try:
        run = tracking.client(c.logging.tracking_uri).get_run(res.run_id)
        res.final_metrics = dict(run.data.metrics)
        res.collapsed = run.data.tags.get(keys.TAG_COLLAPSED) == "true"
        if keys.COLLAPSE_STEP in run.data.metrics:
            res.collapse_step = int(run.data.metrics[keys.COLLAPSE_STEP])
    except Exception:
        pass
    return res


def _feed(c: TrainConfig, run_json: Path, before: int | None, watch: Sequence[str], seen: int,
          on_step: Callable[[int, dict[str, float]], bool], run_dir: Path) -> tuple[int, bool]:
    """Pass steps after `seen` (all `watch` keys logged) to on_step; STOP file when it says stop."""
    if not run_json.exists() or run_json.stat().st_mtime_ns == before:
        return seen, False
    try:
        run_id = json.loads(run_json.read_text())["run_id"]
        hist: dict[int, dict[str, float]] = {}
        for k in watch:
            for step, v in tracking.metric_history(c.logging.tracking_uri, run_id, k):
                hist.setdefault(step, {})[k] = v
    except Exception:
        return seen, False
    for step in sorted(s for s, m in hist.items() if s > seen and len(m) == len(watch)):
        seen = step
        if on_step(step, hist[step]):
            (run_dir / STOP_FILE).touch()
            return seen, True
    return seen, False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.launch", description="Run one training as a multi-rank job (torchrun or deepspeed) and wait for it.")
    ap.add_argument("config", nargs="?")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--nproc", type=int, required=True, help="ranks on this machine (GPUs, or CPU processes)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--launcher", choices=["torchrun", "deepspeed"], default="torchrun")
    args = ap.parse_args(argv)
    try:
        res = launch_train(args.config, args.overrides, nproc=args.nproc, resume=args.resume, launcher=args.launcher)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(res), indent=1, default=str))
    return 0 if res.status == "FINISHED" else 1


if __name__ == "__main__":
    sys.exit(main())
