"""How a runner ends when it is stopped or cannot run (harness.study under harness.ablate and harness.sweep),
on fake training tasks (tests/fakes.py) and real sqlite stores in tmp_path:

- SIGTERM of the runner alone, or Ctrl-C (SIGINT to its whole process group, as a terminal sends it), while
  runs are still queued: the summary of what finished, what was stopped and what never started, exit 130,
  nothing left RUNNING;
- a rerun of a finished grid leaves its parent run FINISHED (nothing to run: nothing reopened);
- `--executor slurm` where Slurm is missing, and executor options out of range, are refused before a
  study, an experiment or a parent run exists.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from harness import ablate, sweep, tracking

from fakes import runner_command
from helpers import alive_in, grid_argv, last_step, runs_in, started, store_uri, tiny_grid, wait_for, write_sweep

REPO = Path(__file__).resolve().parents[1]
LONG = ["--set", "ppo.steps=100"]  # fake steps: seconds in flight


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_an_interrupt_with_runs_queued_prints_the_summary_and_exits_130(tmp_path, tiny_world, how):
    path, log = tiny_grid(tmp_path, tiny_world, "queued_grid"), tmp_path / "runner.log"
    uri = store_uri(tmp_path)
    argv = grid_argv(tmp_path, path, "--workers", "2", "--seeds", "0,1", *LONG)  # 4 runs, 2 of them queued
    with started("harness.ablate", argv, REPO, log, command=runner_command("harness.ablate", *argv)) as proc:
        wait_for(lambda: len([r for r in runs_in(uri, "queued_grid") if last_step(uri, r.info.run_id) >= 2]) == 2,
                 proc, "two runs past step 2", log)
        if how == "sigterm":
            os.kill(proc.pid, signal.SIGTERM)  # the runner alone
        else:
            os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the runner and its workers
        assert proc.wait(timeout=120) == 130, log.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while (left := alive_in(proc.pid, tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"still alive after the runner ended: {left}"
    out = log.read_text()
    assert "Traceback" not in out, out[-3000:]
    assert "interrupted: 0 of 4 runs finished, 2 stopped (KILLED, resumable), 2 not started" in out, out[-3000:]
    assert out.count("not started: the runner was interrupted") == 2, out[-3000:]
    runs = runs_in(uri, "queued_grid")
    assert len(runs) == 2 and {r.info.status for r in runs} == {"KILLED"}
    (parent,) = runs_in(uri, "queued_grid", "parent")
    assert parent.info.status == "KILLED"


def test_a_rerun_of_a_finished_grid_leaves_its_parent_finished(tmp_path, tiny_world, fake_training, capsys):
    path, uri = tiny_grid(tmp_path, tiny_world, "done_grid"), store_uri(tmp_path)
    argv = grid_argv(tmp_path, path, "--workers", "0", "--set", "ppo.steps=2")
    assert ablate.main(argv) == 0
    (parent,) = runs_in(uri, "done_grid", "parent")
    assert parent.info.status == "FINISHED"
    capsys.readouterr()
    assert ablate.main(argv) == 0
    assert "(nothing to run)" in capsys.readouterr().out
    (again,) = runs_in(uri, "done_grid", "parent")
    assert (again.info.run_id, again.info.status, again.info.end_time) == (
        parent.info.run_id, "FINISHED", parent.info.end_time)


@pytest.mark.parametrize("flags, problem", [
    (["--executor", "slurm"], "--executor: got 'slurm' but Slurm's sbatch/srun are not on this machine's PATH"),
    (["--nproc", "0"], "--nproc: got 0; allowed: an integer >= 1"),
    (["--nproc", "-2"], "--nproc: got -2; allowed: an integer >= 1"),
    (["--slurm-gpus", "-1"], "--slurm-gpus: got -1; allowed: an integer >= 0"),
    (["--slurm-time-min", "-5"], "--slurm-time-min: got -5; allowed: an integer >= 1"),
    (["--slurm-cpus", "0"], "--slurm-cpus: got 0; allowed: an integer >= 1"),
])
def test_executor_options_that_cannot_run_are_refused_before_anything_exists(
        tmp_path, tiny_world, monkeypatch, capsys, flags, problem):
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))  # whatever this machine has: no srun, no sbatch
    monkeypatch.chdir(tmp_path)
    grid, uri = tiny_grid(tmp_path, tiny_world, "slurm_grid"), store_uri(tmp_path)
    assert ablate.main(grid_argv(tmp_path, grid, *flags)) == 2
    assert problem in capsys.readouterr().err
    swept = write_sweep(tmp_path, tiny_world, "slurm_sweep")
    assert sweep.main([str(swept), "--tracking-uri", uri, *flags]) == 2
    err = capsys.readouterr().err
    assert problem in err and "Traceback" not in err
    assert not (tmp_path / "optuna.db").exists()  # no study
    if (tmp_path / "mlflow.db").exists():  # no experiment, no parent run
        assert tracking.client(uri).search_experiments(filter_string="name != 'Default'") == []


def test_a_ctrl_c_or_sigterm_inside_a_held_block_acts_when_it_ends_and_an_ignored_one_stays_ignored():
    from harness.study import interrupts_held

    # a suite started in the background (`cmd &` from a script) inherits SIGINT ignored: Python then keeps it
    # ignored, and the block rightly leaves it so; the Ctrl-C case needs the handler an interactive start has
    started_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    reached_end = False
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # a handler would have run by now: the store call in here goes on
            reached_end = True
    assert reached_end and signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def as_runner(signum, frame):  # what harness.study's runner installs for SIGTERM
        raise KeyboardInterrupt("signal SIGTERM")

    previous = signal.signal(signal.SIGTERM, as_runner)
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            with interrupts_held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
        assert signal.getsignal(signal.SIGTERM) is as_runner
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # started with `&`: Ctrl-C ignored, and still after the block
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, started_with)
