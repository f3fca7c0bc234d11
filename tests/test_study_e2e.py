"""ablations/study_tricks.yaml end to end at a tiny budget (2-step runs on the tiny world): its Sobol
design's first trials run on a world the runner finds built, record the objectives per run (study/* on
the run, the trial's `runs` attr) and give each run its configuration's `otherwise` values; --trials
extends the study without retraining; a kill -9 of the runner ends its run KILLED, and the rerun
resumes that run from its checkpoint and trains no configuration twice; analysis.tricks reads it."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from harness import design, sweep, sweepfile, tracking
from harness import keys as K
from harness.world import TINY, load_world_config, world_config_hash

from helpers import store_uri, study_storage

REPO = Path(__file__).resolve().parents[1]
TINY_RUN = {"data.eval_prompts": 4, "ppo.rollout_batch_size": 8, "ppo.num_minibatches": 2, "ppo.ppo_epochs": 1,
            "generation.max_new_tokens": 8, "logging.eval_every": 0, "logging.sample_every": 0,
            "logging.checkpoint_every": 1, "logging.progress": False}
SHORT_PRETRAIN = "sweep.search_space.ppo.critic_pretrain_steps.choices=[0, 1]"


def study_file(tmp_path: Path, *, steps: int, trials: int, world_dir: Path | None = None) -> Path:
    """The study file, tiny: its runs log into tmp_path; on world_dir (no `worlds`) or on world 0 at TINY scale."""
    data = yaml.safe_load((REPO / "ablations" / "study_tricks.yaml").read_text())
    data["base"] = str(REPO / "ablations" / data["base"])
    data["set"] = {**data["set"], **TINY_RUN, "logging.output_dir": str(tmp_path / "runs")}
    data |= {"steps": steps, "trials": trials}
    if world_dir is not None:
        data.pop("worlds")
        data["set"]["data.world_dir"] = str(world_dir)
    else:
        data |= {"worlds": [0], "world_set": dict(TINY)}
    path = tmp_path / "study_tricks.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def cli(tmp_path: Path, path: Path, *more: str) -> list[str]:
    return [str(path), "--tracking-uri", store_uri(tmp_path), "--threads", "1", "--set", SHORT_PRETRAIN, *more]


def train_runs(tmp_path: Path) -> list:
    c = tracking.client(store_uri(tmp_path))
    exp = c.get_experiment_by_name("study_tricks")
    return list(c.search_runs([exp.experiment_id], f"tags.`{K.TAG_ROLE}` = 'train'")) if exp else []


def trials(tmp_path: Path) -> list:
    return optuna.load_study(study_name="study_tricks", storage=study_storage(tmp_path)).get_trials()


@pytest.mark.slow
def test_a_tiny_study_on_its_world_records_objectives_and_extends_without_retraining(tmp_path, tiny_world,
                                                                                      monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # .harness/worlds/ and results/ are relative to it
    world = Path(".harness/worlds") / world_config_hash(load_world_config(overrides={**TINY, "seed": 0}))
    shutil.copytree(tiny_world, world)  # world 0 at the TINY scale is the tiny world: built already
    path = study_file(tmp_path, steps=2, trials=3)
    spec = sweepfile.load_sweep(path, [SHORT_PRETRAIN], store_uri(tmp_path))
    assert sweep.main(cli(tmp_path, path)) == 0
    assert f"world 0 ({world.name}, {world})" in capsys.readouterr().out  # found built, not built again

    done = trials(tmp_path)
    assert [t.state for t in done] == [TrialState.COMPLETE] * 3 and [t.params for t in done] == spec.design[:3]
    runs = {r.info.run_id: r for r in train_runs(tmp_path)}
    assert len(runs) == 3
    for t in done:
        (rec,) = t.user_attrs["runs"]
        r = runs[rec["run_id"]]
        assert rec["world"] == 0 and r.data.tags[K.TAG_WORLD_SEED] == "0" and r.info.run_name.endswith("-s0-w0")
        assert r.data.tags[K.TAG_CONFIG_HASH] in r.info.run_name
        for o in spec.objectives:  # recorded on the run and in the trial, the same number
            assert r.data.metrics[f"{K.STUDY_PREFIX}{o.name}"] == pytest.approx(rec[o.name])
        assert rec["collapsed"] in (0.0, 1.0) and rec["final_kl"] == rec["final_kl"]
        assert {k.removeprefix("trial.") for k in r.data.params if k.startswith("trial.")} == set(t.params)
        clip = r.data.params["reward.clip"]  # drawn only under reward normalization; `otherwise` null elsewhere
        assert clip == (design.label(t.params["reward.clip"]) if t.params["reward"] == "normalize" else "null")
        assert r.data.params["data.world_dir"] == str(world)

    # --trials is the total: one more trial, the first three neither redrawn nor retrained
    assert sweep.main(cli(tmp_path, path, "--trials", "4")) == 0
    more = trials(tmp_path)
    longer = sweepfile.load_sweep(path, [SHORT_PRETRAIN, "sweep.trials=4"], store_uri(tmp_path)).design
    assert longer[:3] == spec.design and [t.params for t in more] == longer
    again = {r.info.run_id: r for r in train_runs(tmp_path)}
    assert len(again) == 4 and all(again[i].info.end_time == r.info.end_time for i, r in runs.items())

    from analysis.tricks import analyse, load_study

    s = analyse(load_study("study_tricks", store_uri(tmp_path)), B=20, B_importance=20, claims=False, figures=False)
    assert s["configs"] == 4 and set(s["values"]["choice"]) == set(spec.space)
    assert (tmp_path / "results" / "study_tricks" / "tricks.json").is_file()


def started_steps(tmp_path: Path, run) -> int:
    return len(tracking.metric_history(store_uri(tmp_path), run.info.run_id, K.RM_SCORE))


@pytest.mark.slow
def test_kill_9_of_the_runner_resumes_its_run_and_trains_no_configuration_twice(tmp_path, tiny_world, capsys):
    steps = 40  # long enough for the kill to land inside a run (polled every 0.3 s, a step ~0.1 s)
    path = study_file(tmp_path, steps=steps, trials=2, world_dir=tiny_world)
    spec = sweepfile.load_sweep(path, [SHORT_PRETRAIN], store_uri(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "harness.sweep", *cli(tmp_path, path)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim, t0 = None, time.time()
    while victim is None and proc.poll() is None and time.time() - t0 < 600:
        time.sleep(0.3)
        try:  # a trial finished, the next one's run a few steps in
            runs = train_runs(tmp_path)
            done = [r for r in runs if r.info.status == "FINISHED"]
            victim = next((r for r in runs if r.info.status == "RUNNING" and started_steps(tmp_path, r) >= 3), None) \
                if done else None
        except Exception:  # the stores are being created
            continue
    assert victim is not None, proc.communicate()[0]
    finished = {r.info.run_id: r.info.end_time for r in train_runs(tmp_path) if r.info.status == "FINISHED"}
    os.kill(proc.pid, signal.SIGKILL)  # the runner alone: its worker sees it gone and ends the run KILLED
    proc.communicate(timeout=120)  # the pipe closes once the worker, and with it the process server, has gone too
    while tracking.client(store_uri(tmp_path)).get_run(victim.info.run_id).info.status == "RUNNING":
        assert time.time() - t0 < 900, "the worker did not end its run after the runner died"
        time.sleep(0.5)
    assert tracking.client(store_uri(tmp_path)).get_run(victim.info.run_id).info.status == "KILLED"
    killed_at = started_steps(tmp_path, victim)
    assert 3 <= killed_at < steps

    assert sweep.main(cli(tmp_path, path)) == 0
    out = capsys.readouterr().out
    assert "of a runner that died: made up" in out and "resume from its last checkpoint" in out
    study = trials(tmp_path)
    complete = [t for t in study if t.state == TrialState.COMPLETE]
    assert len(complete) == 2 and sorted(map(str, (t.params for t in complete))) == sorted(map(str, spec.design[:2]))
    (lost,) = [t for t in study if t.state == TrialState.FAIL]
    made_up = next(t for t in complete if t.user_attrs.get("retry_of") == lost.number)
    assert made_up.params == lost.params and made_up.user_attrs["mlflow_run_ids"] == [victim.info.run_id]
    runs = train_runs(tmp_path)  # one run per configuration: none trained twice, the killed one continued
    assert len(runs) == 2 and len({r.data.tags[K.TAG_CONFIG_HASH] for r in runs}) == 2
    assert all(r.info.status == "FINISHED" for r in runs)
    assert all(r.info.end_time == finished[r.info.run_id] for r in runs if r.info.run_id in finished)
    resumed = tracking.client(store_uri(tmp_path)).get_run(victim.info.run_id)
    assert resumed.data.tags[K.TAG_PID] != victim.data.tags[K.TAG_PID]  # another process continued the same run
    logged = [s for s, _ in tracking.metric_history(store_uri(tmp_path), victim.info.run_id, K.RM_SCORE)]
    assert sorted(logged) == list(range(1, steps + 1))  # every step once
