"""The ablation runner end to end on the tiny world: child runs by tag under one parent, resume
after a real kill -9 of the whole grid (decided from the MLflow store alone), one runner per grid,
a failing variant that leaves the others finished, the cluster and multi-rank engines, typos
before any run.

Each grid trains 6-step runs on the tiny world (seconds); MLflow stores live in tmp dirs.
"""
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from harness import ablate
from harness import keys as K
from harness import summary as S

from helpers import MICRO, STEPS, VARIANTS, store_uri, study_storage, tiny_grid, write_sweep

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """One MLflow store for the module (creating a sqlite store costs seconds); each test uses its
    own ablation name, so experiments never mix."""
    return tmp_path_factory.mktemp("store")


def args(store: Path, path: Path, *more: str) -> list[str]:
    return [str(path), "--tracking-uri", store_uri(store), "--runs-dir", str(store / "runs"),
            "--threads", "1", "--no-progress", *more]


def runs_of(store: Path, name: str, role: str = "train") -> list:
    c = MlflowClient(store_uri(store))
    exp = c.get_experiment_by_name(name)
    if exp is None:
        return []
    return list(c.search_runs([exp.experiment_id], f"tags.`{K.TAG_ROLE}` = '{role}'"))


def by_variant(runs) -> dict:
    return {r.data.tags[K.TAG_VARIANT]: r for r in runs}


def history(store: Path, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)] in step order, every logged point (perf/ timings left out)."""
    c = MlflowClient(store_uri(store))
    keys = [k for k in c.get_run(run_id).data.metrics if not k.startswith("perf/")]
    return {k: sorted((m.step, m.value) for m in c.get_metric_history(run_id, k)) for k in keys}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, store, tiny_world):
    """The tiny grid run once, uninterrupted, with 2 local workers: (exit code, stdout, path)."""
    import contextlib
    import io

    path = tiny_grid(tmp_path_factory.mktemp("ref"), tiny_world, "tiny_grid")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = ablate.main(args(store, path, "--workers", "2"))
    return code, out.getvalue(), path


def test_two_variant_grid_end_to_end_then_rerun_skips(reference, store, capsys):
    code, out, path = reference
    assert code == 0, out
    assert "all 2 runs finished" in out and "final RM score" in out and "peak RM score" in out
    assert "ETA" in out  # not a terminal: one line per finished run with elapsed time and ETA

    children = runs_of(store, "tiny_grid")
    (parent,) = runs_of(store, "tiny_grid", role="parent")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags[K.TAG_ABLATION] == "tiny_grid" and parent.data.tags[K.TAG_FIGURE] == "6"
    assert sorted(by_variant(children)) == sorted(VARIANTS)
    c = MlflowClient(store_uri(store))
    per_run = pd.read_csv(store / "runs" / "tiny_grid" / "summary_runs.csv")
    for r in children:
        t = r.data.tags
        assert r.info.status == "FINISHED"
        assert t[K.TAG_ABLATION] == "tiny_grid" and t[K.TAG_FIGURE] == "6" and t[K.TAG_SEED] == "0"
        assert t["mlflow.parentRunId"] == parent.info.run_id and t[K.TAG_CONFIG_HASH]
        rm = [m.value for m in sorted(c.get_metric_history(r.info.run_id, K.RM_SCORE), key=lambda m: m.step)]
        assert len(rm) == STEPS
        # the end-of-grid table uses the report's reductions (harness.summary)
        row = per_run[per_run["run_id"] == r.info.run_id].iloc[0]
        assert math.isclose(row["final RM score"], S.reduce_run(rm, "final")) and row["peak RM score"] == max(rm)
    assert list(pd.read_csv(store / "runs" / "tiny_grid" / "summary.csv").columns)[5:] == [h for h, _, _ in S.TRAIN_TABLE]

    # Same command again: everything is finished with the same config, so nothing runs.
    assert ablate.main(args(store, path, "--workers", "2")) == 0
    assert "finished earlier" in capsys.readouterr().out
    assert {r.info.run_id for r in runs_of(store, "tiny_grid")} == {r.info.run_id for r in children}


def test_kill_9_of_the_grid_then_rerun_resumes_under_one_parent(tmp_path, store, tiny_world, reference, capsys):
    path = tiny_grid(tmp_path, tiny_world, "kill_grid")  # the reference grid's configs under another name
    proc = subprocess.Popen([sys.executable, "-m", "harness.ablate", *args(store, path, "--workers", "2")], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    c = MlflowClient(store_uri(store))

    def poll_until(found):
        while not (hit := found()):
            assert proc.poll() is None, "the grid ended before it could be killed"
            time.sleep(0.2)
        return hit

    def past_step_2():  # a run that logged step 2 (so it has a checkpoint at step 1)
        return next((r for r in runs_of(store, "kill_grid")
                     if max((m.step for m in c.get_metric_history(r.info.run_id, K.RM_SCORE)), default=0) >= 2), None)

    try:
        poll_until(lambda: runs_of(store, "kill_grid"))  # a run started: the runner holds the grid
        # a second runner on the same grid is refused while the first holds it
        assert ablate.main(args(store, path, "--workers", "2")) == 3
        assert "another `python -m harness.ablate` is running grid 'kill_grid'" in capsys.readouterr().err
        past = poll_until(past_step_2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and its workers, as a crash of the machine would
        proc.wait()
    assert c.get_run(past.info.run_id).info.status == "RUNNING"  # nobody closed it

    # rerun (seed 0 twice on the command line: still one run per variant x seed)
    assert ablate.main(args(store, path, "--workers", "2", "--seeds", "0,0")) == 0
    assert "listed more than once" in capsys.readouterr().out
    runs = runs_of(store, "kill_grid")
    assert not [r for r in runs if r.info.status == "RUNNING"]
    finished = [r for r in runs if r.info.status == "FINISHED"]
    assert sorted(r.data.tags[K.TAG_VARIANT] for r in finished) == sorted(VARIANTS)  # each run finished once
    # runs killed before their first checkpoint restart as new MLflow runs; the old ones stay KILLED
    assert {r.info.status for r in runs} <= {"FINISHED", "KILLED"}
    # the run past step 2 continued from its checkpoint into the same MLflow run
    assert past.info.run_id in {r.info.run_id for r in finished}
    (parent,) = runs_of(store, "kill_grid", role="parent")  # the dead parent was reopened, not replaced
    assert parent.info.status == "FINISHED"
    assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {parent.info.run_id}

    # resumed metrics equal the uninterrupted reference run's, step by step
    ref = by_variant(runs_of(store, "tiny_grid"))
    duplicated = []
    for r in finished:
        got, want = history(store, r.info.run_id), history(store, ref[r.data.tags[K.TAG_VARIANT]].info.run_id)
        assert set(got) == set(want)
        for k, points in got.items():
            expected = dict(want[k])
            assert [v for s, v in points] == [expected[s] for s, v in points], k
            steps = [s for s, _ in points]
            assert sorted(set(steps)) == sorted(expected), k
            duplicated += [f"{k}@{s}" for s in set(steps) if steps.count(s) > 1]
    assert not duplicated, f"{len(duplicated)} metric points logged twice after resume, e.g. {duplicated[:3]}"


def test_failing_variant_leaves_the_others_finished(tmp_path, store, tiny_world, capsys):
    # an absurd learning rate makes this variant's loss non-finite within a few updates
    diverging = ('  - name: "diverging"\n    set: {ppo.policy_lr: 1.0e+30, ppo.max_grad_norm: 0, ppo.adv_normalize: false, '
                 'ppo.clip_eps: null}\n')
    path = tiny_grid(tmp_path, tiny_world, name="fail_grid", extra_variant=diverging)
    assert ablate.main(args(store, path, "--workers", "0")) == 1
    out = capsys.readouterr().out
    assert "1 run(s) did not finish" in out and "diverging · seed 0: FAILED" in out
    runs = by_variant(runs_of(store, "fail_grid"))
    assert runs[VARIANTS[0]].info.status == "FINISHED" and runs[VARIANTS[1]].info.status == "FINISHED"
    assert runs["diverging"].info.status == "FAILED"
    assert "non-finite" in runs["diverging"].data.tags[K.TAG_FAILURE]
    parent = runs_of(store, "fail_grid", role="parent")[0]
    assert parent.info.status == "FAILED" and parent.data.tags["harness.failed_runs"] == "1"
    assert parent.data.metrics["grid/failed"] == 1 and parent.data.metrics["grid/runs"] == 3
    exp = MlflowClient(store_uri(store)).get_experiment(parent.info.experiment_id)
    assert exp.tags["mlflow.note.content"].startswith("tiny two-variant grid")  # the UI's description


def test_bad_model_path_fails_the_grid_before_any_run(tmp_path, store, tiny_world, capsys):
    broken = '  - name: "broken reward model"\n    set: {model.reward_path: /nonexistent/reward-model}\n'
    path = tiny_grid(tmp_path, tiny_world, name="bad_grid", extra_variant=broken)
    assert ablate.main(args(store, path, "--workers", "0")) == 2
    err = capsys.readouterr().err
    assert "broken reward model: model.reward_path: '/nonexistent/reward-model'" in err
    assert not (store / "mlflow.db").exists() or not runs_of(store, "bad_grid")


def test_cluster_engine_with_a_two_rank_run(tmp_path, store, tiny_world):
    """--executor submitit-local (the Slurm code path without Slurm) and --nproc 2: the run is a
    submitit job that starts a 2-rank torchrun job (gloo on CPU)."""
    path = tiny_grid(tmp_path, tiny_world, "cluster_grid")
    assert ablate.main(args(store, path, "--variant", VARIANTS[0], "--executor", "submitit-local", "--nproc", "2",
                            "--set", "ppo.steps=2")) == 0
    (run,) = runs_of(store, "cluster_grid")
    (parent,) = runs_of(store, "cluster_grid", role="parent")
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    steps = [m.step for m in MlflowClient(store_uri(store)).get_metric_history(run.info.run_id, K.RM_SCORE)]
    assert sorted(steps) == [1, 2]
    assert list((store / "runs" / "cluster_grid" / "submitit").glob("*_result.pkl"))  # submitit ran it
    launch_log = next((store / "runs" / "cluster_grid").glob("*/reward-scale-s0/launch.log")).read_text()
    assert "torch.distributed.run --nproc_per_node=2" in launch_log


def test_typo_in_grid_axis_fails_before_any_run(tmp_path, capsys):
    p = tmp_path / "typo_grid.yaml"
    p.write_text('name: typo_grid\nfigure: "15"\nbase: bases/vanilla.yaml\n'
                 'grid: {name: "η={ppo.kl_cof}", axes: {ppo.kl_cof: [0.05, 0.1]}}\n')
    assert ablate.main(args(tmp_path, p)) == 2
    assert "did you mean ppo.kl_coef" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()


def test_missing_world_fails_before_any_run_with_the_build_command(tmp_path, capsys):
    path = tiny_grid(tmp_path, tmp_path / "no-world-here", name="noworld_grid")
    assert ablate.main(args(tmp_path, path)) == 2
    err = capsys.readouterr().err
    assert "python -m harness.world build --out" in err
    assert not (tmp_path / "mlflow.db").exists()


def test_world_kind_grid_logs_reward_model_training_as_child_runs(tmp_path, store, capsys):
    sets = "\n".join(f"  {k}: {v}" for k, v in MICRO.items())
    p = tmp_path / "tiny_rm.yaml"
    p.write_text(f'name: tiny_rm\nfigure: "3"\nkind: world\nseeds: [0]\nset:\n{sets}\n'
                 f'variants:\n  - name: "reward model"\npanels: [rm_accuracy]\n')
    assert ablate.main(args(store, p, "--workers", "0")) == 0
    (run,) = runs_of(store, "tiny_rm", role="world")
    parent = runs_of(store, "tiny_rm", role="parent")[0]
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert run.data.tags[K.TAG_VARIANT] == "reward model" and run.data.tags[K.TAG_FIGURE] == "3"
    c = MlflowClient(store_uri(store))
    assert c.get_metric_history(run.info.run_id, K.RM_EVAL_ACC)
    assert K.RM_SCORE_DIFF in [a.path for a in c.list_artifacts(run.info.run_id)]
    assert "final RM eval acc" in capsys.readouterr().out


def test_local_engine_a_dying_process_fails_only_its_own_call():
    from concurrent.futures.process import BrokenProcessPool

    from harness.launch import executor

    ex = executor("local", workers=2)
    crash, fine = ex.submit(os.abort), ex.submit(pow, 2, 10)  # os.abort: the process dies on SIGABRT
    ex.shutdown()
    assert isinstance(crash.exception(), BrokenProcessPool) and fine.result() == 1024


def test_local_engine_runs_start_with_every_preloaded_module_imported():
    # the fork server skips a name that fails to import, silently: a typo would cost every run ~1 s
    from harness.launch import PRELOAD, in_own_process

    for name in PRELOAD:
        importlib.import_module(name)
    missing = in_own_process(eval, f"sorted(set({PRELOAD!r}) - set(__import__('sys').modules))")
    assert missing == []


def test_cluster_engine_cancels_its_jobs_on_interrupt(tmp_path):
    from harness.launch import executor

    # as in a runner started in the background (`cmd &`): SIGINT ignored, which child processes inherit
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ex = executor("submitit-local", workers=1, folder=tmp_path / "jobs", timeout_min=5)
        started = tmp_path / "started"
        fut = ex.submit(exec, f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(120)", {})
        # cancelled once it runs, as a Ctrl-C in a grid finds its jobs (submitit's local controller,
        # interrupted while it is still starting its task, can leave that task running unwatched)
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline and not fut.done(), "the job did not start"
            time.sleep(0.05)
        ex.shutdown(cancel=True)  # what the runner does on Ctrl-C: the job would otherwise run on
        assert fut.exception() is not None  # cancelled; a finished sleep returns None
    finally:
        signal.signal(signal.SIGINT, before)


def test_reference_rerun_runs_every_file_resumes_and_builds_the_reference(tmp_path, tiny_world, capsys):
    from reports import rerun

    abl = tmp_path / "ablations"
    abl.mkdir()
    tiny_grid(abl, tiny_world, "tiny_ref")
    write_sweep(abl, tiny_world, "tiny_ref_sweep", trials=2)
    ref, out = tmp_path / "ref", tmp_path / "reports"
    argv = ["--ablations", str(abl), "--store", str(ref), "--out", str(out), "--workers", "2"]
    assert rerun.main(argv) == 0
    assert {r.info.status for r in runs_of(ref, "tiny_ref")} == {"FINISHED"} and len(runs_of(ref, "tiny_ref")) == 2
    assert len(runs_of(ref, "tiny_ref_sweep")) == 2  # its 2 trials
    assert optuna.load_study(study_name="tiny_ref_sweep", storage=study_storage(ref)).trials
    summary = json.loads((out / "reference.json").read_text())
    assert "tiny_ref" in json.dumps(summary) and (out / "README.md").is_file()
    capsys.readouterr()
    assert rerun.main(argv) == 0  # again: every run finished earlier, nothing runs twice
    assert "0 to start" in capsys.readouterr().out and len(runs_of(ref, "tiny_ref")) == 2
    assert rerun.main([*argv, "--only", "nope"]) == 2 and "no such figure file" in capsys.readouterr().err
    (out / "README.md").unlink()
    assert rerun.main([*argv, "--only", "tiny_ref"]) == 0  # some files only: the reference is not rebuilt from them
    assert not (out / "README.md").exists() and "reports not rebuilt (--only)" in capsys.readouterr().out


def test_reference_rerun_runs_the_files_in_the_papers_order_and_the_sweeps_last():
    from harness.registry import registry_files
    from reports import rerun

    files = registry_files(sweeps=True)
    sweeps = set(files) - set(registry_files())
    names = [f.stem for f in rerun.paper_order(files, sweeps)]
    figures = [n for n in names if n not in {s.stem for s in sweeps}]
    assert names[len(figures):] == sorted(s.stem for s in sweeps)  # the sweeps (hours) last
    assert figures[:4] == ["rm_scores", "rm_accuracy", "vanilla", "score_reparam"]  # Figs. 2, 3, 4, 6
    assert figures.index("kl_eta") < figures.index("entropy") < figures.index("apa") < figures.index("study_tricks_best")
