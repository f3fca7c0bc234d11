"""MLflow access for every part of the harness: one client per store, experiments whose artifacts
live next to a sqlite store, runs opened (or reopened) by id, one `log_batch` per step (MLflow's
sqlite store costs ~0.1 ms of CPU per metric and a disk sync per call, so the trainer never logs
metric by metric)."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import posixpath
import re
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Iterable

import mlflow
import sqlalchemy
from filelock import FileLock
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from harness import provenance

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
"""MLflow 3's own default store, when neither a flag, MLFLOW_TRACKING_URI nor a config names one."""
_READY: set[str] = set()

SQLITE_BUSY_MS = 60_000
"""How long a write to a sqlite store waits for another process's lock before "database is locked": a
grid's workers and its runner all write at once when a run ends or a Ctrl-C reaches them, and under load
sqlite3's default 5 s was lost now and then (a run left RUNNING, a traceback). Set on every sqlite
connection SQLAlchemy opens in this process (a public engine event): Optuna's keep it; MLflow sets 20 s on
each of its sessions itself."""


@sqlalchemy.event.listens_for(sqlalchemy.engine.Engine, "connect")
def _sqlite_busy_timeout(dbapi_connection: Any, _record: Any) -> None:
    if isinstance(dbapi_connection, sqlite3.Connection):
        dbapi_connection.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_MS}")


_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):(?P<secret>[^@/\s]+)@")


def redact(text: str) -> str:
    """Hide the password of every `scheme://user:password@host` in `text` (`user:***@host`): every
    place a URI leaves the process goes through this. Credentials belong in the environment
    (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD), not in URIs."""
    return _CREDENTIALS.sub(lambda m: f"{m['head']}:***@", text)


def resolve_uri(flag: str | None = None, configured: str | None = None) -> str:
    """The MLflow store, as MLflow's own tools find it, for every writer and reader of the harness:
    `--tracking-uri`, else $MLFLOW_TRACKING_URI, else the config's logging.tracking_uri, else
    sqlite:///mlflow.db."""
    return flag or os.environ.get("MLFLOW_TRACKING_URI") or configured or DEFAULT_TRACKING_URI


def at_cli_edge(cfg: Any) -> Any:
    """A TrainConfig with its store resolved as a command line resolves it (resolve_uri: $MLFLOW_TRACKING_URI
    beats the file's logging.tracking_uri): once, at the edge; `harness.train.train(cfg)` and a runner's
    workers then use the config's store as it is."""
    return dataclasses.replace(cfg, logging=dataclasses.replace(
        cfg.logging, tracking_uri=resolve_uri(None, cfg.logging.tracking_uri)))


def sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite URL (sqlite:///relative.db, sqlite:////abs.db, sqlite+driver://...),
    parsed as SQLAlchemy (MLflow's and Optuna's SQL layer) parses it; None for any other store."""
    try:
        url = sqlalchemy.engine.make_url(uri)
    except Exception:  # noqa: BLE001 - not a database URL at all (http://..., a folder)
        return None
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    return Path(url.database).expanduser()


class RedactingStream:
    """A text stream (sys.stdout / sys.stderr) that writes `redact(text)` to the stream it wraps and
    passes everything else (flush, isatty, fileno, encoding, buffer) through to it."""

    def __init__(self, stream: Any):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(redact(text) if isinstance(text, str) else text)
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _redact_record(record: logging.LogRecord) -> logging.LogRecord:
    """A log record whose message, traceback and stack carry no password (left as it was when none
    does: its args stay for handlers that read them)."""
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a malformed record is logging's own error to report
        return record
    if redact(message) != message:
        record.msg, record.args = redact(message), None
    if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        if redact(text) != text:
            record.exc_text = redact(text)  # what Formatter.format prints instead of formatting exc_info
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    return record


def _print_exception(head: str, tp: type[BaseException], value: BaseException | None, tb: Any) -> None:
    """A traceback as the default hooks print it, redacted as one text (not line by line)."""
    sys.stderr.write(redact(head + "".join(traceback.format_exception(tp, value, tb))))
    sys.stderr.flush()


def _excepthook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
    if isinstance(value, StoreError):  # its message says what is wrong and what to do; no traceback
        sys.stderr.write(f"error: {redact(str(value))}\n")
        sys.stderr.flush()
        return
    _print_exception("", tp, value, tb)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as threading's own hook: a thread's SystemExit is silent
        return
    name = args.thread.name if args.thread is not None else threading.get_ident()
    _print_exception(f"Exception in thread {name}:\n", args.exc_type, args.exc_value, args.exc_traceback)


def redact_output() -> None:
    """Mask credentials in everything this process prints, as `redact` does in what the harness
    writes: MLflow prints its store's URI itself (`View run ... at: http://user:password@host/...`,
    written to sys.stdout; its logging; exception messages naming the URL of a failed request).

    Installs, once per process (calling again is a no-op): sys.stdout and sys.stderr wrapped in a
    `RedactingStream` (prints, tqdm, warnings, MLflow's own writes, error texts that came back from
    worker processes); a logging record factory that redacts every record's message and traceback
    (handlers writing to files or to a stream they held before this call); sys.excepthook and
    threading.excepthook printing each uncaught exception's traceback redacted as a whole (where
    they are still Python's defaults: a debugger's or a test runner's hook is left alone). Every CLI
    calls it first thing in main(); `client()` calls it too, so that a worker process that opens a
    store (a grid's or sweep's run, a torchrun rank) masks MLflow's output whichever way it started."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))
    factory = logging.getLogRecordFactory()
    if not getattr(factory, "redacts", False):
        def redacting_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            return _redact_record(factory(*args, **kwargs))

        redacting_factory.redacts = True  # type: ignore[attr-defined]
        logging.setLogRecordFactory(redacting_factory)
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _excepthook
    if threading.excepthook is threading.__excepthook__:
        threading.excepthook = _thread_excepthook


class StoreError(RuntimeError):
    """The store of a tracking URI cannot be opened (a database driver missing, a server that does
    not answer, a folder that cannot be written). Uncaught, it prints as one line `error: ...`
    (`redact_output`'s hook), not as a traceback through MLflow and SQLAlchemy."""


def store_error(tracking_uri: str, e: Exception) -> StoreError:
    """What a researcher needs from a failed first contact: which store (password masked), why, and
    what to do about it."""
    if isinstance(e, ModuleNotFoundError) and e.name:
        hint = f"MLflow needs the database driver `{e.name}` for this URI: pip install {e.name}"
    elif tracking_uri.startswith(("http://", "https://")):
        budget = ", ".join(f"{k}={os.environ.get(k, v)}" for k, v in FIRST_CONTACT.items())
        hint = (f"check the URI (--tracking-uri, else $MLFLOW_TRACKING_URI) and that its server is up; first contact "
                f"tried with {budget} (set these variables for a longer budget)")
    else:
        hint = "check the URI (--tracking-uri, else $MLFLOW_TRACKING_URI) and that its server or folder is there"
    why = " ".join(str(e).split())  # one line: a driver's message spans several
    return StoreError(redact(f"the MLflow store {tracking_uri} cannot be opened ({type(e).__name__}: {why}); {hint}"))


def sqlite_lock(uri: str) -> Any:
    """The lock that serializes creating a sqlite store (MLflow's or Optuna's: two processes creating
    one at once race in its schema migration; one dies), its folder made; a null context for any
    other store. Reentrant in a process (one lock object per file)."""
    db = sqlite_path(uri)
    if db is None:
        return contextlib.nullcontext()
    db.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{db}.lock", is_singleton=True)


FIRST_CONTACT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""MLflow's retry budget for the first request to a tracking server, where the user set none (MLflow's own
variables, read at each request): a server that is not there fails in seconds, not after MLflow's ~4 minutes
of retries. Every later request has MLflow's budget (or the user's), so a run rides out a server's hiccup."""


@contextlib.contextmanager
def first_contact_budget(tracking_uri: str):
    """FIRST_CONTACT's variables set inside the block, for an http(s) store, where the environment sets none."""
    unset = {k: v for k, v in FIRST_CONTACT.items() if k not in os.environ}
    if not tracking_uri.startswith(("http://", "https://")):
        unset = {}
    os.environ.update(unset)
    try:
        yield
    finally:
        for k in unset:
            os.environ.pop(k, None)


DATABASE_SCHEMES = ("postgresql", "mysql", "mssql")
"""Database URIs MLflow opens through SQLAlchemy (sqlite aside): MLflow retries the engine ~10 times with
doubling sleeps (about 100 s) before it gives up on a database that does not answer."""


def probe_database(tracking_uri: str, timeout_s: int = 5) -> None:
    """One connection to a database store with a short connect timeout, so a server that is not there fails
    in seconds with its own error, before MLflow's retries (a no-op for other stores)."""
    if tracking_uri.split(":", 1)[0].split("+", 1)[0] not in DATABASE_SCHEMES:
        return
    engine = sqlalchemy.create_engine(tracking_uri, connect_args={"connect_timeout": timeout_s})
    try:
        with engine.connect():
            pass
    finally:
        engine.dispose()


STORE_TEMPLATE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "harness"
"""Where the empty sqlite store of this MLflow version is kept (`new_sqlite_store`)."""


def _store_template() -> Path:
    """An empty, fully migrated sqlite store of this MLflow version, made once per machine by MLflow itself
    (its Default experiment removed: MLflow adds it back, with its artifact folder, where the copy is opened)."""
    path = STORE_TEMPLATE_DIR / f"mlflow-{mlflow.__version__}-empty.db"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
        with contextlib.closing(sqlite3.connect(tmp)) as con, con:
            con.execute("DELETE FROM experiments")
        os.replace(tmp, path)  # whole or not at all: two processes making it at once both make a good one
    return path


def new_sqlite_store(db: Path) -> None:
    """Create the sqlite store `db` (absent or empty) as a copy of `_store_template`: MLflow builds a new store
    by running its ~60 schema migrations, 2-3 s of CPU, paid by every new store of a grid, sweep, report or
    test; the copy takes milliseconds and opens as a store MLflow made (tables at the head revision). Where the
    template cannot be made (no writable cache folder), MLflow creates the store as it always does."""
    if db.is_file() and db.stat().st_size:
        return
    try:
        template = _store_template()
    except (OSError, sqlite3.Error):
        return
    tmp = db.with_name(f"{db.name}.{os.getpid()}.tmp")
    shutil.copyfile(template, tmp)
    os.replace(tmp, db)


def client(tracking_uri: str) -> MlflowClient:
    """A client of the store, checked by one request the first time a process opens it (a failure is
    a `StoreError`). A sqlite store is created/migrated under a file lock, once per process: two
    processes opening a brand-new sqlite store at once race in MLflow's migration; one dies.
    The process's output is redacted from here on (`redact_output`): MLflow prints the store's URI."""
    redact_output()
    if tracking_uri not in _READY:
        db = sqlite_path(tracking_uri)
        try:
            with sqlite_lock(tracking_uri), first_contact_budget(tracking_uri):
                probe_database(tracking_uri)
                if db is not None:
                    new_sqlite_store(db)
                MlflowClient(tracking_uri=tracking_uri).search_experiments(max_results=1)
                if db is not None:
                    # a write-ahead log: a commit appends to one file and syncs it once (the rollback
                    # journal's several syncs made each step's log_batch ~2x slower), and readers (a
                    # grid's progress display) never block a run's writes. The mode is kept in the
                    # file; a store busy right now keeps its mode, which only costs speed.
                    with contextlib.suppress(sqlite3.OperationalError), contextlib.closing(sqlite3.connect(db)) as con:
                        con.execute("PRAGMA journal_mode=WAL")
        except Exception as e:  # noqa: BLE001 - any failure of the first contact is the store's
            raise store_error(tracking_uri, e) from e
        _READY.add(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri)


EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
"""MLflow's own experiment-kind tag (read by MLflow 3's UI): open the experiment as model training
(runs, metrics, artifacts), not as GenAI (traces, evaluations)."""


def ui_url(tracking_uri: str, experiment: str, base: str = "http://127.0.0.1:5000") -> str:
    """Where `mlflow server` (or `mlflow ui`) on this store shows the experiment's runs as model
    training: MLflow 3.17's UI picks GenAI or model training by its own switch (the URL's
    workflowType, else what the browser chose last, GenAI at first), not by EXPERIMENT_KIND."""
    exp = client(tracking_uri).get_experiment_by_name(experiment)
    where = f"experiments/{exp.experiment_id}/runs" if exp is not None else "experiments"
    return f"{base}/#/{where}?workflowType=machine_learning"


def ensure_experiment(tracking_uri: str, name: str) -> str:
    """Experiment id for `name`, creating it if needed (safe against a concurrent creator), tagged
    EXPERIMENT_KIND (an experiment of an older store gets the tag unless it has a kind)."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            c.restore_experiment(exp.experiment_id)
        for k, v in EXPERIMENT_KIND.items():
            if k not in exp.tags:
                c.set_experiment_tag(exp.experiment_id, k, v)
        return exp.experiment_id
    db = sqlite_path(tracking_uri)  # keep its artifacts beside the db file, not in the cwd
    root = (db.resolve().parent / "mlartifacts" / name).as_uri() if db is not None else None
    try:
        return c.create_experiment(name, artifact_location=root, tags=EXPERIMENT_KIND)
    except Exception:
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def git_commit() -> str:
    return provenance.git("rev-parse", "--short", "HEAD") or "unknown"


def start_run(tracking_uri: str, experiment: str, run_name: str, tags: dict[str, str] | None = None,
              parent_run_id: str | None = None) -> str:
    """Create a run (RUNNING) and return its id; a parent id makes it a nested child run."""
    all_tags = {"mlflow.runName": run_name, **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    exp_id = ensure_experiment(tracking_uri, experiment)
    return client(tracking_uri).create_run(exp_id, run_name=run_name, tags=all_tags).info.run_id


def run_exists(tracking_uri: str, run_id: str) -> bool:
    """Whether the store holds run `run_id`; a store that cannot answer raises (it is not 'no')."""
    try:
        client(tracking_uri).get_run(run_id)
        return True
    except mlflow.exceptions.MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):  # unknown, or not an id at all
            return False
        raise


def run_filter(tags: dict[str, str] | None = None, where: str = "") -> str:
    """The one MLflow filter string of the harness: every tag of `tags` equal (values without quotes), and
    `where` (e.g. "attributes.status = 'RUNNING'")."""
    if any("'" in v for v in (tags or {}).values()):
        raise ValueError(f"find_runs: tag values may not contain quotes: {tags}")
    return " and ".join([f"tags.`{k}` = '{v}'" for k, v in (tags or {}).items()] + ([where] if where else []))


def find_runs(tracking_uri: str, experiment: str, tags: dict[str, str] | None = None, where: str = "") -> list[Any]:
    """The runs of `experiment` carrying every tag of `tags` and matching `where`, oldest first ([] without
    the experiment)."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = c.search_runs([exp.experiment_id], run_filter(tags, where), max_results=50000)
    return sorted(runs, key=lambda r: r.info.start_time)


def reopen_run(tracking_uri: str, run_id: str) -> None:
    client(tracking_uri).update_run(run_id, status="RUNNING")


def release_interrupted_writes() -> None:
    """Call after leaving an `except KeyboardInterrupt` block and before writing to the store. A Ctrl-C that lands
    inside a store write leaves that write's sqlite transaction open, in frames the exception's traceback holds
    (MLflow rolls its session back for an Exception, not for a KeyboardInterrupt), so a write made inside the
    block waits on this process's own lock: MLflow's 20 s busy timeout, then 'database is locked' and the run left
    RUNNING. Outside the block, collecting those frames closes the transaction."""
    gc.collect()


def end_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    client(tracking_uri).set_terminated(run_id, status=status, end_time=int(time.time() * 1000))


def delete_tags(tracking_uri: str, run_id: str, keys: Iterable[str]) -> None:
    """Remove these tags where the run has them (a rerun's parent loses an earlier attempt's failure)."""
    c = client(tracking_uri)
    have = c.get_run(run_id).data.tags
    for k in keys:
        if k in have:
            c.delete_tag(run_id, k)


def next_step(tracking_uri: str, run_id: str, key: str) -> int:
    """The step after the last one logged for `key` (0 for none): once-per-invocation metrics of a
    parent run never land twice on one step."""
    steps = [m.step for m in client(tracking_uri).get_metric_history(run_id, key)]
    return max(steps) + 1 if steps else 0


def log_params(tracking_uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Values as YAML-like text: `null` for None, lists and mappings as JSON with real unicode (δ,
    not \\u03b4), cut to MLflow's 6000 characters; 100 params per call (MLflow's limit)."""
    def text(v: Any) -> str:
        return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) or v is None else str(v)

    items = [Param(k, redact(text(v))[:6000]) for k, v in params.items()]
    c = client(tracking_uri)
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i : i + 100])


def set_tags(tracking_uri: str, run_id: str, tags: dict[str, str]) -> None:
    if tags:
        client(tracking_uri).log_batch(run_id, tags=[RunTag(k, redact(str(v))) for k, v in tags.items()])


class MetricLogger:
    """Collects a step's metrics and writes them in one `log_batch` call. Non-finite values are dropped
    (and counted): a NaN that reaches the store is almost always a bug upstream, reported by the trainer."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.client = client(tracking_uri)
        self.run_id = run_id
        self.dropped = 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.log_points([(k, v, step) for k, v in metrics.items()])

    def log_points(self, points: list[tuple[str, float, int]]) -> None:
        """(key, value, step) points, in as few calls as MLflow allows (1000 metrics each)."""
        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step) for k, v, step in points if math.isfinite(float(v))]
        self.dropped += len(points) - len(batch)
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])


def log_text_artifact(tracking_uri: str, run_id: str, text: str, artifact_path: str) -> None:
    """Write `text` to `artifact_path` (e.g. 'samples/step_000050.json') in the run."""
    client(tracking_uri).log_text(run_id, redact(text), artifact_path)


def log_json_artifact(tracking_uri: str, run_id: str, obj: Any, artifact_path: str) -> None:
    """`obj` as JSON; tensors, arrays and their scalars as (lists of) numbers, other values as text."""
    log_text_artifact(tracking_uri, run_id, json.dumps(obj, indent=1, ensure_ascii=False,
                      default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)), artifact_path)


def log_file_artifacts(tracking_uri: str, run_id: str, files: Iterable[str | Path],
                       artifact_path: str | None = None) -> None:
    c = client(tracking_uri)
    for f in files:
        c.log_artifact(run_id, str(f), artifact_path=artifact_path)


def log_table(tracking_uri: str, run_id: str, table: Any, artifact_file: str) -> None:
    """A pandas table as the run's table artifact (MLflow's UI shows it as a table), replacing one
    logged before under that name (MLflow's log_table would append to it)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    c = client(tracking_uri)
    if artifact_file in {a.path for a in c.list_artifacts(run_id, posixpath.dirname(artifact_file) or None)}:
        get_artifact_repository(c.get_run(run_id).info.artifact_uri, tracking_uri).delete_artifacts(artifact_file)
    c.log_table(run_id, table, artifact_file)


def load_json_artifact(tracking_uri: str, run_id: str, artifact_path: str) -> Any:
    with tempfile.TemporaryDirectory() as d:
        return json.loads(Path(client(tracking_uri).download_artifacts(run_id, artifact_path, d)).read_text())


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client(tracking_uri).get_metric_history(run_id, key)]


def last_logged_steps(tracking_uri: str, run_id: str) -> dict[str, int]:
    """{metric key: the largest step the store holds for it} of a run (empty for a run without
    metrics): how far a reopened run already logged each metric."""
    c = client(tracking_uri)
    return {k: max(m.step for m in c.get_metric_history(run_id, k)) for k in c.get_run(run_id).data.metrics}
