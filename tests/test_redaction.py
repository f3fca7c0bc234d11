"""Credentials never reach any output: an MLflow store URI with a password, through every CLI, in
subprocesses, as a user's terminal shows them: tracebacks Python prints, MLflow's own log lines and
its `View run ... at: URL` prints, lines written by worker processes (harness.tracking.redact_output).

An unreachable server (port 9 on the loopback: nothing listens) fails every command at its first
request, its URL in the exception; a live `mlflow server` on the loopback gets the runs of a tiny
grid, and MLflow prints where to view each of them.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fakes import runner_command
from helpers import fast_overrides, sqlite_uri, study_storage

REPO = Path(__file__).resolve().parents[1]
SECRET = "S3CRET"
MASKED = "user:***@127.0.0.1"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
       "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def run_all(commands: dict[str, list[str]], cwd: Path, timeout: float = 300) -> dict[str, tuple[int, str]]:
    """Each command (`python -m ...` arguments) in its own process, all at once: {name: (rc, stdout + stderr)}."""
    procs = {name: subprocess.Popen([sys.executable, "-m", *cmd], cwd=cwd, env=ENV, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for name, cmd in commands.items()}
    return {name: (p.wait(timeout=timeout), p.communicate()[0]) for name, p in procs.items()}


def sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def tiny_grid(tmp_path: Path, world: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
name: {name}
figure: "6"
title: one tiny run
base: {REPO / 'ablations' / 'bases' / 'vanilla.yaml'}
set:
  data.world_dir: {world}
  data.eval_prompts: 8
  ppo.steps: 2
  ppo.rollout_batch_size: 8
  ppo.num_minibatches: 2
  ppo.ppo_epochs: 1
  generation.max_new_tokens: 8
  logging.eval_every: 0
  logging.sample_every: 0
  logging.checkpoint_every: 0
seeds: [0]
variants: ["vanilla"]
""")
    return path


def test_redact_output_masks_log_records_prints_and_uncaught_exceptions():
    """In one process: a logging handler made before the call (it holds the raw stderr), a print, a
    thread's uncaught exception and the main thread's: each shows the URI masked."""
    code = f"""
import logging, sys, threading
logging.basicConfig(stream=sys.stderr)  # a handler holding the stream as it was
from harness import tracking
tracking.redact_output()
tracking.redact_output()  # twice: still one layer of each
url = "http://user:{SECRET}@127.0.0.1:9/api/2.0/mlflow/runs/get"
logging.getLogger("mlflow.test").warning("request to %s failed", url)
try:
    raise ConnectionError(url)
except ConnectionError:
    logging.getLogger("other").exception("caught")
print("printed", url, flush=True)
assert sys.stdout.fileno() == 1 and isinstance(sys.stdout.isatty(), bool)
def fail():
    raise ValueError(url)
t = threading.Thread(target=fail, name="worker")
t.start(); t.join()
raise RuntimeError(url)
"""
    p = subprocess.run([sys.executable, "-c", code], env=ENV, text=True, capture_output=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and SECRET not in out, out
    assert out.count(MASKED) == 5, out  # the warning, the logged traceback, the print, both uncaught exceptions
    assert "Exception in thread worker" in out and "RuntimeError: http://user:***@" in p.stderr


def test_a_store_that_cannot_be_opened_is_one_line_naming_it_masked_and_the_fix_not_a_traceback():
    """A database store whose driver is not installed (or, where it is, whose server does not
    answer): the reader ends with `error: the MLflow store ... cannot be opened (...)`, exit 1."""
    dead = f"postgresql://user:{SECRET}@127.0.0.1:1/db"
    p = subprocess.run([sys.executable, "-m", "analysis.claims", "vanilla", "--tracking-uri", dead], env=ENV,
                       text=True, capture_output=True, timeout=120, cwd=REPO)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and SECRET not in out, out
    assert "Traceback" not in out, out
    assert f"error: the MLflow store postgresql://{MASKED}:1/db cannot be opened (" in p.stderr, out
    assert len(p.stderr.strip().splitlines()) == 1, out  # one line, not MLflow's ~100 s of retry warnings


@pytest.mark.slow
def test_no_cli_prints_the_password_of_an_unreachable_store(tmp_path, tiny_world):
    dead = f"http://user:{SECRET}@127.0.0.1:9/"
    grid = tiny_grid(tmp_path, tiny_world, "pw_grid")
    sweep = tmp_path / "pw_sweep.yaml"
    sweep.write_text(f"name: pw_sweep\nbase: {REPO / 'ablations' / 'bases' / 'vanilla.yaml'}\nsteps: 2\ntrials: 1\n"
                     "search_space:\n  ppo.kl_coef: {low: 0.01, high: 0.1}\nset:\n"
                     + "".join(f"  {o.replace('=', ': ', 1)}\n" for o in fast_overrides(tiny_world, tmp_path)
                               if not o.startswith(("logging.tracking_uri", "ppo.steps"))))
    store = ["--tracking-uri", dead]
    commands = {
        "harness.train": ["harness.train", *sets(fast_overrides(tiny_world, tmp_path, **{"logging.tracking_uri": dead}))],
        "harness.ablate": ["harness.ablate", str(grid), *store, "--runs-dir", str(tmp_path / "runs"), "--no-progress"],
        "harness.sweep": ["harness.sweep", str(sweep), *store, "--storage", study_storage(tmp_path)],
        "harness.world": ["harness.world", "build", "--tiny", "--out", str(tmp_path / "w"), "--quiet", *store],
        "analysis.figures": ["analysis.figures", "vanilla", *store, "--no-log", "--out", str(tmp_path / "res")],
        "analysis.claims": ["analysis.claims", "vanilla", *store],
        "analysis.compare": ["analysis.compare", *store],
        "reports.build": ["reports.build", "vanilla", *store, "--no-log", "--out", str(tmp_path / "res")],
    }
    for name, (rc, out) in run_all(commands, tmp_path).items():
        assert rc != 0 and SECRET not in out, f"{name} (exit {rc}):\n{out}"
        assert MASKED in out, f"{name}: the store's URI is not in its output, so this case tests nothing:\n{out}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    end = time.time() + timeout
    while time.time() < end:
        assert proc.poll() is None, f"mlflow server exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"mlflow server at {url} did not answer within {timeout} s")


@pytest.mark.slow
def test_a_live_servers_view_run_lines_are_masked(tmp_path, tiny_world):
    """MLflow writes `View run NAME at: URL` to stdout itself when a run on a server ends: the grid's
    parent run in the runner's process, the run in its worker's. The server's job runner is off, as in
    tests/servers.py (four processes importing MLflow for jobs that no request here makes)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1", "--backend-store-uri", sqlite_uri(tmp_path / "server.db"),
                               "--artifacts-destination", str(tmp_path / "artifacts")],
                              cwd=tmp_path, env={**ENV, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until_up(f"http://127.0.0.1:{port}", server)
        grid = tiny_grid(tmp_path, tiny_world, "live_grid")
        # the runner in a process of its own, its run's worker too; the run's training is fake (tests/fakes.py)
        p = subprocess.run(runner_command("harness.ablate", str(grid), "--tracking-uri", f"http://user:{SECRET}@127.0.0.1:"
                                          f"{port}/", "--runs-dir", str(tmp_path / "runs"), "--no-progress"),
                           cwd=tmp_path, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
        rc, out = p.returncode, p.stdout
    finally:
        os.killpg(server.pid, 15)  # the server and its workers: the session it was started in
        server.wait(timeout=60)
    assert rc == 0, out
    views = [line for line in out.splitlines() if "View run" in line]
    assert len(views) >= 2 and all(MASKED in line for line in views), out
    assert SECRET not in out, out
