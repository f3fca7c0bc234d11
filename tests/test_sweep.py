"""Optuna sweeps end to end on the tiny world, with real Optuna (sqlite) and MLflow (sqlite) stores
in tmp_path: a 4-trial delta x eta sweep read back from both stores, continuing it with more trials,
two worker processes without a lost or duplicated trial, a NaN trial recorded as failed (and a
pruned one) while the sweep goes on, and bad sweep files refused before the first trial.

Trials train 2-step runs on the tiny world (seconds each).
"""
import json
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from harness import keys as K
from harness import sweep

REPO = Path(__file__).resolve().parents[1]
PPO_MAX = REPO / "ablations" / "bases" / "ppo_max.yaml"

DELTA_ETA = """\
  reward.clip: {low: 0.1, high: 10.0, log: true}
  ppo.kl_coef: {low: 0.001, high: 0.5, log: true}
"""


def write_sweep(tmp_path: Path, world: Path, name: str, *, space: str = DELTA_ETA, trials: int = 4,
                extra: str = "") -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"""\
name: {name}
base: {PPO_MAX}
set:
  data.world_dir: {world}
  data.eval_prompts: 8
  ppo.rollout_batch_size: 8
  ppo.num_minibatches: 2
  ppo.ppo_epochs: 1
  ppo.critic_pretrain_steps: 0
  generation.max_new_tokens: 8
  logging.eval_every: 0
  logging.sample_every: 0
  logging.checkpoint_every: 0
  logging.output_dir: {tmp_path / 'runs'}
  logging.progress: false
steps: 2
trials: {trials}
sampler: {{name: tpe, seed: 0, n_startup_trials: 2}}
objective: {{last_steps: 2}}
search_space:
{space}{extra}""")
    return p


def uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def storage(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'optuna.db'}"  # the default: next to the MLflow sqlite file


def cli(tmp_path: Path, path: Path, *more: str) -> list[str]:
    return [str(path), "--tracking-uri", uri(tmp_path), "--reports-dir", str(tmp_path / "reports"),
            "--threads", "1", *more]


def load_study(tmp_path: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=storage(tmp_path))


def child_runs(tmp_path: Path, name: str) -> list:
    c = MlflowClient(uri(tmp_path))
    exp = c.get_experiment_by_name(name)
    return list(c.search_runs([exp.experiment_id], f"tags.`{sweep.TAG_SWEEP}` = '{name}' and tags.`{K.TAG_ROLE}` = 'train'"))


def parent_runs(tmp_path: Path, name: str) -> list:
    c = MlflowClient(uri(tmp_path))
    exp = c.get_experiment_by_name(name)
    return list(c.search_runs([exp.experiment_id], f"tags.`{K.TAG_ROLE}` = 'parent'"))


# ---------------------------------------------------------------------------- validation (fast)
def test_unknown_search_space_key_fails_before_the_first_trial(tmp_path, capsys):
    bad = "  ppo.kl_coeff: {low: 0.001, high: 0.5, log: true}\n  reward.clip: {low: 0.1, high: 10.0}\n"
    path = write_sweep(tmp_path, tmp_path, "typo_sweep", space=bad)
    assert sweep.main(cli(tmp_path, path)) == 2
    err = capsys.readouterr().err
    assert "search_space.ppo.kl_coeff: unknown config key; did you mean ppo.kl_coef" in err
    assert not (tmp_path / "optuna.db").exists() and not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "runs").exists()


def test_bad_ranges_and_types_name_field_value_and_allowed(tmp_path):
    bad = """\
  reward.clip: {low: 0.0, high: 10.0}
  ppo.kl_coef: {low: 0.5, high: 0.001}
  ppo.gae_lambda: {low: 0.0, high: 1.0, log: true}
  ppo.ppo_epochs: {low: 1, high: 2.5}
  model.critic_init: {choices: [reward, rm]}
  seed: {low: 0, high: 3}
"""
    path = write_sweep(tmp_path, tmp_path, "bad_sweep", space=bad)
    with pytest.raises(sweep.SweepError) as e:  # sweep-level --set overrides go through the same checks
        sweep.load_sweep(path, ["sweep.objective.metric=objective/gold", "sweep.sampler=tps"])
    msg = str(e.value)
    for expected in [
        "search_space.reward.clip.low: reward.clip: got 0.0; allowed: a number > 0 or null",
        "search_space.ppo.kl_coef: got low=0.5, high=0.001; allowed: low < high",
        "search_space.ppo.gae_lambda.low: got 0 with log: true; allowed: a number > 0 (log scale)",
        "search_space.ppo.ppo_epochs.high: got 2.5; allowed: an integer",
        "search_space.model.critic_init.choices: model.critic_init: got 'rm'; allowed: one of 'reward', 'sft', 'random'",
        "search_space.seed: not searchable",
        "objective.metric: got 'objective/gold'; allowed: auto or a metric key",
        "sampler.name: got 'tps'; allowed: one of tpe, random, grid (did you mean 'tpe'?)",
    ]:
        assert expected in msg, f"missing {expected!r} in:\n{msg}"
    assert not (tmp_path / "optuna.db").exists()


def test_objective_of_a_collapsed_run_is_its_value_at_collapse_minus_the_penalty():
    history = [(s, float(s)) for s in range(1, 21)]  # metric = step
    obj = sweep.ObjectiveSpec(metric=K.GOLD_SCORE, last_steps=4, collapsed="penalty", collapse_penalty=1.0)
    assert sweep.score_run(history, obj, "maximize", None) == (18.5, 18.5)  # mean of steps 17-20
    assert sweep.score_run(history, obj, "maximize", 10) == (8.5 - 1.0, 18.5)  # mean of steps 7-10, minus 1
    assert sweep.score_run(history, obj, "minimize", 10) == (8.5 + 1.0, 18.5)  # worse = higher
    obj.collapsed = "ignore"
    assert sweep.score_run(history, obj, "maximize", 10) == (18.5, 18.5)
    with pytest.raises(sweep.TrialFailed, match="never logged"):
        sweep.score_run([(1, float("nan"))], obj, "maximize", None)


# ---------------------------------------------------------------------------- end to end (tiny world)
@pytest.mark.slow
def test_four_trial_sweep_reads_back_from_both_stores_and_continues(tmp_path, tiny_world, capsys):
    path = write_sweep(tmp_path, tiny_world, "de_sweep", trials=4)
    assert sweep.main(cli(tmp_path, path)) == 0
    out = capsys.readouterr().out
    assert "best trial" in out

    # Optuna: 4 complete trials in the default storage next to mlflow.db
    study = load_study(tmp_path, "de_sweep")
    trials = study.get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert all(t.state == TrialState.COMPLETE and t.user_attrs["outcome"] == "complete" for t in trials)
    assert all(set(t.params) == {"reward.clip", "ppo.kl_coef"} for t in trials)
    assert all(0.1 <= t.params["reward.clip"] <= 10 and 0.001 <= t.params["ppo.kl_coef"] <= 0.5 for t in trials)

    # MLflow: one parent, one child run per trial, tagged and carrying the trial's values
    parents = parent_runs(tmp_path, "de_sweep")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent_id = parents[0].info.run_id
    runs = {int(r.data.tags[K.TAG_TRIAL]): r for r in child_runs(tmp_path, "de_sweep")}
    assert sorted(runs) == [0, 1, 2, 3]
    for t in trials:
        r = runs[t.number]
        assert r.data.tags["mlflow.parentRunId"] == parent_id
        assert r.data.tags[sweep.TAG_TRIAL_STATE] == "COMPLETE"
        assert float(r.data.params["trial.reward.clip"]) == pytest.approx(t.params["reward.clip"])
        assert float(r.data.params["reward.clip"]) == pytest.approx(t.params["reward.clip"])
        assert float(r.data.params["ppo.kl_coef"]) == pytest.approx(t.params["ppo.kl_coef"])
        assert r.data.metrics[sweep.METRIC_OBJECTIVE] == pytest.approx(t.value)
        assert t.user_attrs["mlflow_run_ids"] == [r.info.run_id]
        assert t.intermediate_values  # reported to the pruner from on_step

    # the summary for the report builder, and the artifacts on the parent
    from analysis.sweep_plots import sweep_summary

    s = sweep_summary(path, uri(tmp_path), out_dir=tmp_path / "summary")
    assert set(s) >= {"figures", "table", "best", "importances"}
    assert len(s["table"]) == 4 and s["best"]["number"] in range(4)
    assert s["best"]["value"] == pytest.approx(study.best_value)
    assert all(Path(f).is_file() and f.endswith(".png") for f in s["figures"]) and len(s["figures"]) >= 3
    assert sorted(s["table_full"]["mlflow_run_ids"].map(len)) == [1, 1, 1, 1]
    assert list(s["table"]["number"]) == [0, 1, 2, 3] and "reward.clip" in s["table"].columns
    art = {a.path for a in MlflowClient(uri(tmp_path)).list_artifacts(parent_id, "sweep")}
    assert "sweep/sweep_history.png" in art and "sweep/sweep_pair.png" in art and "sweep/sweep_trials.csv" in art
    assert (tmp_path / "reports" / "de_sweep" / "sweep_best.json").is_file()

    # rerunning with more trials continues the same study (and the same parent run)
    assert sweep.main(cli(tmp_path, path, "--trials", "6", "--no-summary")) == 0
    study = load_study(tmp_path, "de_sweep")
    assert [t.number for t in study.get_trials()] == [0, 1, 2, 3, 4, 5]
    assert [t.params for t in study.get_trials()][:4] == [t.params for t in trials]
    assert sorted(int(r.data.tags[K.TAG_TRIAL]) for r in child_runs(tmp_path, "de_sweep")) == [0, 1, 2, 3, 4, 5]
    assert [p.info.run_id for p in parent_runs(tmp_path, "de_sweep")] == [parent_id]
    # --trials is the total: the same number again runs nothing
    capsys.readouterr()
    assert sweep.main(cli(tmp_path, path, "--trials", "6", "--no-summary")) == 0
    assert "running 0 now" in capsys.readouterr().out
    assert len(load_study(tmp_path, "de_sweep").get_trials()) == 6


@pytest.mark.slow
def test_two_workers_finish_every_trial_once(tmp_path, tiny_world):
    # enqueued first trials: on sqlite both workers could pop the same one (the real sweep did)
    extra = "first_trials:\n  - {reward.clip: 0.8, ppo.kl_coef: 0.05}\n  - {reward.clip: 0.3, ppo.kl_coef: 0.1}\n"
    path = write_sweep(tmp_path, tiny_world, "par_sweep", trials=4, extra=extra)
    assert sweep.main(cli(tmp_path, path, "--workers", "2")) == 0
    trials = load_study(tmp_path, "par_sweep").get_trials()
    assert sorted(t.number for t in trials) == [0, 1, 2, 3]
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert sorted(t.params["reward.clip"] for t in trials[:2]) == [0.3, 0.8]  # each enqueued point ran once
    assert {t.user_attrs["worker"] for t in trials} == {0, 1}  # both processes took trials
    runs = child_runs(tmp_path, "par_sweep")
    assert sorted(int(r.data.tags[K.TAG_TRIAL]) for r in runs) == [0, 1, 2, 3]  # none lost or duplicated
    assert all(r.info.status == "FINISHED" for r in runs)
    assert {r.data.params["threads"] for r in runs} == {"1"}


@pytest.mark.slow
def test_nan_trial_is_recorded_failed_and_the_sweep_goes_on(tmp_path, tiny_world, capsys):
    # trial 0: a learning rate that makes the loss non-finite in the first update -> FAIL;
    # trial 1: a sane one, pruned at its first report by a threshold no run can reach -> PRUNED
    space = DELTA_ETA + "  ppo.policy_lr: {low: 1.0e-6, high: 1.0e+8, log: true}\n"
    extra = ("first_trials:\n  - {ppo.policy_lr: 1.0e+8, reward.clip: 0.8, ppo.kl_coef: 0.05}\n"
             "  - {ppo.policy_lr: 5.0e-5}\n"
             "pruner: {name: threshold, lower: 1.0e+9, n_warmup_steps: 0}\n")
    path = write_sweep(tmp_path, tiny_world, "nan_sweep", space=space, trials=2, extra=extra)
    assert sweep.main(cli(tmp_path, path)) == 0
    assert "FAILED" in capsys.readouterr().out
    failed, pruned = load_study(tmp_path, "nan_sweep").get_trials()
    assert failed.state == TrialState.FAIL and failed.params["ppo.policy_lr"] == 1.0e8
    assert failed.user_attrs["outcome"] == "failed" and failed.user_attrs["failure_reason"]
    assert pruned.state == TrialState.PRUNED and pruned.user_attrs["outcome"] == "pruned"
    assert pruned.user_attrs["pruned_at_step"] == 1
    runs = {int(r.data.tags[K.TAG_TRIAL]): r for r in child_runs(tmp_path, "nan_sweep")}
    assert runs[0].info.status == "FAILED" and runs[0].data.tags[sweep.TAG_TRIAL_STATE] == "FAIL"
    assert K.TAG_FAILURE in runs[0].data.tags
    assert runs[1].data.tags[sweep.TAG_TRIAL_STATE] == "PRUNED" and runs[1].data.tags[K.TAG_STOPPED] == "callback"
    best = json.loads((tmp_path / "reports" / "nan_sweep" / "sweep_best.json").read_text())
    assert best["best"] == {}  # nothing completed; the summary still draws
