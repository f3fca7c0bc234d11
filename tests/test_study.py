"""The study layer (harness.study) as a user meets it, on the tiny world with real sqlite MLflow and
Optuna stores in tmp_path and real processes: kill -9 of a grid's runner alone (its workers end
their runs KILLED and exit; the rerun resumes them, no step trained or logged twice); two sweeps
started at once (no two trials drawn alike); $MLFLOW_TRACKING_URI followed by every writer and
reader, and --tracking-uri beating it; a rerun that clears an earlier attempt's failure tags; a grid
over two worlds; a sweep through submitit; one process per run folder; a resumed run that keeps its
collapse and its step count.

The runner semantics (kill -9, SIGTERM, a dead worker, two sweeps at once) run fake training tasks
(tests/fakes.py: the store and run folders as real runs leave them, in milliseconds a step): one real
kill -9 and resume per runner stays, in test_ablate.py and test_study_e2e.py. Grids run 60-step
fake runs (long enough to be in flight when killed), sweeps 2-step trials.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

from harness import ablate, sweep, sweepfile, tracking
from harness import keys as K
from harness import train as harness_train
from harness.config import load_config
from harness.study import Study, task_kind

from fakes import expected_points, runner_command
from helpers import (
    MICRO,
    VARIANTS,
    alive_in,
    assert_resumed_like,
    fast_overrides,
    grid_argv,
    last_step,
    runs_in,
    started,
    store_uri,
    study_storage,
    tiny_grid,
    wait_for,
    write_sweep,
)

REPO = Path(__file__).resolve().parents[1]
STEPS = 60  # fake steps (tests/fakes.py: STEP_S each): a run is seconds in flight, a watchdog sees its runner gone in ~1 s
LONG = ["--set", f"ppo.steps={STEPS}"]  # the grid files of helpers.tiny_grid train 20 steps


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """One MLflow store for the grids of this module (each under its own name)."""
    return tmp_path_factory.mktemp("store")


def fake_points(run) -> dict[str, list[tuple[int, float]]]:
    """What an uninterrupted fake run of this run's variant and seed logs (tests/fakes.py)."""
    return expected_points(run.data.tags[K.TAG_VARIANT], int(run.data.tags[K.TAG_SEED]), STEPS)


# ---------------------------------------------------------------------------- 1. kill -9 of the runner alone
def test_kill_9_of_the_runner_alone_ends_its_workers_and_the_rerun_resumes_each_step_once(
        tmp_path, store, tiny_world, fake_training, capsys):
    uri, path, log = store_uri(store), tiny_grid(tmp_path, tiny_world, "orphan_grid"), tmp_path / "runner.log"
    argv = grid_argv(store, path, "--workers", "2", *LONG)
    with started("harness.ablate", argv, REPO, log, command=runner_command("harness.ablate", *argv)) as proc:
        # both runs in flight, each past step 2 (so each has a checkpoint)
        wait_for(lambda: len([r for r in runs_in(uri, "orphan_grid") if last_step(uri, r.info.run_id) >= 2]) == 2,
                 proc, "two runs past step 2", log)
        os.kill(proc.pid, signal.SIGKILL)  # the runner alone, not its process group
        proc.wait()
        # each worker sees its runner gone within a second, ends its run at the next step and exits
        deadline = time.monotonic() + 45
        while (left := alive_in(proc.pid, tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, "processes of the killed runner still alive after 45 s:\n" + "\n".join(left)
    killed = runs_in(uri, "orphan_grid")
    assert len(killed) == 2
    for r in killed:  # ended by their workers (no runner has looked at the store since), long before the end
        assert r.info.status == "KILLED", r.info
        assert last_step(uri, r.info.run_id) < STEPS

    capsys.readouterr()
    assert ablate.main(argv) == 0
    assert "0 finished earlier, 2 to resume, 0 to start" in capsys.readouterr().out
    runs = runs_in(uri, "orphan_grid")
    assert [r.info.run_id for r in runs] == [r.info.run_id for r in killed]  # resumed into the same MLflow runs
    assert {r.info.status for r in runs} == {"FINISHED"}
    for r in runs:
        assert_resumed_like(uri, r.info.run_id, fake_points(r))
    (parent,) = runs_in(uri, "orphan_grid", "parent")
    assert parent.info.status == "FINISHED"
    assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {parent.info.run_id}


def test_sigterm_of_the_runner_ends_it_as_ctrl_c_does_with_nothing_left_running(tmp_path, tiny_world):
    """`kill PID` (SIGTERM: a scheduler's stop, a runner started in the background, where Ctrl-C is
    ignored): the runs in flight and the parent end KILLED, the workers exit, the exit code is 130."""
    path, log = tiny_grid(tmp_path, tiny_world, "term_grid"), tmp_path / "runner.log"
    uri, argv = store_uri(tmp_path), grid_argv(tmp_path, path, "--workers", "2", *LONG)
    with started("harness.ablate", argv, REPO, log, command=runner_command("harness.ablate", *argv)) as proc:
        wait_for(lambda: len([r for r in runs_in(uri, "term_grid") if last_step(uri, r.info.run_id) >= 2]) == 2,
                 proc, "two runs past step 2", log)
        os.kill(proc.pid, signal.SIGTERM)  # the runner alone
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while (left := alive_in(proc.pid, tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"still alive after the runner ended: {left}"
    assert {r.info.status for r in runs_in(uri, "term_grid")} == {"KILLED"}
    (parent,) = runs_in(uri, "term_grid", "parent")
    assert parent.info.status == "KILLED"
    assert "rerun the same command to resume" in log.read_text()


# ---------------------------------------------------------------------------- 2. two sweeps at once
def draws(sampler: optuna.samplers.BaseSampler, n: int, studies: int = 1) -> list[dict]:
    """Params of trials 0..n-1 of one in-memory study, asked in turn by `studies` runners (each its own
    Study object with its own sampler made by `sampler`) and told complete at once."""
    storage = optuna.storages.InMemoryStorage()
    runners = [optuna.create_study(storage=storage, study_name="s", sampler=sampler(), load_if_exists=True)
               for _ in range(studies)]
    for i in range(n):
        study = runners[i % studies]
        t = study.ask()
        t.suggest_float("x", 0.001, 0.5, log=True)
        t.suggest_int("k", 1, 1000)
        study.tell(t, 0.0)
    return [t.params for t in runners[0].get_trials()]


def test_trial_seeded_sampler_draws_by_trial_number():
    def seeded(make, seed: int = 0):
        return lambda: sweepfile.TrialSeeded(make, seed)

    def rand(seed):
        return optuna.samplers.RandomSampler(seed=seed)

    def tpe(seed):
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=3)

    one = draws(seeded(rand), 6)
    assert draws(seeded(rand), 6) == one  # the same seed and trial numbers: the same draws
    assert draws(seeded(rand), 6, studies=2) == one  # two runners taking turns on one study: still the same
    assert len({tuple(p.items()) for p in one}) == 6  # every trial number draws other values
    assert draws(seeded(rand, seed=1), 6) != one
    assert draws(seeded(tpe), 3, studies=2) == draws(seeded(tpe), 3)  # TPE's random start-up trials too
    assert len({tuple(p.items()) for p in draws(seeded(tpe), 3)}) == 3


def test_a_runner_started_during_another_ones_dead_run_recovery_waits_and_is_not_alone(tmp_path):
    """The race two sweeps started at once ran into: the first runner found itself alone, the second
    started a trial before the first closed what was RUNNING, and the first closed that live trial as
    a dead runner's. Now the recovery runs while the lock is held exclusively."""
    uri = store_uri(tmp_path)

    def runner(log: list[str], name: str) -> Study:
        return Study(uri, "twins", ("sweep", "twins"), runs_dir=tmp_path / "runs", exclusive=False,
                     recover=lambda st: log.append(f"{name} recovers, alone={st.alone}") or [name])

    log: list[str] = []
    second_in = threading.Event()

    def second() -> None:
        with runner(log, "second") as st:
            log.append(f"second in, alone={st.alone}, recovered={st.recovered}")
            second_in.set()
            held.wait(timeout=30)

    held = threading.Event()
    thread = threading.Thread(target=second)

    def first_recovers(st: Study) -> list[str]:
        log.append(f"first recovers, alone={st.alone}")
        thread.start()  # the second runner starts now, in the middle of the first one's recovery
        assert not second_in.wait(timeout=1.0), "the second runner got in during the first one's recovery"
        log.append("first recovered")
        return ["first"]

    first = Study(uri, "twins", ("sweep", "twins"), runs_dir=tmp_path / "runs", exclusive=False,
                  recover=first_recovers)
    with first:
        assert second_in.wait(timeout=30)
        assert (first.alone, first.recovered) == (False, ["first"])
        held.set()
        thread.join(timeout=30)
    assert log == ["first recovers, alone=True", "first recovered", "second in, alone=False, recovered=None"]
    with runner(log, "third") as st:  # everyone has left: the next runner recovers again
        assert st.recovered == ["third"]
    assert log[-1] == "third recovers, alone=True"


def test_two_sweeps_started_at_once_draw_by_trial_number_under_one_parent(tmp_path, tiny_world):
    """Two runners on a fresh store (stores, study, parent run created once between them)."""
    path = write_sweep(tmp_path, tiny_world, "twins", trials=4)
    argv = [str(path), "--tracking-uri", store_uri(tmp_path), "--threads", "1", "--set", "sweep.sampler.name=random"]
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(started("harness.sweep", argv, tmp_path, tmp_path / f"sweep{i}.log",
                                             command=runner_command("harness.sweep", *argv))) for i in range(2)]
        codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0, 0], "\n".join((tmp_path / f"sweep{i}.log").read_text()[-2000:] for i in range(2))
    trials = optuna.load_study(study_name="twins", storage=study_storage(tmp_path)).get_trials()
    assert len(trials) >= 4 and {t.state for t in trials} == {TrialState.COMPLETE}
    params = [tuple(sorted(t.params.items())) for t in trials]
    assert len(set(params)) == len(params), f"two trials drew the same values: {params}"
    # trial n draws what the sweep's sampler draws for trial n, whichever runner asked it
    spec = sweepfile.load_sweep(path, ["sweep.sampler.name=random"], store_uri(tmp_path))
    study = optuna.create_study(sampler=sweepfile.make_sampler(spec))
    for _ in trials:
        t = study.ask()
        for k, d in spec.space.items():
            d.suggest(t, k)
        study.tell(t, 0.0)
    assert [t.params for t in trials] == [t.params for t in study.get_trials()]

    (parent,) = runs_in(store_uri(tmp_path), "twins", "parent")
    assert parent.info.status == "FINISHED"
    c = tracking.client(store_uri(tmp_path))
    twice = {k: steps for k in parent.data.metrics
             if len(steps := [m.step for m in c.get_metric_history(parent.info.run_id, k)]) != len(set(steps))}
    assert not twice, f"parent metrics with two points at one step: {twice}"
    assert len(runs_in(store_uri(tmp_path), "twins")) == len(trials)


# ---------------------------------------------------------------------------- 3. $MLFLOW_TRACKING_URI
@pytest.mark.slow
def test_mlflow_tracking_uri_is_the_store_of_every_writer_and_reader_and_a_flag_beats_it(
        tmp_path, tiny_world, fake_training, monkeypatch, capsys):
    from analysis import compare
    from reports import build

    store = tmp_path / "elsewhere"
    env_uri = store_uri(store)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env_uri)
    monkeypatch.chdir(tmp_path)  # ./ablations is the registry; results/, runs/ and a default store would land here
    (tmp_path / "ablations").mkdir()
    tiny_grid(tmp_path / "ablations", tiny_world, "env_grid")
    sweep_file = write_sweep(tmp_path / "ablations", tiny_world, "env_sweep", trials=2)
    # the two runners in this process (each reads the variable when it runs; their workers are processes of their
    # own), training fake (tests/fakes.py: the store the task's config names, as harness.train's); the real
    # trainer's workers are the last runner's, below, in a process of its own
    assert ablate.main(["env_grid", "--variant", VARIANTS[0]]) == 0
    assert sweep.main([str(sweep_file)]) == 0

    assert {r.info.status for r in runs_in(env_uri, "env_grid")} == {"FINISHED"}
    assert len(runs_in(env_uri, "env_grid")) == 1 and len(runs_in(env_uri, "env_sweep")) == 2
    # what a grid and a sweep leave beside their store is what a checkout's .gitignore ignores there
    # (make run's store is ./mlflow.db: `git status` stays clean)
    for path in store.iterdir():
        name = path.name + ("/" if path.is_dir() else "")  # a folder's pattern ends in "/"
        assert subprocess.run(["git", "check-ignore", "--no-index", "-q", name], cwd=REPO).returncode == 0, name
    trials = optuna.load_study(study_name="env_sweep", storage=study_storage(store)).get_trials()
    assert {t.state for t in trials} == {TrialState.COMPLETE}  # the study beside the variable's store

    capsys.readouterr()
    assert build.main([]) == 0
    out = capsys.readouterr().out
    for name in ("env_grid", "env_sweep"):
        assert f"{name}: results/{name}/report.pdf" in out and (tmp_path / "results" / name / "report.pdf").is_file()
    # it reads the variable's store (else: "no such MLflow store", exit 2), finds only figures the reference
    # lacks, says so, and fails: asked to compare, it compared nothing (exit 1, naming the store)
    assert compare.main([]) == 1
    out, err = capsys.readouterr()
    assert "env_grid: not in the reference" in out and "nothing to compare" in err and str(store) in err

    # a runner's --tracking-uri beats the variable, for its runs too (they train in other processes)
    flag = tmp_path / "flag"
    log = tmp_path / "flag.log"
    with started("harness.ablate", ["env_grid", "--variant", VARIANTS[1], "--set", "ppo.steps=2", "--tracking-uri",
                                    store_uri(flag)], tmp_path, log) as proc:
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    (run,) = runs_in(store_uri(flag), "env_grid")
    assert run.info.status == "FINISHED" and run.data.tags[K.TAG_VARIANT] == VARIANTS[1]
    assert run.data.tags["mlflow.parentRunId"] == runs_in(store_uri(flag), "env_grid", "parent")[0].info.run_id
    assert len(runs_in(env_uri, "env_grid")) == 1  # nothing of it in the variable's store

    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("mlflow.db", "optuna.db", "mlruns"))]


# ---------------------------------------------------------------------------- 4. a rerun clears old failures
def test_a_grid_rerun_after_a_dead_worker_leaves_its_parent_finished_without_failure_tags(
        tmp_path, store, tiny_world, fake_training, capsys):
    uri, path, log = store_uri(store), tiny_grid(tmp_path, tiny_world, "flaky_grid"), tmp_path / "runner.log"
    argv = grid_argv(store, path, "--workers", "2", *LONG)
    with started("harness.ablate", argv, REPO, log, command=runner_command("harness.ablate", *argv)) as proc:
        victim = wait_for(lambda: next((r for r in runs_in(uri, "flaky_grid")
                                        if r.data.tags[K.TAG_VARIANT] == VARIANTS[0]
                                        and last_step(uri, r.info.run_id) >= 2), None), proc, "a run past step 2", log)
        os.kill(int(victim.data.tags[K.TAG_PID]), signal.SIGKILL)  # its worker process, as the OOM killer would
        assert proc.wait(timeout=600) == 1, log.read_text()[-3000:]
    (parent,) = runs_in(uri, "flaky_grid", "parent")
    assert parent.info.status == "FAILED" and "worker process died" in parent.data.tags["harness.failed"]

    capsys.readouterr()
    assert ablate.main(argv) == 0
    assert "1 finished earlier, 1 to resume" in capsys.readouterr().out
    (parent,) = runs_in(uri, "flaky_grid", "parent")
    assert parent.info.status == "FINISHED" and parent.data.tags["harness.failed_runs"] == "0"
    assert not {"harness.failed", K.TAG_FAILURE} & set(parent.data.tags)
    c = tracking.client(uri)
    grid = {key: sorted((m.step, m.value) for m in c.get_metric_history(parent.info.run_id, key))
            for key in ("grid/runs", "grid/failed", "grid/collapsed")}
    assert {key: [s for s, _ in p] for key, p in grid.items()} == dict.fromkeys(grid, [0, 1])  # once per invocation
    assert grid["grid/failed"] == [(0, 1), (1, 0)]
    runs = runs_in(uri, "flaky_grid")
    assert {r.info.status for r in runs} == {"FINISHED"} and len(runs) == 2
    for r in runs:
        assert_resumed_like(uri, r.info.run_id, fake_points(r))


def test_a_sweep_rerun_after_a_dead_worker_leaves_its_parent_finished_without_the_failure_reason(
        tmp_path, tiny_world, fake_training):
    path = write_sweep(tmp_path, tiny_world, "flaky_sweep", trials=1, steps=STEPS)
    uri, log = store_uri(tmp_path), tmp_path / "sweep.log"
    argv = [str(path), "--tracking-uri", uri, "--threads", "1"]
    with started("harness.sweep", argv, tmp_path, log, command=runner_command("harness.sweep", *argv)) as proc:
        run = wait_for(lambda: next((r for r in runs_in(uri, "flaky_sweep") if last_step(uri, r.info.run_id) >= 1),
                                    None), proc, "a trial past step 1", log)
        os.kill(int(run.data.tags[K.TAG_PID]), signal.SIGKILL)
        assert proc.wait(timeout=600) == 1, log.read_text()[-3000:]
    (parent,) = runs_in(uri, "flaky_sweep", "parent")
    assert parent.info.status == "FAILED" and "worker process died" in parent.data.tags[K.TAG_FAILURE]

    assert sweep.main(argv) == 0  # makes the trial up
    (parent,) = runs_in(uri, "flaky_sweep", "parent")
    assert parent.info.status == "FINISHED" and K.TAG_FAILURE not in parent.data.tags
    c = tracking.client(uri)
    for key in parent.data.metrics:
        steps = [m.step for m in c.get_metric_history(parent.info.run_id, key)]
        assert len(steps) == len(set(steps)), f"{key}: {steps}"
    study = optuna.load_study(study_name="flaky_sweep", storage=study_storage(tmp_path))
    states = [t.state for t in study.get_trials()]
    assert states == [TrialState.FAIL, TrialState.COMPLETE]  # the interrupted trial, made up


# ---------------------------------------------------------------------------- 5. a grid over two worlds
@pytest.mark.slow
def test_a_grid_over_two_worlds_builds_each_once_and_tags_its_runs(tmp_path, tiny_world, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the worlds' cache, .harness/worlds/, is under the working directory
    worlds = "worlds: [0, 1]\nworld_set:\n" + "".join(f"  {k}: {v}\n" for k, v in MICRO.items())
    path = tiny_grid(tmp_path, tiny_world, "worlds_grid", extra_variant=worlds)
    argv = grid_argv(tmp_path, path, "--variant", VARIANTS[0], "--set", "ppo.steps=4", "--workers", "2")

    assert ablate.main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 runs (1 variants x 1 seeds x 2 worlds)" in out
    assert out.count("(to be built by the runner)") == 2 and "reward-scale-s0-w0" in out and "reward-scale-s0-w1" in out
    assert not (tmp_path / ".harness").exists() and not (tmp_path / "mlflow.db").exists()

    assert ablate.main(argv) == 0
    uri = store_uri(tmp_path)
    built = {r.data.tags[K.TAG_WORLD_SEED]: r for r in runs_in(uri, "world", "world")}
    assert sorted(built) == ["0", "1"] and {r.info.status for r in built.values()} == {"FINISHED"}
    folders = sorted(f for f in (tmp_path / ".harness" / "worlds").iterdir() if not f.name.startswith("."))  # no locks
    assert len(folders) == 2
    runs = {r.data.tags[K.TAG_WORLD_SEED]: r for r in runs_in(uri, "worlds_grid")}
    assert sorted(runs) == ["0", "1"] and {r.info.status for r in runs.values()} == {"FINISHED"}
    for w, r in runs.items():
        assert r.info.run_name.endswith(f"-w{w}")
        world = r.data.tags["provenance.world.hash"]
        assert r.data.params["data.world_dir"].endswith(world) and built[w].data.tags[K.TAG_CONFIG_HASH] == world
    assert runs["0"].data.tags["provenance.world.hash"] != runs["1"].data.tags["provenance.world.hash"]

    stamps = {f: (f / "world.json").stat().st_mtime_ns for f in folders}
    capsys.readouterr()
    assert ablate.main([*argv, "--worlds", "0,1"]) == 0  # the same grid, its worlds named on the command line
    out = capsys.readouterr().out
    assert "2 finished earlier, 0 to resume, 0 to start" in out and "building" not in out
    assert {f: (f / "world.json").stat().st_mtime_ns for f in folders} == stamps  # nothing rebuilt
    assert len(runs_in(uri, "world", "world")) == 2 and len(runs_in(uri, "worlds_grid")) == 2

    # a file whose reference runs on both worlds (reference_worlds): a plain run uses the one world,
    # `python -m reports.rerun` both, from the same cache
    from reports import rerun

    abl = tmp_path / "abl"
    abl.mkdir()
    ref_worlds = "reference_worlds: [0, 1]\nworld_set:\n" + "".join(f"  {k}: {v}\n" for k, v in MICRO.items())
    tiny_grid(abl, tiny_world, "ref_worlds_grid", extra_variant=ref_worlds)
    assert ablate.main([str(abl / "ref_worlds_grid.yaml"), "--dry-run", "--variant", VARIANTS[0]]) == 0
    assert "1 runs (1 variants x 1 seeds)" in capsys.readouterr().out
    ref = tmp_path / "ref"
    assert rerun.main(["--ablations", str(abl), "--store", str(ref), "--only", "ref_worlds_grid", "--no-build",
                       "--workers", "2"]) == 0
    assert "building" not in capsys.readouterr().out  # the worlds cached above
    runs = runs_in(store_uri(ref), "ref_worlds_grid")
    assert sorted(r.data.tags[K.TAG_WORLD_SEED] for r in runs) == ["0", "0", "1", "1"]


# ---------------------------------------------------------------------------- 6. a sweep through submitit
@pytest.mark.slow
def test_a_sweep_runs_its_trial_as_a_submitit_job(tmp_path, tiny_world):
    path = write_sweep(tmp_path, tiny_world, "job_sweep", trials=1)
    uri = store_uri(tmp_path)
    assert sweep.main([str(path), "--tracking-uri", uri, "--threads", "1", "--runs-dir", str(tmp_path / "runs"),
                       "--executor", "submitit-local", "--workers", "1"]) == 0
    (trial,) = optuna.load_study(study_name="job_sweep", storage=study_storage(tmp_path)).get_trials()
    assert trial.state == TrialState.COMPLETE and trial.value is not None
    (run,) = runs_in(uri, "job_sweep")
    assert run.info.status == "FINISHED" and run.data.tags[K.TAG_TRIAL_STATE] == "COMPLETE"
    assert run.data.tags["mlflow.parentRunId"] == runs_in(uri, "job_sweep", "parent")[0].info.run_id
    assert list((tmp_path / "runs" / "job_sweep" / "submitit").glob("*_result.pkl"))  # submitit ran it
    assert int(run.data.tags[K.TAG_PID]) != os.getpid()


# ---------------------------------------------------------------------------- 7. one process per run folder
@pytest.mark.slow
def test_a_second_train_of_a_run_folder_in_training_waits_then_is_refused(tmp_path, tiny_world, monkeypatch, capsys):
    def argv(**extra) -> list[str]:
        return [a for o in fast_overrides(tiny_world, tmp_path, **{"logging.run_name": "held", **extra})
                for a in ("--set", o)]

    run_dir, log, uri = tmp_path / "runs" / "held", tmp_path / "holder.log", store_uri(tmp_path)
    monkeypatch.setattr(harness_train, "RUN_LOCK_WAIT_S", 3.0)
    with started("harness.train", argv(**{"ppo.steps": 500}), tmp_path, log) as holder:
        wait_for(lambda: (run_dir / "run.json").exists(), holder, "the holder's run", log)
        t0 = time.monotonic()
        assert harness_train.main(argv()) == 2
        waited = time.monotonic() - t0
        err = capsys.readouterr().err
        assert f"logging.run_name: {run_dir} is being trained by another process" in err and "held for 3 s" in err
        assert waited >= 3.0
        (run,) = runs_in(uri, "harness")  # no second run, and the holder trains on
        assert run.info.status == "RUNNING" and holder.poll() is None
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    # the lock goes with its holder: the folder can be trained again at once
    assert harness_train.main(argv(**{"ppo.steps": 2})) == 0
    assert [r.info.status for r in runs_in(uri, "harness")] == ["RUNNING", "FINISHED"]


# ---------------------------------------------------------------------------- a resume keeps what was done
@pytest.mark.slow
def test_a_run_resumed_after_it_collapsed_stays_collapsed_and_a_finished_one_stays_finished(tmp_path, tiny_world):
    """A worker stopped by its runner's death (KeyboardInterrupt at a step's end, as the Watchdog does)
    after the run collapsed, then resumed: the outcome, the tag and the checkpoint are the uninterrupted
    run's. A negative collapse margin flags every run whose gold does not rise by 100 (all of them)."""
    def cfg(name: str):
        return load_config(None, fast_overrides(tiny_world, tmp_path, **{
            "ppo.steps": 6, "logging.checkpoint_every": 1, "logging.run_name": name, "collapse.margin": -100,
            "collapse.baseline_steps": 1, "collapse.window": 1, "collapse.confirm": 1}))

    def stop_at_4(step: int, metrics: dict) -> bool:
        if step == 4:
            raise KeyboardInterrupt("the runner of this study is gone")
        return False

    def seen(res) -> tuple:
        ckpt = torch.load(Path(res.run_dir) / "ckpt" / "state.pt", weights_only=True)["step"]
        tag = tracking.client(store_uri(tmp_path)).get_run(res.run_id).data.tags[K.TAG_COLLAPSED]
        return res.status, res.steps_done, res.collapsed, res.collapse_step, tag, ckpt

    whole = harness_train.train(cfg("whole"))
    assert whole.collapsed and whole.collapse_step < 4  # the premise: collapsed before the cut
    with pytest.raises(KeyboardInterrupt):
        harness_train.train(cfg("cut"), on_step=stop_at_4)
    assert seen(harness_train.train(cfg("cut"), resume=True)) == seen(whole)
    assert seen(harness_train.train(cfg("whole"), resume=True)) == seen(whole)  # resuming a finished run: a no-op


def test_a_task_kind_registered_outside_the_test_suite_is_refused():
    """The fake training tasks exist for the tests alone: a runner outside pytest trains and builds worlds."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_VERSION"}
    code = "from harness.study import register_task_kind; register_task_kind('train', print)"
    p = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(REPO)}, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1 and "got a task kind registered outside the test suite" in p.stderr, p.stderr
    with pytest.raises(ValueError, match="task kind: got 'nope'; allowed: train, world"):
        task_kind("nope")
