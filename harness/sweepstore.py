"""What a sweep leaves in its Optuna study, for reading it back (analysis): the user attributes
harness.sweep sets, the storage beside a store, and `stored_study`. Optuna alone: no runner, no training."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import optuna
import sqlalchemy
import tenacity

from harness import schema, tracking
from harness.schema import ConfigError

ATTR_OUTCOME = "outcome"  # trial user attr, set once a trial reached an outcome
ATTR_SWEEP = "sweep"  # study user attr: the resolved sweep (space, objective, ...) that analysis reads
ATTR_PARENT_RUNS = "mlflow_parent_runs"  # study user attr: {masked tracking URI: parent run id}


def default_storage_url(tracking_uri: str) -> str:
    """optuna.db next to the MLflow sqlite file; sqlite:///optuna.db (here) for other tracking URIs."""
    db = tracking.sqlite_path(tracking_uri)
    return f"sqlite:///{(db.parent if db else Path()) / 'optuna.db'}"


HEARTBEAT_S = 30
"""Seconds between a runner's heartbeats for each trial it runs (Optuna's RDBStorage heartbeat, kept in the
study's database: every machine sees it); --heartbeat of harness.sweep."""
STALE_AFTER = 4
"""A trial whose heartbeat is older than STALE_AFTER x the interval is dead (Optuna's grace_period): its runner
died or lost its database; the next runner to look, on any machine, fails it and makes it up."""
CONNECT_TIMEOUT_S = 10
"""How long opening a network database may take before the storage is refused (unreachable host)."""
SCHEMA_ATTEMPTS = 4
"""Tries at opening a storage whose tables another runner is creating at the same moment (a new database)."""
STORAGE_ALLOWED = ("an SQLAlchemy database URL that Optuna's RDBStorage opens, e.g. sqlite:///optuna.db or "
                   "postgresql://user@host:5432/db (driver: pip install 'harness[postgres]'), reachable from here")


def make_storage(url: str, *, flag: str = "--storage", heartbeat_s: int | None = None,
                 on_stale: Callable[[Any, Any], None] | None = None) -> Any:
    """Optuna's RDBStorage of `url`, with heartbeats every `heartbeat_s` (a trial without one for STALE_AFTER x
    that long is stale: `optuna.storages.fail_stale_trials` fails it and calls `on_stale(study, trial)`). A URL
    that is malformed, names a driver that is not installed, or a database that cannot be reached is refused
    (ConfigError naming `flag`, the URL with its password masked, the reason and what is allowed), before
    anything is created in it. On sqlite every transaction starts with BEGIN IMMEDIATE: pysqlite otherwise
    begins only at the first write, so two runners could both read a queued trial as WAITING and both run it."""
    try:
        parsed = sqlalchemy.engine.make_url(url)
        backend = parsed.get_backend_name()
        parsed.get_dialect()  # an unknown backend or driver name: NoSuchModuleError
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError, ValueError) as e:
        raise ConfigError([f"{flag}: got {tracking.redact(url)!r}: {_reason(e)}; allowed: {STORAGE_ALLOWED}"]) from None
    if backend == "sqlite":
        kwargs: dict[str, Any] = {"connect_args": {"timeout": 600, "isolation_level": None}}
    else:
        kwargs = {"pool_pre_ping": True}
        if backend in ("postgresql", "mysql"):
            kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    beat = {} if not heartbeat_s else {"heartbeat_interval": heartbeat_s, "grace_period": STALE_AFTER * heartbeat_s,
                                       "heartbeat_stale_trial_callback": on_stale}
    # runners started at once on a new database race to create Optuna's tables (PostgreSQL: a duplicate key in
    # pg_type, or a table that already exists): the loser tries again once the winner has made them
    retrying = tenacity.Retrying(retry=tenacity.retry_if_exception_type((sqlalchemy.exc.IntegrityError,
                                                                          sqlalchemy.exc.ProgrammingError)),
                                 stop=tenacity.stop_after_attempt(SCHEMA_ATTEMPTS),
                                 wait=tenacity.wait_incrementing(start=0.5, increment=0.5), reraise=True)
    try:  # Optuna's heartbeat is experimental (it warns so at every storage)
        for attempt in retrying:
            with attempt, tracking.sqlite_lock(url), warnings.catch_warnings(
                    action="ignore", category=optuna.exceptions.ExperimentalWarning):
                storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs, **beat)
    except (ImportError, sqlalchemy.exc.SQLAlchemyError, OSError) as e:
        raise ConfigError([f"{flag}: got {tracking.redact(url)!r}: {_reason(e)}; allowed: {STORAGE_ALLOWED}"]) from None
    if backend == "sqlite":
        sqlalchemy.event.listen(storage.engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    return storage


def _reason(e: BaseException) -> str:
    """The first line of a database error, its password masked (no SQLAlchemy traceback, no background link)."""
    text = str(getattr(e, "orig", None) or e).strip().splitlines()
    head = text[0] if text else type(e).__name__
    if isinstance(e, ImportError):
        head = f"its driver is not installed ({head})"
    return tracking.redact(head)


def database_problem(e: BaseException) -> str:
    """What went wrong with the study's database, in one line. Optuna wraps every database error of a running
    study in StorageInternalError ("invalid data in the commit, e.g. exceeding max length", whatever
    happened); the driver's message at the bottom of its chain says what did (a server gone, connections
    refused, out of slots)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {_reason(e)}"


def database_identity(storage: Any) -> str:
    """The database a storage holds, however its URL is written (password in the URL or in PGPASSWORD,
    localhost or 127.0.0.1, user name or none): PostgreSQL's cluster identifier and database name, MySQL's
    server UUID and database. Never a credential: a study's identity (its parent run) is derived from it. A
    sqlite file (no credentials, one machine) keeps its URL, as the studies made before this were found."""
    url = storage.engine.url
    queries = {"postgresql": "SELECT system_identifier::text, current_database() FROM pg_control_system()",
               "mysql": "SELECT @@server_uuid, DATABASE()"}
    backend = url.get_backend_name()
    if backend == "sqlite":
        return tracking.redact(storage.url)
    if backend in queries:
        try:
            with storage.engine.connect() as conn:
                server, db = conn.exec_driver_sql(queries[backend]).one()
            return f"{backend}:{server}/{db}"
        except sqlalchemy.exc.SQLAlchemyError:  # no right to read it: the server's address below
            pass
    return f"{backend}://{url.host or ''}:{url.port or ''}/{url.database or ''}"


def fail_stale(study: Any) -> None:
    """Optuna's own recovery of a shared study: trials whose runner's heartbeat stopped are failed, each by
    exactly one runner (the storage's row lock), which calls the storage's stale-trial callback."""
    with warnings.catch_warnings(action="ignore", category=optuna.exceptions.ExperimentalWarning):
        optuna.storages.fail_stale_trials(study)


def stored_study(sweep: str | Path, tracking_uri: str | None = None,
                 storage_url: str | None = None) -> tuple[Any, dict[str, Any], str, str]:
    """A sweep's stored study, by name or sweep YAML, for reading it back (analysis): (the Optuna study, what
    harness.sweep stored of the sweep (ATTR_SWEEP), the tracking URI (harness.tracking.resolve_uri), the storage
    URL (default: optuna.db beside a sqlite store)); KeyError / ValueError naming what is missing."""
    name = str(schema.read_yaml(sweep, "sweep file").get("name")) if Path(sweep).suffix in (".yaml", ".yml") \
        else str(sweep)
    tracking_uri = tracking.resolve_uri(tracking_uri)
    storage_url = storage_url or default_storage_url(tracking_uri)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = tracking.sqlite_path(storage_url)
    if db is not None and not db.is_file():  # a reader creates no database
        raise KeyError(f"no Optuna study named {name!r} in {tracking.redact(storage_url)}: no database file {db}; "
                       "run `python -m harness.sweep` on its sweep file first, or pass --storage")
    storage = make_storage(storage_url)
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        raise KeyError(f"no Optuna study named {name!r} in {tracking.redact(storage_url)}; "
                       "run `python -m harness.sweep` on its sweep file first") from None
    attr = study.user_attrs.get(ATTR_SWEEP)
    if not attr:
        raise ValueError(f"study {name!r} holds no `{ATTR_SWEEP}` attribute: it was not run by harness.sweep")
    return study, attr, tracking_uri, storage_url
