"""Several machines, for real (docs/SCALING.md): a real PostgreSQL server holds the Optuna study and a real
`mlflow server` process on PostgreSQL the runs (fixtures `postgres`, `mlflow_server`: tests/servers.py), and
runners in processes of their own, each with its own working folder and run folders as two machines have,
train fake tasks (tests/fakes.py). The URLs are the documented ones: no password in them, PGPASSWORD set.

- two sweep runners on one study, one of them killed with kill -9 while its trial trains and restarted while
  the other works: distinct trials, each configuration trained in one run, the dead trial made up once, no
  crash;
- two sweep runners on two host names (`unshare --uts`: neither can see the other's processes as its own), one
  lost with kill -9 of its whole process group mid-trial: the other leaves its trial alone while its heartbeat
  is fresh and makes it up once after it goes stale;
- two grid runners on the server store: the second is refused while the first holds the grid, each run is
  trained once, a rerun of the finished grid leaves its parent FINISHED;
- a sweep whose database stops answering mid-trial ends with one error line, nothing RUNNING, and its rerun
  finishes the study with each configuration trained once;
- one study and one parent run whether the password is in the URL or in PGPASSWORD, and no password in any
  output, param, tag or study attribute.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from harness import ablate, sweep, tracking
from harness import keys as K
from harness.lease import Lease
from harness.registry import load_registry
from harness.schema import parse_overrides
from harness.study import Runner, study_hash
from harness.sweepstore import STALE_AFTER, database_identity, make_storage
from harness.trials import ATTR_RUNNER, trial_id_of

from fakes import runner_command
from helpers import (
    alive_in,
    last_step,
    on_host,
    runs_in,
    started,
    store_uri,
    tiny_grid,
    uts_problem,
    wait_for,
    write_sweep,
)
from servers import PASSWORD

REPO = Path(__file__).resolve().parents[1]
ENV = {"PGPASSWORD": PASSWORD}  # as docs/SCALING.md: the password out of the URL


def machine(tmp_path: Path, name: str) -> Path:
    """A folder standing in for a machine: the runner's working folder, so its run folders are its own."""
    (tmp_path / name).mkdir(exist_ok=True)
    return tmp_path / name


def logs_of(*paths: Path) -> str:
    return "\n".join(p.read_text() for p in paths if p.exists())


def test_two_sweep_runners_one_killed_and_restarted_share_one_postgres_study(
        tmp_path, tiny_world, postgres, mlflow_server):
    name, uri, storage = "pg_sweep", mlflow_server.uri, postgres.url("optuna")
    path = write_sweep(tmp_path, tiny_world, name, trials=4, steps=60, output_dir=False)  # runs/ of each machine
    argv = [str(path), "--trials", "4", "--storage", storage, "--tracking-uri", uri, "--threads", "1",
            "--heartbeat", "2", "--set", "sweep.sampler.name=random", "--set", "sweep.pruner.name=none"]
    a, b = machine(tmp_path, "a"), machine(tmp_path, "b")
    logs = [a / "first.log", b / "runner.log", a / "restarted.log"]
    cmd = runner_command("harness.sweep", *argv)
    with contextlib.ExitStack() as stack:
        reader = make_storage(storage)  # the test's own reads of the database
        stack.callback(reader.engine.dispose)
        first = stack.enter_context(started("harness.sweep", argv, a, logs[0], command=cmd, **ENV))
        other = stack.enter_context(started("harness.sweep", argv, b, logs[1], command=cmd, **ENV))
        study = wait_for(lambda: _study(reader, name), first, "the study", logs[0])

        def first_ones_trial():  # a trial of the first runner, its run past step 2
            for t in study.get_trials(states=(TrialState.RUNNING,)):
                runs = tracking.find_runs(uri, name, {K.TAG_TRIAL: str(t.number)})
                if t.user_attrs.get(ATTR_RUNNER, {}).get("pid") == first.pid and runs \
                        and last_step(uri, runs[-1].info.run_id) >= 2:
                    return t
        victim = wait_for(first_ones_trial, first, "a trial of the first runner in flight", logs[0])
        os.kill(first.pid, signal.SIGKILL)  # the runner alone: its worker ends its run KILLED and exits
        first.wait()
        deadline = time.monotonic() + 45
        while (left := alive_in(first.pid, a)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"processes of the killed runner still alive: {left}"
        assert other.poll() is None, logs_of(logs[1])[-3000:]  # the other one still works
        again = stack.enter_context(started("harness.sweep", argv, a, logs[2], command=cmd, **ENV))
        codes = [other.wait(timeout=600), again.wait(timeout=600)]
    out = logs_of(*logs)
    assert codes == [0, 0], out[-4000:]
    assert "Traceback" not in out and PASSWORD not in out

    trials = study.get_trials()
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) == 4 and len({tuple(sorted(t.params.items())) for t in done}) == 4, trials
    assert trials[victim.number].state == TrialState.FAIL  # dead, made up exactly once, with its values
    (retry,) = [t for t in trials if t.user_attrs.get("retry_of") == victim.number]
    assert retry.state == TrialState.COMPLETE and retry.params == victim.params
    assert {t.state for t in trials} == {TrialState.COMPLETE, TrialState.FAIL} and len(trials) == 5
    finished = Counter(r.data.tags[K.TAG_CONFIG_HASH] for r in runs_in(uri, name) if r.info.status == "FINISHED")
    assert len(finished) == 4 and set(finished.values()) == {1}, finished  # each configuration trained once
    assert not [r for r in runs_in(uri, name) if r.info.status == "RUNNING"]
    (parent,) = runs_in(uri, name, "parent")
    assert parent.info.status == "FINISHED"


def test_a_runner_on_another_host_makes_up_a_lost_runners_trial_only_once_its_heartbeat_is_stale(
        tmp_path, tiny_world, postgres, mlflow_server):
    """Runner A on host-a and runner B on host-b (UTS namespaces of their own: each sees the other's trial as
    another machine's, so only the heartbeat in the database tells B that A is gone). A's whole process group is
    killed with -9 while its trial trains (a machine lost: its run left RUNNING); B, working, must not touch that
    trial while its heartbeat is fresh, then fails it and makes it up exactly once."""
    if why := uts_problem():
        pytest.skip(why)
    beat = 3  # seconds; stale after STALE_AFTER x beat (a trial of host-b ends well within it: B looks at the study)
    name, uri, storage = "pg_hosts", mlflow_server.uri, postgres.url("optuna")
    path = write_sweep(tmp_path, tiny_world, name, trials=3, steps=30, output_dir=False)
    argv = [str(path), "--trials", "3", "--workers", "1", "--storage", storage, "--tracking-uri", uri, "--threads", "1",
            "--heartbeat", str(beat), "--set", "sweep.sampler.name=random", "--set", "sweep.pruner.name=none"]
    a, b = machine(tmp_path, "a"), machine(tmp_path, "b")
    cmd = runner_command("harness.sweep", *argv)
    reader = make_storage(storage)  # the test's own reads of the database
    with started("harness.sweep", argv, a, a / "runner.log", command=on_host("host-a", cmd), **ENV) as lost, \
            started("harness.sweep", argv, b, b / "runner.log", command=on_host("host-b", cmd), **ENV) as other:
        study = wait_for(lambda: _study(reader, name), lost, "the study", a / "runner.log")

        def in_flight(host: str):  # a trial of the runner on `host`, its run past step 2
            for t in study.get_trials(states=(TrialState.RUNNING,)):
                runs = tracking.find_runs(uri, name, {K.TAG_TRIAL: str(t.number)})
                if t.user_attrs.get(ATTR_RUNNER, {}).get("host") == host and runs \
                        and last_step(uri, runs[-1].info.run_id) >= 2:
                    return t
        victim = wait_for(lambda: in_flight("host-a"), lost, "a trial of host-a in flight", a / "runner.log")
        wait_for(lambda: in_flight("host-b") or study.get_trials(states=(TrialState.COMPLETE,)), other,
                 "host-b at work", b / "runner.log")
        os.killpg(lost.pid, signal.SIGKILL)  # host-a is lost: its runner and its worker, no run ended
        lost.wait()
        victim_id = trial_id_of(reader, name, victim.number)
        fresh, seen = STALE_AFTER * beat - 0.5, []  # (state, heartbeat age) as the database has them, at once
        while other.poll() is None and (not seen or seen[-1][0] == "RUNNING"):
            with reader.engine.connect() as conn:
                seen.append(tuple(conn.exec_driver_sql(
                    "SELECT t.state::text, EXTRACT(EPOCH FROM now() - h.heartbeat)::float FROM trials t "
                    "JOIN trial_heartbeats h ON h.trial_id = t.trial_id WHERE t.trial_id = %s", (victim_id,)).one()))
            time.sleep(0.2)
        assert other.wait(timeout=300) == 0, (b / "runner.log").read_text()[-4000:]
    reader.engine.dispose()
    out = logs_of(a / "runner.log", b / "runner.log")
    assert "Traceback" not in out and PASSWORD not in out
    assert [s for s in seen if s[0] == "RUNNING" and s[1] < fresh], f"never seen fresh after the kill: {seen}"
    assert not [s for s in seen if s[0] != "RUNNING" and s[1] < fresh], f"failed while its heartbeat was fresh: {seen}"
    assert seen[-1][0] == "FAIL", seen

    trials = study.get_trials()
    assert trials[victim.number].state == TrialState.FAIL
    (retry,) = [t for t in trials if t.user_attrs.get("retry_of") == victim.number]  # made up exactly once, by B
    assert retry.state == TrialState.COMPLETE and retry.params == victim.params
    assert retry.user_attrs[ATTR_RUNNER]["host"] == "host-b"
    assert f"trial {victim.number} " in out and "no heartbeat from its runner; made up with the same values" in out
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) == 3 and len(trials) == 4 and len({tuple(sorted(t.params.items())) for t in done}) == 3, trials
    runs = runs_in(uri, name)
    finished = Counter(r.data.tags[K.TAG_CONFIG_HASH] for r in runs if r.info.status == "FINISHED")
    assert len(finished) == 3 and set(finished.values()) == {1}, finished  # each configuration trained once
    assert not [r for r in runs if r.info.status == "RUNNING"]  # the lost run ended KILLED by B
    (parent,) = runs_in(uri, name, "parent")
    assert parent.info.status == "FINISHED"


def test_runners_that_start_at_once_on_a_new_database_all_open_it(postgres):
    """Each runner's storage creates Optuna's tables where they are missing; several machines started at once
    on a new database race to create them (PostgreSQL: a duplicate key in pg_type). Every one must open it
    (before: the losers were refused as a bad --storage URL)."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    n = 6
    for attempt in range(3):
        url, barrier = postgres.create_database(f"race{attempt}"), Barrier(n)

        def opened(_: int) -> str:
            barrier.wait()
            storage = make_storage(url)
            try:
                return database_identity(storage)
            finally:
                storage.engine.dispose()  # the session's server has 100 connection slots for every test

        with ThreadPoolExecutor(n) as pool:
            assert len(set(pool.map(opened, range(n)))) == 1


def test_runners_that_open_a_new_study_at_once_queue_its_first_trials_once(tmp_path, tiny_world, postgres):
    """The sweep file's first_trials (the paper's point) are queued by the runner whose study creation won (one
    row in the database); runners of other machines opening the same new study at the same moment queue none
    (before: each that saw an empty study queued them, and the point ran as two trials, its run trained twice)."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    from harness.sweepfile import load_sweep

    first = "first_trials:\n  - {reward.clip: 0.8, ppo.kl_coef: 0.05}\n  - {reward.clip: 0.3, ppo.kl_coef: 0.1}\n"
    path = write_sweep(tmp_path, tiny_world, "pg_first", extra=first)
    spec = load_sweep(path, [], store_uri(tmp_path))
    n = 4
    for attempt in range(3):
        url, barrier = postgres.create_database(f"first{attempt}"), Barrier(n)

        def opened(_: int) -> None:
            barrier.wait()
            sweep.open_study(spec, url)[1].engine.dispose()

        with ThreadPoolExecutor(n) as pool:
            list(pool.map(opened, range(n)))
        storage = make_storage(url)
        study = optuna.load_study(study_name="pg_first", storage=storage)
        assert sorted(t.user_attrs["first_trial"] for t in study.get_trials()) == [0, 1], attempt
        storage.engine.dispose()


def test_a_lease_whose_write_lost_the_race_to_create_the_tag_is_refused(mlflow_server):
    """MLflow sets a tag by a read, then an insert: two runners taking a new grid's lease at once both insert,
    and the server refuses the later one (PostgreSQL's duplicate key, a 400). That runner is refused, naming
    the holder, as one that read the other's tag back is; a refusal with no other holder is raised as it is.
    (The race is made here by writing the other runner's tag, for real, just before ours is refused.)"""
    from mlflow.exceptions import MlflowException

    from harness.lease import LeaseHeld

    uri, other = mlflow_server.uri, Runner(1, 0.0, "another-machine")

    class Raced(Lease):
        def _write(self, holder):
            if holder is not None and not getattr(self, "raced", False):
                self.raced = True
                if self.runner is not other:  # the other runner's insert lands first; ours is the duplicate
                    Lease(uri, "lease_race", "k", other)._write({**vars(other), "beat": time.time(), "every": 10.0})
                raise MlflowException("duplicate key value violates unique constraint \"experiment_tag_pk\"")
            super()._write(holder)

    with pytest.raises(LeaseHeld, match="runner pid 1 on another-machine"):
        with Raced(uri, "lease_race", "k", Runner.this()):
            pass
    Lease(uri, "lease_race", "k", other)._write(None)
    with pytest.raises(MlflowException, match="duplicate key"):  # refused, yet no one holds it: not a LeaseHeld
        with Raced(uri, "lease_race", "k", other):
            pass
    with Lease(uri, "lease_race", "k", Runner.this()) as lease:  # nothing left behind: the grid can be taken
        assert lease._read()["host"] == Runner.this().host


def test_two_grid_runners_on_the_server_store_train_each_run_once(tmp_path, tiny_world, mlflow_server):
    """While a runner of another machine holds the grid (its lease in the store, beating), a runner here is
    refused; once it has let go, two runners started at once train each run once between them."""
    name, uri = "server_grid", mlflow_server.uri
    path = tiny_grid(tmp_path, tiny_world, name)
    argv = [str(path), "--tracking-uri", uri, "--runs-dir", "runs", "--threads", "1", "--no-progress",
            "--workers", "2", "--set", "ppo.steps=40"]
    a, b = machine(tmp_path, "a"), machine(tmp_path, "b")
    cmd = runner_command("harness.ablate", *argv)
    grid = ablate.grid_identity(load_registry(path, overrides=parse_overrides(["ppo.steps=40"])))
    with Lease(uri, name, study_hash(grid), Runner(1, 0.0, "another-machine")):
        with started("harness.ablate", argv, b, b / "refused.log", command=cmd) as refused:
            assert refused.wait(timeout=300) == 3, (b / "refused.log").read_text()[-3000:]
    out = (b / "refused.log").read_text()
    assert f"another `python -m harness.ablate` is running grid {name!r}" in out and "another-machine" in out
    assert "Traceback" not in out and not runs_in(uri, name) and not runs_in(uri, name, "parent")

    with started("harness.ablate", argv, a, a / "runner.log", command=cmd) as first, \
            started("harness.ablate", argv, b, b / "runner.log", command=cmd) as second:
        codes = sorted([first.wait(timeout=600), second.wait(timeout=600)])
    out = logs_of(a / "runner.log", b / "runner.log")
    assert codes in ([0, 0], [0, 3]), out[-4000:]  # the second refused, or it came after: nothing to run
    assert "Traceback" not in out
    runs = runs_in(uri, name)
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}, runs  # each (variant, seed) once
    (parent,) = runs_in(uri, name, "parent")
    assert parent.info.status == "FINISHED"

    with started("harness.ablate", argv, b, b / "rerun.log", command=cmd) as rerun:  # the other machine, later
        assert rerun.wait(timeout=300) == 0, (b / "rerun.log").read_text()[-3000:]
    assert "(nothing to run)" in (b / "rerun.log").read_text()
    assert [r.info.run_id for r in runs_in(uri, name)] == [r.info.run_id for r in runs]
    (again,) = runs_in(uri, name, "parent")
    assert (again.info.run_id, again.info.status) == (parent.info.run_id, "FINISHED")


def test_one_study_and_parent_however_the_url_is_spelled_and_no_password_anywhere(
        tmp_path, tiny_world, postgres, mlflow_server, fake_training, monkeypatch, capsys):
    name, uri = "pg_identity", mlflow_server.uri
    in_url = postgres.url("optuna", password=True)
    in_env = postgres.url("optuna", host="localhost")  # another host name for the same server, password in PGPASSWORD
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PGPASSWORD", raising=False)
    first = make_storage(in_url)
    monkeypatch.setenv("PGPASSWORD", PASSWORD)
    second = make_storage(in_env)
    assert database_identity(first) == database_identity(second)
    assert PASSWORD not in database_identity(first)
    first.engine.dispose()

    path = write_sweep(tmp_path, tiny_world, name, trials=1)
    common = [str(path), "--tracking-uri", uri, "--workers", "0", "--threads", "1"]
    monkeypatch.delenv("PGPASSWORD")
    assert sweep.main([*common, "--storage", in_url]) == 0
    monkeypatch.setenv("PGPASSWORD", PASSWORD)
    assert sweep.main([*common, "--storage", in_env, "--trials", "2"]) == 0
    out, err = capsys.readouterr()
    assert PASSWORD not in out + err
    (parent,) = runs_in(uri, name, "parent")  # one parent: the same study
    study = optuna.load_study(study_name=name, storage=second)
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE] * 2
    assert {r.data.tags["mlflow.parentRunId"] for r in runs_in(uri, name)} == {parent.info.run_id}
    c = tracking.client(uri)
    for run in [parent, *runs_in(uri, name)]:
        data = c.get_run(run.info.run_id).data
        assert PASSWORD not in repr(data.params) + repr(data.tags)
    assert PASSWORD not in repr(study.user_attrs) + repr([t.user_attrs for t in study.get_trials()])
    second.engine.dispose()


def _study(storage, name: str):
    """The study in `storage` (one RDBStorage the test opened: a storage per poll would hold a connection each
    until collected, and the session's server has 100 slots for every test), or None while it is not there."""
    with contextlib.suppress(KeyError):
        return optuna.load_study(study_name=name, storage=storage)


@pytest.fixture(autouse=True)
def _password_in_env_only(monkeypatch):
    """The runners of these tests find the password in PGPASSWORD (ENV); this process too, for its reads."""
    monkeypatch.setenv("PGPASSWORD", PASSWORD)


def test_a_database_lost_mid_sweep_ends_the_runner_with_one_line_and_a_rerun_finishes_the_study(
        tmp_path, tiny_world, postgres):
    """The study's database stops answering while a trial trains (its connections cut, new ones refused, as a
    server restarted or out of slots does): the runner ends with one `error:` line saying what happened and what
    to do (no traceback through Optuna and SQLAlchemy), its run is not left RUNNING, and once the database is
    back the same command finishes the study with each configuration trained once."""
    import psycopg

    from servers import ADMIN

    name, db = "pg_lost", "lostdb"
    storage, uri = postgres.create_database(db), store_uri(tmp_path)
    path = write_sweep(tmp_path, tiny_world, name, trials=3, steps=60, output_dir=False)
    argv = [str(path), "--trials", "3", "--workers", "1", "--storage", storage, "--tracking-uri", uri,
            "--threads", "1", "--heartbeat", "1", "--set", "sweep.sampler.name=random", "--set", "sweep.pruner.name=none"]
    cmd, logs = runner_command("harness.sweep", *argv), [tmp_path / "lost.log", tmp_path / "again.log"]
    admin = f"postgresql://postgres:{ADMIN}@{postgres.host}:{postgres.port}/postgres"

    def database(allow: bool) -> None:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f"ALTER DATABASE {db} ALLOW_CONNECTIONS {str(allow).lower()}")
            if not allow:
                c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (db,))

    with started("harness.sweep", argv, tmp_path, logs[0], command=cmd, **ENV) as lost:
        wait_for(lambda: [r for r in runs_in(uri, name) if last_step(uri, r.info.run_id) >= 2], lost,
                 "a trial in flight", logs[0])
        database(allow=False)
        code = lost.wait(timeout=120)
    out = logs[0].read_text()
    database(allow=True)
    assert code == 1, out[-3000:]
    assert "Traceback" not in out and PASSWORD not in out, out[-3000:]
    (last,) = [line for line in out.splitlines() if line.startswith("error:")]
    assert "database" in last and "rerun the same command" in last, last
    deadline = time.monotonic() + 60  # the worker's watchdog ends the runner's run when it sees the runner gone
    while [r for r in runs_in(uri, name) if r.info.status == "RUNNING"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [r for r in runs_in(uri, name) if r.info.status == "RUNNING"]
    (parent,) = runs_in(uri, name, "parent")  # closed with the reason, not left RUNNING
    assert parent.info.status == "FAILED" and "stopped answering" in parent.data.tags[K.TAG_FAILURE], parent

    with started("harness.sweep", argv, tmp_path, logs[1], command=cmd, **ENV) as again:
        assert again.wait(timeout=300) == 0, logs[1].read_text()[-3000:]
    assert "Traceback" not in logs[1].read_text()
    reader = make_storage(storage)
    trials = optuna.load_study(study_name=name, storage=reader).get_trials()
    reader.engine.dispose()
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) == 3 and not [t for t in trials if t.state == TrialState.RUNNING], trials
    finished = Counter(r.data.tags[K.TAG_CONFIG_HASH] for r in runs_in(uri, name) if r.info.status == "FINISHED")
    assert len(finished) == 3 and set(finished.values()) == {1}, finished
    assert not [r for r in runs_in(uri, name) if r.info.status == "RUNNING"]
