"""MLflow store access shared by every process of the harness."""
import multiprocessing as mp
import sqlite3
import subprocess
import sys
from pathlib import Path

from harness import tracking

from helpers import foreground_signals, sqlite_uri, store_uri, study_storage

REPO = Path(__file__).resolve().parents[1]


def _open_store(uri: str) -> str:
    return tracking.ensure_experiment(uri, "race")


def test_parallel_processes_can_create_a_fresh_sqlite_store(tmp_path):
    # a brand-new store opened by several processes at once used to die in MLflow's migration
    uri = sqlite_uri(tmp_path / "fresh.db")
    with mp.get_context("spawn").Pool(3) as pool:
        ids = pool.map(_open_store, [uri] * 3)
    assert len(set(ids)) == 1
    # ... and leave it in write-ahead-log mode (one sync per commit; readers never block a run's writes)
    with sqlite3.connect(tmp_path / "fresh.db") as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_metric_logger_batches_and_drops_non_finite(tmp_path):
    uri = sqlite_uri(tmp_path / "m.db")
    run_id = tracking.start_run(uri, "exp", "r")
    log = tracking.MetricLogger(uri, run_id)
    log.log({"a/x": 1.0, "a/y": float("nan"), "a/z": 2.5}, step=3)
    assert log.dropped == 1
    assert tracking.metric_history(uri, run_id, "a/z") == [(3, 2.5)]
    assert tracking.metric_history(uri, run_id, "a/y") == []


def test_credentials_never_reach_the_store(tmp_path):
    uri = sqlite_uri(tmp_path / "c.db")
    secret = "http://alice:s3cr3t@mlflow.example:5000"
    assert tracking.redact(f"store {secret} and postgresql://bob:pw@db/optuna") == \
        "store http://alice:***@mlflow.example:5000 and postgresql://bob:***@db/optuna"
    run_id = tracking.start_run(uri, "exp", "r")
    tracking.log_params(uri, run_id, {"logging.tracking_uri": secret, "reward.clip": None, "name": "δ=0.8"})
    tracking.set_tags(uri, run_id, {"where": secret})
    tracking.log_text_artifact(uri, run_id, f"tracking_uri: {secret}\n", "config.yaml")
    tracking.log_json_artifact(uri, run_id, {"uri": secret}, "info.json")
    run = tracking.client(uri).get_run(run_id)
    assert run.data.params == {"logging.tracking_uri": "http://alice:***@mlflow.example:5000", "reward.clip": "null",
                               "name": "δ=0.8"}
    assert "s3cr3t" not in run.data.tags["where"]
    art = tmp_path / "mlartifacts"
    assert all("s3cr3t" not in f.read_text() for f in art.rglob("*") if f.is_file())
    assert len([f for f in art.rglob("*") if f.is_file()]) == 2


def test_sqlite_stores_wait_for_a_lock_instead_of_failing_at_5_s(tmp_path):
    """Every sqlite connection SQLAlchemy opens (MLflow's store, Optuna's storage) waits SQLITE_BUSY_MS for
    another process's write lock: a grid's workers and runner writing at once on a Ctrl-C lost sqlite3's
    default 5 s under load ("database is locked", a run left RUNNING)."""
    import sqlalchemy
    from mlflow.store.db.utils import create_sqlalchemy_engine

    uri = store_uri(tmp_path)
    tracking.client(uri)
    for engine in (create_sqlalchemy_engine(uri), sqlalchemy.create_engine(study_storage(tmp_path))):
        with engine.connect() as con:
            assert con.exec_driver_sql("PRAGMA busy_timeout").scalar() == tracking.SQLITE_BUSY_MS
        engine.dispose()


def _schema(db) -> tuple:
    """Tables, their columns and indexes, and the schema revision (not the CREATE text: MLflow's migrations
    write a CHECK constraint's values in an order that varies between two stores it makes)."""
    with sqlite3.connect(db) as con:
        names = sorted(n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')"))
        columns = {n: con.execute(f'PRAGMA table_info("{n}")').fetchall() for n in names}
        return names, columns, con.execute("SELECT version_num FROM alembic_version").fetchall()


def test_a_new_sqlite_store_is_a_copy_of_the_migrated_template_and_opens_as_mlflow_made_it(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setattr(tracking, "STORE_TEMPLATE_DIR", tmp_path / "cache")
    MlflowClient(tracking_uri=sqlite_uri(tmp_path / "by_mlflow.db")).search_experiments()  # MLflow's migrations
    for where in ("a", "b"):  # the first makes the template, the second only copies it
        (tmp_path / where).mkdir()
        uri = store_uri(tmp_path / where)
        exp = tracking.ensure_experiment(uri, "exp")
        made, copied = _schema(tmp_path / "by_mlflow.db"), _schema(tmp_path / where / "mlflow.db")
        assert copied == made
        experiments = {e.name: e for e in tracking.client(uri).search_experiments()}
        assert set(experiments) == {"Default", "exp"} and experiments["exp"].experiment_id == exp
        assert experiments["Default"].experiment_id == "0" and "cache" not in experiments["Default"].artifact_location
        run_id = tracking.start_run(uri, "exp", "r")  # its artifacts beside this store, not the template's
        assert tracking.client(uri).get_run(run_id).info.artifact_uri.startswith((tmp_path / where).as_uri())
    (template,) = (tmp_path / "cache").iterdir()
    with sqlite3.connect(template) as con:
        assert con.execute("SELECT count(*) FROM experiments").fetchone() == (0,)
    assert not list(tmp_path.rglob("*.tmp"))


INTERRUPTED_WRITES = """
import signal, sys, threading, time
from harness import tracking

uri, inside = sys.argv[1], sys.argv[2] == "inside"
for trial in range(6):  # a Ctrl-C lands inside a store write most of the time: six tries, at other moments
    run_id = tracking.start_run(uri, "e", f"r{trial}")
    log = tracking.MetricLogger(uri, run_id)
    main, heard = threading.main_thread().ident, threading.Event()

    def press(first: float) -> None:  # Ctrl-C, and again while it goes unheard (a finalizer can swallow one)
        time.sleep(first)
        while not heard.is_set():
            signal.pthread_kill(main, signal.SIGINT)
            heard.wait(1.0)

    threading.Thread(target=press, args=(0.3 + 0.07 * trial,), daemon=True).start()
    interrupted, step = False, 0
    try:
        while True:  # a run logging its steps until Ctrl-C
            step += 1
            log.log({f"m{i}": float(i) for i in range(50)}, step=step)
    except KeyboardInterrupt:
        heard.set()
        if inside:
            tracking.end_run(uri, run_id, "KILLED")
        interrupted = True
    if interrupted and not inside:
        tracking.release_interrupted_writes()
        tracking.end_run(uri, run_id, "KILLED")
print("ended", flush=True)
"""


def test_a_ctrl_c_inside_a_store_write_ends_the_run_killed_once_outside_the_except_block(tmp_path):
    """harness.train's and the fake task's pattern: the KILLED write after the `except KeyboardInterrupt` block
    (tracking.release_interrupted_writes), where a write inside it waited on the interrupted write's open sqlite
    transaction, MLflow's 20 s, then failed ('database is locked', the run left RUNNING)."""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED_WRITES)
    uri = store_uri(tmp_path)
    p = subprocess.run([sys.executable, str(script), uri, "outside"], capture_output=True, text=True, timeout=600,
                       cwd=REPO, preexec_fn=foreground_signals)
    assert p.returncode == 0 and "ended" in p.stdout, p.stdout + p.stderr[-3000:]
    runs = tracking.client(uri).search_runs([tracking.client(uri).get_experiment_by_name("e").experiment_id])
    assert len(runs) == 6 and {r.info.status for r in runs} == {"KILLED"}


def test_mlflows_usage_telemetry_is_off_in_every_harness_process_unless_the_user_asks():
    """Offline, and its background thread raced a server request (KeyError '_MLFLOW_TELEMETRY_SESSION_ID'). A
    process with no CI or pytest variable (MLflow turns telemetry off by itself there) and one that opts in."""
    code = "import harness.tracking\nfrom mlflow.telemetry.client import get_telemetry_client as g\nprint(g() is None)"
    base = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONPATH": str(REPO)}
    for env, off in ((base, "True"), ({**base, "MLFLOW_DISABLE_TELEMETRY": "false"}, "False")):
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
        assert p.stdout.strip().splitlines()[-1:] == [off], p.stdout + p.stderr[-2000:]
