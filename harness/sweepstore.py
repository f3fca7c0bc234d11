"""What a sweep leaves in its Optuna study, for reading it back (analysis): the user attributes
harness.sweep sets, the storage beside a store, and `stored_study`. Optuna alone: no runner, no training."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna

from harness import schema, tracking


ATTR_OUTCOME = "outcome"  # trial user attr, set once a trial reached an outcome
ATTR_SWEEP = "sweep"  # study user attr: the resolved sweep (space, objective, ...) that analysis reads
ATTR_PARENT_RUNS = "mlflow_parent_runs"  # study user attr: {masked tracking URI: parent run id}


def default_storage_url(tracking_uri: str) -> str:
    """optuna.db next to the MLflow sqlite file; sqlite:///optuna.db (here) for other tracking URIs."""
    db = tracking.sqlite_path(tracking_uri)
    return f"sqlite:///{(db.parent if db else Path()) / 'optuna.db'}"


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
    try:
        study = optuna.load_study(study_name=name, storage=storage_url)
    except KeyError:
        raise KeyError(f"no Optuna study named {name!r} in {tracking.redact(storage_url)}; "
                       "run `python -m harness.sweep` on its sweep file first") from None
    attr = study.user_attrs.get(ATTR_SWEEP)
    if not attr:
        raise ValueError(f"study {name!r} holds no `{ATTR_SWEEP}` attribute: it was not run by harness.sweep")
    return study, attr, tracking_uri, storage_url
