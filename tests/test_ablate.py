"""The ablation runner end to end on the tiny world: child runs by tag, resume after a kill without
redoing finished runs, a failing variant that leaves the others finished, typos before any run.

Each grid trains 3-step runs on the tiny world (seconds); MLflow stores live in tmp_path.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from harness import ablate
from harness import keys as K

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

KILL_VARIANT = "reward normalize, δ=0.8"


def tiny_grid(tmp_path: Path, world: Path, name: str = "tiny_grid", extra_variant: str = "") -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"""
name: {name}
figure: "6"
title: tiny two-variant grid
base: bases/vanilla.yaml
set:
  data.world_dir: {world}
  data.eval_prompts: 8
  ppo.steps: 3
  ppo.rollout_batch_size: 8
  ppo.num_minibatches: 2
  ppo.ppo_epochs: 1
  generation.max_new_tokens: 8
  logging.eval_every: 2
  logging.sample_every: 0
  logging.checkpoint_every: 1
seeds: [0]
variants:
  - name: "reward scale"
    set: {{reward.scale: true}}
  - name: "{KILL_VARIANT}"
    set: {{reward.normalize: true, reward.clip: 0.8}}
{extra_variant}
""")
    return p


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """One MLflow store for the module (creating a sqlite store costs seconds); each test uses its
    own ablation name, so experiments never mix."""
    return tmp_path_factory.mktemp("store")


def args(store: Path, path: Path, *more: str) -> list[str]:
    return [str(path), "--tracking-uri", uri(store), "--runs-dir", str(store / "runs"),
            "--threads", "1", "--no-progress", *more]


def uri(store: Path) -> str:
    return f"sqlite:///{store / 'mlflow.db'}"


def runs_of(store: Path, name: str, role: str = "train") -> list:
    c = MlflowClient(uri(store))
    exp = c.get_experiment_by_name(name)
    if exp is None:
        return []
    return list(c.search_runs([exp.experiment_id], f"tags.`{K.TAG_ROLE}` = '{role}'"))


def by_variant(runs) -> dict:
    return {r.data.tags[K.TAG_VARIANT]: r for r in runs}


def test_two_variant_grid_end_to_end_then_rerun_skips(tmp_path, store, tiny_world, capsys):
    path = tiny_grid(tmp_path, tiny_world)
    assert ablate.main(args(store, path, "--workers", "2")) == 0
    out = capsys.readouterr().out
    assert "all 2 runs finished" in out and "rm_score final" in out

    children = runs_of(store, "tiny_grid")
    parents = runs_of(store, "tiny_grid", role="parent")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.tags[K.TAG_ABLATION] == "tiny_grid" and parents[0].data.tags[K.TAG_FIGURE] == "6"
    assert sorted(by_variant(children)) == sorted(["reward scale", KILL_VARIANT])
    c = MlflowClient(uri(store))
    for r in children:
        t = r.data.tags
        assert r.info.status == "FINISHED"
        assert t[K.TAG_ABLATION] == "tiny_grid" and t[K.TAG_FIGURE] == "6" and t[K.TAG_SEED] == "0"
        assert t["mlflow.parentRunId"] == parents[0].info.run_id and t[K.TAG_CONFIG_HASH]
        assert [m.step for m in c.get_metric_history(r.info.run_id, K.RM_SCORE)] == [1, 2, 3]
    assert (store / "runs" / "tiny_grid" / "summary.csv").is_file()

    # Same command again: everything is finished with the same config, so nothing runs.
    assert ablate.main(args(store, path, "--workers", "2")) == 0
    assert "finished earlier" in capsys.readouterr().out
    assert {r.info.run_id for r in runs_of(store, "tiny_grid")} == {r.info.run_id for r in children}


def test_killed_runner_resumes_without_redoing_finished_runs(tmp_path, store, tiny_world):
    path = tiny_grid(tmp_path, tiny_world, name="kill_grid")
    env = {**os.environ, ablate.TEST_KILL_ENV: f"{KILL_VARIANT}|0|2"}
    proc = subprocess.run([sys.executable, "-m", "harness.ablate", *args(store, path, "--workers", "1")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stdout + proc.stderr  # the hook SIGKILLed the runner mid-grid

    before = by_variant(runs_of(store, "kill_grid"))
    assert before["reward scale"].info.status == "FINISHED"
    assert before[KILL_VARIANT].info.status == "RUNNING"  # killed: nobody closed it

    # rerun in this process (the worker path ran above): same command otherwise
    assert ablate.main(args(store, path, "--workers", "0")) == 0
    after = by_variant(runs_of(store, "kill_grid"))
    assert len(runs_of(store, "kill_grid")) == 2
    done, resumed = after["reward scale"], after[KILL_VARIANT]
    assert (done.info.run_id, done.info.start_time, done.info.end_time) == (
        before["reward scale"].info.run_id, before["reward scale"].info.start_time, before["reward scale"].info.end_time)
    # the killed run continued from its checkpoint into the same MLflow run
    assert resumed.info.run_id == before[KILL_VARIANT].info.run_id and resumed.info.status == "FINISHED"
    steps = [m.step for m in MlflowClient(uri(store)).get_metric_history(resumed.info.run_id, K.RM_SCORE)]
    assert max(steps) == 3
    # the first invocation's parent run is closed as KILLED (its process is gone)
    statuses = sorted(r.info.status for r in runs_of(store, "kill_grid", role="parent"))
    assert statuses == ["FINISHED", "KILLED"]


def test_failing_variant_leaves_the_others_finished(tmp_path, store, tiny_world, capsys):
    broken = '  - name: "broken reward model"\n    set: {model.reward_path: /nonexistent/reward-model}\n'
    path = tiny_grid(tmp_path, tiny_world, name="fail_grid", extra_variant=broken)
    assert ablate.main(args(store, path, "--workers", "0")) == 1
    out = capsys.readouterr().out
    assert "1 run(s) did not finish" in out and "broken reward model · seed 0: FAILED" in out
    runs = by_variant(runs_of(store, "fail_grid"))
    assert runs["reward scale"].info.status == "FINISHED" and runs[KILL_VARIANT].info.status == "FINISHED"
    assert runs["broken reward model"].info.status == "FAILED"
    assert "/nonexistent/reward-model" in runs["broken reward model"].data.tags[K.TAG_FAILURE]
    parent = runs_of(store, "fail_grid", role="parent")[0]
    assert parent.info.status == "FAILED" and parent.data.tags["harness.failed_runs"] == "1"


def test_typo_in_grid_axis_fails_before_any_run(tmp_path, capsys):
    p = tmp_path / "typo_grid.yaml"
    p.write_text('name: typo_grid\nfigure: "15"\nbase: bases/vanilla.yaml\n'
                 'grid: {name: "η={ppo.kl_cof}", axes: {ppo.kl_cof: [0.05, 0.1]}}\n')
    assert ablate.main(args(tmp_path, p)) == 2
    assert "did you mean 'ppo.kl_coef'" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()


def test_missing_world_fails_before_any_run_with_the_build_command(tmp_path, capsys):
    path = tiny_grid(tmp_path, tmp_path / "no-world-here", name="noworld_grid")
    assert ablate.main(args(tmp_path, path)) == 2
    err = capsys.readouterr().err
    assert "python -m harness.world build --out" in err
    assert not (tmp_path / "mlflow.db").exists()


def test_world_kind_grid_logs_reward_model_training_as_child_runs(tmp_path, store, capsys):
    from harness.world import TINY

    sets = "\n".join(f"  {k}: {v}" for k, v in TINY.items())
    p = tmp_path / "tiny_rm.yaml"
    p.write_text(f'name: tiny_rm\nfigure: "3"\nkind: world\nseeds: [0]\nset:\n{sets}\n'
                 f'variants:\n  - name: "reward model"\npanels: [rm_accuracy]\n')
    assert ablate.main(args(store, p, "--workers", "0")) == 0
    (run,) = runs_of(store, "tiny_rm", role="world")
    parent = runs_of(store, "tiny_rm", role="parent")[0]
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert run.data.tags[K.TAG_VARIANT] == "reward model" and run.data.tags[K.TAG_FIGURE] == "3"
    c = MlflowClient(uri(store))
    assert c.get_metric_history(run.info.run_id, K.RM_EVAL_ACC)
    assert K.RM_SCORE_DIFF in [a.path for a in c.list_artifacts(run.info.run_id)]
    assert "rm_eval_acc final" in capsys.readouterr().out
