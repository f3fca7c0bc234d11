"""Optuna sweeps end to end on the tiny world, with real Optuna (sqlite) and MLflow (sqlite) stores
in tmp_path: a 4-trial delta x eta sweep read back from both stores and continued; two worker
processes without a lost or duplicated trial; a NaN trial recorded as failed (and a pruned one);
a worker process killed for real (its training faked: tests/fakes.py), whose trial the next run makes up;
passwords in the URLs never written anywhere; bad sweep files refused
before the first trial.

Trials train 2-step runs on the tiny world (seconds each).
"""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import URL

from harness import design, sweep, sweepfile, sweepstore, tracking, trials
from harness import keys as K
from harness.schema import ConfigError

from fakes import runner_command
from helpers import DELTA_ETA, store_uri, study_storage, write_sweep

REPO = Path(__file__).resolve().parents[1]


def cli(tmp_path: Path, path: Path, *more: str) -> list[str]:
    return [str(path), "--tracking-uri", store_uri(tmp_path), "--threads", "1", *more]


def subprocess_sweep(tmp_path: Path, path: Path, *more: str) -> subprocess.Popen:
    """`python -m harness.sweep` in a process of its own, its training tasks fake (tests/fakes.py)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(runner_command("harness.sweep", *cli(tmp_path, path, *more)), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class PasswordSQLite(SQLiteDialect_pysqlite):
    """pysqlite that accepts (and drops) a user and password in the URL: a real store whose URL
    carries a password, as a PostgreSQL storage or an authenticated MLflow server would."""

    supports_statement_cache = True

    def create_connect_args(self, url):
        return super().create_connect_args(URL.create("sqlite", database=url.database, query=url.query))


registry.register("sqlite.pw", __name__, "PasswordSQLite")


def load_study(tmp_path: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=study_storage(tmp_path))


def runs(tracking_uri: str, name: str, role: str = "train") -> list:
    c = tracking.client(tracking_uri)  # creates a new store under the lock the sweep processes take
    exp = c.get_experiment_by_name(name)
    return list(c.search_runs([exp.experiment_id], f"tags.`{K.TAG_ROLE}` = '{role}'"))


def running_trial(tmp_path: Path, name: str) -> optuna.trial.FrozenTrial | None:
    """The first RUNNING trial whose MLflow run has started, or None yet."""
    try:
        study = load_study(tmp_path, name)
        started = {r.data.tags[K.TAG_TRIAL] for r in runs(store_uri(tmp_path), name)  # its worker's pid written too
                   if r.info.status == "RUNNING" and K.TAG_PID in r.data.tags}
    except Exception:  # the stores, the study or the experiment do not exist yet
        return None
    return next((t for t in study.get_trials(states=(TrialState.RUNNING,)) if str(t.number) in started), None)


# ---------------------------------------------------------------------------- validation (fast)
def test_unknown_search_space_key_fails_before_the_first_trial(tmp_path, capsys):
    bad = "  ppo.kl_coeff: {low: 0.001, high: 0.5, log: true}\n  reward.clip: {low: 0.1, high: 10.0}\n"
    path = write_sweep(tmp_path, tmp_path, "typo_sweep", space=bad)
    assert sweep.main(cli(tmp_path, path)) == 2
    err = capsys.readouterr().err
    assert f"{path}: search_space.ppo.kl_coeff: not a TrainConfig key; did you mean ppo.kl_coef?" in err
    assert not (tmp_path / "optuna.db").exists() and not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "runs").exists()


def test_bad_sweep_files_name_file_field_value_and_allowed(tmp_path):
    bad = """\
  reward.clip: {low: 0.0, high: 10.0}
  ppo.ppo_epochs: {low: 1, high: 2.5}
  model.critic_init: {choices: [reward, rm]}
  seed: {low: 0, high: 3}
"""
    path = write_sweep(tmp_path, tmp_path, "bad_sweep", space=bad, extra="first_trials: [{ppo.kl_coef: 0.1}]\n")
    with pytest.raises(ConfigError) as e:  # sweep-level --set overrides go through the same checks
        sweepfile.load_sweep(path, ["sweep.objective.metric=objective/gold"])
    msg = str(e.value)
    for expected in [
        "search_space.reward.clip.low: reward.clip: got 0.0; allowed: a number > 0",
        "search_space.ppo.ppo_epochs.high: got 2.5; allowed: an integer",
        "search_space.model.critic_init.choices: model.critic_init: got 'rm'; allowed: one of 'reward', 'sft', 'random'",
        "search_space.seed: not searchable",
        "objective.metric: got 'objective/gold'; allowed: auto or a metric key",
        "first_trials.0.ppo.kl_coef: not a search-space key",
    ]:
        assert f"{path}: {expected}" in msg, f"missing {expected!r} in:\n{msg}"

    # structural problems come from the schema sections, one line each with a did-you-mean
    bad = "  ppo.kl_coef: {low: 0.5, high: 0.001, lg: true}\n  ppo.gae_lambda: {low: 0.0, high: 1.0, log: true}\n"
    path = write_sweep(tmp_path, tmp_path, "../escape", space=bad, extra="pruner: {name: threshold}\n")
    with pytest.raises(ConfigError) as e:
        sweepfile.load_sweep(path, ["sweep.sampler=tps"])
    msg = str(e.value)
    for expected in [
        "name: got '../escape'; allowed: a string matching",  # a folder name: one safe path component
        "search_space.ppo.kl_coef.lg: unknown key; did you mean search_space.ppo.kl_coef.log?",
        "search_space.ppo.gae_lambda: got {'low': 0.0, 'high': 1.0, 'log': True}; allowed: low > 0 with log: true",
        "sampler.name: got 'tps'; allowed: one of 'tpe', 'random', 'grid', 'sobol' (did you mean 'tpe'?)",
        "pruner: got {'name': 'threshold'}; allowed: name threshold with `lower` or `upper`",
    ]:
        assert f"{path}: {expected}" in msg, f"missing {expected!r} in:\n{msg}"
    assert not (tmp_path / "optuna.db").exists()


def test_help_documents_the_file_format_from_the_sections(capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--help"])
    out = capsys.readouterr().out
    for line in ["objective.collapsed = \"penalty\"   (one of 'penalty', 'worst', 'ignore')",
                 "[search_space.<TrainConfig key>]", "Sample on a log scale (needs low > 0)."]:
        assert line in out


def test_objective_of_a_collapsed_run_is_its_value_at_collapse_minus_the_penalty():
    history = [(s, float(s)) for s in range(1, 21)]  # metric = step
    obj = sweepfile.Objective(metric=K.GOLD_SCORE, last_steps=4, collapsed="penalty", collapse_penalty=1.0)
    assert trials.score_run(history, obj, "maximize", None) == (18.5, 18.5)  # mean of steps 17-20
    assert trials.score_run(history, obj, "maximize", 10) == (8.5 - 1.0, 18.5)  # mean of steps 7-10, minus 1
    assert trials.score_run(history, obj, "minimize", 10) == (8.5 + 1.0, 18.5)  # worse = higher
    obj.collapsed = "ignore"
    assert trials.score_run(history, obj, "maximize", 10) == (18.5, 18.5)
    with pytest.raises(trials.TrialFailed, match="never logged"):
        trials.score_run([(1, float("nan"))], obj, "maximize", None)


def test_urls_are_masked():
    assert tracking.redact("postgresql://user:s3cret@db:5432/optuna") == "postgresql://user:***@db:5432/optuna"
    assert tracking.redact("http://me:p%40ss@mlflow:5000") == "http://me:***@mlflow:5000"
    assert tracking.redact("sqlite:////tmp/optuna.db") == "sqlite:////tmp/optuna.db"


def test_plots_cli_masks_the_storage_password_in_its_errors(tmp_path, capsys):
    from analysis import sweep_plots

    store = f"sqlite+pw://me:s3cret@/{tmp_path / 'optuna.db'}"
    assert sweep_plots.main(["nope", "--tracking-uri", store_uri(tmp_path), "--storage", store]) == 2
    err = capsys.readouterr().err
    assert "no Optuna study named 'nope' in sqlite+pw://me:***@/" in err and "s3cret" not in err


# ---------------------------------------------------------------------------- end to end (tiny world)
@pytest.mark.slow
def test_four_trial_sweep_reads_back_from_both_stores_and_continues(tmp_path, tiny_world, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # results/<name>/ of the plots CLI
    path = write_sweep(tmp_path, tiny_world, "de_sweep", trials=4)
    assert sweep.main(cli(tmp_path, path)) == 0
    out = capsys.readouterr().out
    assert "best trial" in out and f"python -m analysis.sweep_plots de_sweep --tracking-uri {store_uri(tmp_path)}" in out

    # Optuna: 4 complete trials in the default storage next to mlflow.db
    study = load_study(tmp_path, "de_sweep")
    trials = study.get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert all(t.state == TrialState.COMPLETE and t.user_attrs["outcome"] == "complete" for t in trials)
    assert all(0.1 <= t.params["reward.clip"] <= 10 and 0.001 <= t.params["ppo.kl_coef"] <= 0.5 for t in trials)

    # MLflow: one parent, one child run per trial, tagged and carrying the trial's values
    parents = runs(store_uri(tmp_path), "de_sweep", "parent")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent_id = parents[0].info.run_id
    assert parents[0].data.metrics[K.SWEEP_OBJECTIVE] == pytest.approx(study.best_value)
    children = {int(r.data.tags[K.TAG_TRIAL]): r for r in runs(store_uri(tmp_path), "de_sweep")}
    assert sorted(children) == [0, 1, 2, 3]
    for t in trials:
        r = children[t.number]
        assert r.data.tags["mlflow.parentRunId"] == parent_id
        assert r.data.tags[K.TAG_TRIAL_STATE] == "COMPLETE"
        assert float(r.data.params["trial.reward.clip"]) == pytest.approx(t.params["reward.clip"])
        assert float(r.data.params["reward.clip"]) == pytest.approx(t.params["reward.clip"])
        assert float(r.data.params["ppo.kl_coef"]) == pytest.approx(t.params["ppo.kl_coef"])
        assert r.data.metrics[K.SWEEP_OBJECTIVE] == pytest.approx(t.value)
        assert t.user_attrs["mlflow_run_ids"] == [r.info.run_id]
        assert t.intermediate_values  # reported to the pruner from on_step

    # the plots: the CLI by name (logging them to the parent run) and the summary for reports
    from analysis import sweep_plots

    assert sweep_plots.main(["de_sweep", "--tracking-uri", store_uri(tmp_path)]) == 0
    art = {a.path for a in MlflowClient(store_uri(tmp_path)).list_artifacts(parent_id, "sweep")}
    assert {"sweep/sweep_history.png", "sweep/sweep_pair.png", "sweep/sweep_trials.csv"} <= art
    assert json.loads((tmp_path / "results" / "de_sweep" / "sweep_best.json").read_text())["best"]["number"] in range(4)
    s = sweep_plots.sweep_summary(path, store_uri(tmp_path), out_dir=tmp_path / "summary")
    assert len(s["table"]) == 4 and s["best"]["value"] == pytest.approx(study.best_value)
    assert all(Path(f).is_file() and f.endswith(".png") for f in s["figures"]) and len(s["figures"]) >= 3
    assert sorted(s["table_full"]["mlflow_run_ids"].map(len)) == [1, 1, 1, 1]
    assert list(s["table"]["number"]) == [0, 1, 2, 3] and "reward.clip" in s["table"].columns

    # rerunning with more trials continues the same study (and the same parent run)
    assert sweep.main(cli(tmp_path, path, "--trials", "6")) == 0
    study = load_study(tmp_path, "de_sweep")
    assert [t.number for t in study.get_trials()] == [0, 1, 2, 3, 4, 5]
    assert [t.params for t in study.get_trials()][:4] == [t.params for t in trials]
    assert sorted(int(r.data.tags[K.TAG_TRIAL]) for r in runs(store_uri(tmp_path), "de_sweep")) == [0, 1, 2, 3, 4, 5]
    assert [p.info.run_id for p in runs(store_uri(tmp_path), "de_sweep", "parent")] == [parent_id]
    # --trials is the total: the same number again runs nothing
    capsys.readouterr()
    assert sweep.main(cli(tmp_path, path, "--trials", "6")) == 0
    assert "running 0 now" in capsys.readouterr().out
    assert len(load_study(tmp_path, "de_sweep").get_trials()) == 6


def test_choices_added_to_a_sobol_study_keep_its_trials_draws_and_extend_it(tmp_path, tiny_world, capsys, fake_training):
    """A Sobol study run, then a choice added to its file (sampler.added) and the study extended: the first
    trials keep their values and ran without the new choice; the next draw the first design's points for the
    old choices, and the new one."""
    old = "  reward.clip: [0.3, 0.8]\n  ppo.kl_coef: [0.0, 0.05, 0.1]\n"
    path = write_sweep(tmp_path, tiny_world, "added_sweep", space=old, trials=2)
    path.write_text(path.read_text().replace("sampler: {name: tpe, seed: 0, n_startup_trials: 2}",
                                             "sampler: {name: sobol, seed: 0}"))
    first = sweepfile.load_sweep(path)
    assert sweep.main(cli(tmp_path, path, "--workers", "0")) == 0  # in this process: the test is about the draws
    before = [t.params for t in load_study(tmp_path, "added_sweep").get_trials()]
    path.write_text(path.read_text().replace("sampler: {name: sobol, seed: 0}",
                                             "sampler: {name: sobol, seed: 0, added: [ppo.entropy_coef]}")
                    + "  ppo.entropy_coef: [0.0, 0.01]\n")
    capsys.readouterr()
    assert sweep.main(cli(tmp_path, path, "--trials", "4", "--workers", "0")) == 0
    out = capsys.readouterr().out
    assert "choices added to the study (sampler.added): ppo.entropy_coef; its earlier trials keep their draws" in out
    assert "warning" not in out
    after = [t.params for t in load_study(tmp_path, "added_sweep").get_trials()]
    assert after[:2] == before and all("ppo.entropy_coef" not in p for p in before)
    planned = design.simulate(first.space, lambda: sweepfile.make_sampler(first), 4)  # the first file's design
    assert [{k: p[k] for k in ("reward.clip", "ppo.kl_coef")} for p in after[2:]] == planned[2:]
    assert all("ppo.entropy_coef" in p for p in after[2:])


@pytest.mark.slow
def test_two_workers_finish_every_trial_once(tmp_path, tiny_world):
    # enqueued first trials: on sqlite both workers could pop the same one without BEGIN IMMEDIATE
    extra = "first_trials:\n  - {reward.clip: 0.8, ppo.kl_coef: 0.05}\n  - {reward.clip: 0.3, ppo.kl_coef: 0.1}\n"
    path = write_sweep(tmp_path, tiny_world, "par_sweep", trials=4, extra=extra)
    assert sweep.main(cli(tmp_path, path, "--workers", "2")) == 0
    trials = load_study(tmp_path, "par_sweep").get_trials()
    assert sorted(t.number for t in trials) == [0, 1, 2, 3]
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert sorted(t.params["reward.clip"] for t in trials[:2]) == [0.3, 0.8]  # each enqueued point ran once
    children = runs(store_uri(tmp_path), "par_sweep")
    assert len({r.data.tags[K.TAG_PID] for r in children}) >= 2  # both worker processes took trials
    assert sorted(int(r.data.tags[K.TAG_TRIAL]) for r in children) == [0, 1, 2, 3]  # none lost or duplicated
    assert all(r.info.status == "FINISHED" for r in children)
    assert {r.data.params["threads"] for r in children} == {"1"}


def test_a_sweep_without_an_output_dir_runs_into_the_default_runs_folder(tmp_path, tiny_world, monkeypatch):
    # the task's config then holds no logging.output_dir of its own (a fresh start clears the run folder there)
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, tiny_world, "dflt_sweep", trials=1, output_dir=False)
    assert sweep.main(cli(tmp_path, path)) == 0
    assert [t.state for t in load_study(tmp_path, "dflt_sweep").get_trials()] == [TrialState.COMPLETE]
    (child,) = runs(store_uri(tmp_path), "dflt_sweep")
    assert (tmp_path / "runs" / child.info.run_name).is_dir()


@pytest.mark.slow
def test_nan_trial_is_recorded_failed_and_the_sweep_goes_on(tmp_path, tiny_world, capsys):
    # trial 0: a learning rate that makes the loss non-finite in the first update -> FAIL;
    # trial 1: a sane one, pruned at its first report by a threshold no run can reach -> PRUNED: the
    # runner reads its objective from the store while it trains and stops it (a STOP file) long before
    # its 200 steps
    space = DELTA_ETA + "  ppo.policy_lr: {low: 1.0e-6, high: 1.0e+8, log: true}\n"
    extra = ("first_trials:\n  - {ppo.policy_lr: 1.0e+8, reward.clip: 0.8, ppo.kl_coef: 0.05}\n"
             "  - {ppo.policy_lr: 5.0e-5}\n"
             "pruner: {name: threshold, lower: 1.0e+9, n_warmup_steps: 0}\n")
    path = write_sweep(tmp_path, tiny_world, "nan_sweep", space=space, trials=2, extra=extra, steps=200)
    assert sweep.main(cli(tmp_path, path)) == 0
    out = capsys.readouterr().out
    assert "FAILED" in out and "no completed trial yet" in out
    failed, pruned = load_study(tmp_path, "nan_sweep").get_trials()
    assert failed.state == TrialState.FAIL and failed.params["ppo.policy_lr"] == 1.0e8
    assert failed.user_attrs["outcome"] == "failed" and failed.user_attrs["failure_reason"]
    assert pruned.state == TrialState.PRUNED and pruned.user_attrs["outcome"] == "pruned"
    assert pruned.user_attrs["pruned_at_step"] == 1
    children = {int(r.data.tags[K.TAG_TRIAL]): r for r in runs(store_uri(tmp_path), "nan_sweep")}
    assert children[0].info.status == "FAILED" and children[0].data.tags[K.TAG_TRIAL_STATE] == "FAIL"
    assert K.TAG_FAILURE in children[0].data.tags
    assert children[1].data.tags[K.TAG_TRIAL_STATE] == "PRUNED" and children[1].data.tags[K.TAG_STOPPED] == "callback"
    steps = [m.step for m in tracking.client(store_uri(tmp_path)).get_metric_history(children[1].info.run_id, K.RM_SCORE)]
    assert max(steps) < 200  # stopped, not run to its end


@pytest.mark.slow
def test_a_killed_worker_fails_the_sweep_and_the_next_run_makes_its_trial_up(tmp_path, tiny_world, fake_training):
    path = write_sweep(tmp_path, tiny_world, "kill_sweep", trials=3, steps=50)  # fake steps: seconds in flight
    proc = subprocess_sweep(tmp_path, path, "--workers", "2")
    victim = None
    while victim is None and proc.poll() is None:
        time.sleep(0.2)
        victim = running_trial(tmp_path, "kill_sweep")
    assert victim is not None, proc.communicate()[0]
    pid = next(int(r.data.tags[K.TAG_PID]) for r in runs(store_uri(tmp_path), "kill_sweep")
               if r.data.tags[K.TAG_TRIAL] == str(victim.number))
    os.kill(pid, signal.SIGKILL)  # the worker process that trains the trial's run
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 1, out
    assert "password" not in out

    study = load_study(tmp_path, "kill_sweep")
    killed = study.get_trials()[victim.number]
    assert killed.state == TrialState.FAIL and "outcome" not in killed.user_attrs  # interrupted: does not count
    run = next(r for r in runs(store_uri(tmp_path), "kill_sweep") if r.data.tags[K.TAG_TRIAL] == str(victim.number))
    made_up = [t for t in study.get_trials() if t.user_attrs.get("retry_of") == victim.number]
    if made_up and made_up[0].state == TrialState.COMPLETE:  # a trial slot was still free: made up at once
        assert made_up[0].user_attrs["mlflow_run_ids"] == [run.info.run_id] and run.info.status == "FINISHED"
    else:
        assert run.info.status == "KILLED" and run.data.tags[K.TAG_TRIAL_OUTCOME] == "interrupted"
    parent = runs(store_uri(tmp_path), "kill_sweep", "parent")[0]
    assert parent.info.status == "FAILED" and "worker process died" in parent.data.tags[K.TAG_FAILURE]

    # the next run makes the trial up (if it is not yet), with the same values, resuming its run (found by its
    # config): the study holds 3 counted trials, one MLflow run per configuration
    assert sweep.main(cli(tmp_path, path)) == 0
    trials = load_study(tmp_path, "kill_sweep").get_trials()
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) == 3 and len(trials) == 4
    again = next(t for t in done if t.params == killed.params)
    assert again.user_attrs["retry_of"] == victim.number and again.user_attrs["mlflow_run_ids"] == [run.info.run_id]
    train = runs(store_uri(tmp_path), "kill_sweep")
    assert len(train) == 3 and all(r.info.status == "FINISHED" for r in train)


@pytest.mark.slow
def test_passwords_in_the_urls_are_written_nowhere(tmp_path, tiny_world, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow artifacts of a non-file store go to ./mlruns
    tracking, store = (f"sqlite+pw://me:s3cret@/{tmp_path / n}" for n in ("mlflow.db", "optuna.db"))
    path = write_sweep(tmp_path, tiny_world, "pw_sweep", trials=1)
    assert sweep.main([str(path), "--tracking-uri", tracking, "--storage", store, "--threads", "1"]) == 0
    out = capsys.readouterr()
    assert "s3cret" not in out.out + out.err and "me:***@" in out.out
    assert b"s3cret" not in (tmp_path / "optuna.db").read_bytes()  # no study or trial attribute holds it
    study = optuna.load_study(study_name="pw_sweep", storage=store)
    assert study.user_attrs[sweepstore.ATTR_PARENT_RUNS].keys() == {tracking.replace("s3cret", "***")}
    all_runs = runs(tracking, "pw_sweep", "parent") + runs(tracking, "pw_sweep")
    # harness.train logs its whole config, logging.tracking_uri too: not the sweep's to mask
    seen = [(r.data.params, r.data.tags) for r in all_runs]
    assert "s3cret" not in json.dumps([({k: v for k, v in p.items() if k != "logging.tracking_uri"}, t) for p, t in seen])
