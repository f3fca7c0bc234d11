"""MLflow access for every part of the harness: one client per store, experiments whose artifacts
live next to a sqlite store, runs opened (or reopened) by id, one `log_batch` per step.

MLflow's sqlite store costs ~5 ms per call, so the trainer never logs metric by metric.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import mlflow
from filelock import FileLock
from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_LEN = 6000


_READY: set[str] = set()
_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):(?P<secret>[^@/\s]+)@")


def redact(text: str) -> str:
    """Hide the password of every `scheme://user:password@host` in `text` (`user:***@host`).

    Every place a URI can leave the process (printed, logged as a param or tag, written into an
    artifact, a study attribute or a report) goes through this; credentials belong in the
    environment (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD), not in URIs.
    """
    return _CREDENTIALS.sub(lambda m: f"{m['head']}:***@", text)


def _init_sqlite_store(tracking_uri: str) -> None:
    """Create/migrate a sqlite store under a file lock, once per process.

    Two processes opening a brand-new sqlite store at once (parallel workers, two runs started
    together) race in MLflow's schema migration and one of them dies; the lock serializes that.
    """
    if tracking_uri in _READY or not tracking_uri.startswith("sqlite:///"):
        return
    db = Path(tracking_uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(db) + ".lock"):
        MlflowClient(tracking_uri=tracking_uri).search_experiments(max_results=1)
    _READY.add(tracking_uri)


def client(tracking_uri: str) -> MlflowClient:
    _init_sqlite_store(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri)


def artifact_root(tracking_uri: str) -> str | None:
    """For a sqlite store keep artifacts beside the db file (not in the caller's cwd)."""
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///"):]).resolve()
        return (db.parent / "mlartifacts").as_uri()
    return None


def ensure_experiment(tracking_uri: str, name: str) -> str:
    """Experiment id for `name`, creating it if needed (safe against a concurrent creator)."""
    c = client(tracking_uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            c.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    root = artifact_root(tracking_uri)
    try:
        return c.create_experiment(name, artifact_location=f"{root}/{name}" if root else None)
    except Exception:
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def start_run(
    tracking_uri: str,
    experiment: str,
    run_name: str,
    tags: dict[str, str] | None = None,
    parent_run_id: str | None = None,
) -> str:
    """Create a run (RUNNING) and return its id; a parent id makes it a nested child run."""
    c = client(tracking_uri)
    exp_id = ensure_experiment(tracking_uri, experiment)
    all_tags = {"mlflow.runName": run_name, **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = c.create_run(exp_id, run_name=run_name, tags=all_tags)
    return run.info.run_id


def run_exists(tracking_uri: str, run_id: str) -> bool:
    try:
        client(tracking_uri).get_run(run_id)
        return True
    except mlflow.exceptions.MlflowException:
        return False


def reopen_run(tracking_uri: str, run_id: str) -> None:
    client(tracking_uri).update_run(run_id, status="RUNNING")


def end_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    client(tracking_uri).set_terminated(run_id, status=status, end_time=int(time.time() * 1000))


def log_params(tracking_uri: str, run_id: str, params: dict[str, Any]) -> None:
    items = [Param(k, _param_str(v)) for k, v in params.items()]
    c = client(tracking_uri)
    for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
        c.log_batch(run_id, params=items[i : i + _MAX_PARAMS_PER_BATCH])


def _param_str(v: Any) -> str:
    """YAML-like text: `null` for None, lists and mappings as JSON with real unicode (δ, not \\u03b4)."""
    s = json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) or v is None else str(v)
    return redact(s)[:_MAX_PARAM_LEN]


def set_tags(tracking_uri: str, run_id: str, tags: dict[str, str]) -> None:
    if tags:
        client(tracking_uri).log_batch(run_id, tags=[RunTag(k, redact(str(v))) for k, v in tags.items()])


class MetricLogger:
    """Collects a step's metrics and writes them in one `log_batch` call.

    Non-finite values are dropped (and counted) rather than sent: MLflow stores NaN, but a NaN
    that reaches the store is almost always a bug upstream, and the trainer reports those itself.
    """

    def __init__(self, tracking_uri: str, run_id: str):
        self.client = client(tracking_uri)
        self.run_id = run_id
        self.dropped = 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        batch = []
        for k, v in metrics.items():
            v = float(v)
            if math.isfinite(v):
                batch.append(Metric(k, v, ts, step))
            else:
                self.dropped += 1
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])


def log_json_artifact(tracking_uri: str, run_id: str, obj: Any, artifact_path: str) -> None:
    """Write `obj` as JSON to `artifact_path` (e.g. 'samples/step_000050.json') in the run."""
    p = Path(artifact_path)
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / p.name
        f.write_text(redact(json.dumps(obj, indent=1, default=_json_default, ensure_ascii=False)))
        client(tracking_uri).log_artifact(run_id, str(f), artifact_path=str(p.parent) if str(p.parent) != "." else None)


def log_text_artifact(tracking_uri: str, run_id: str, text: str, artifact_path: str) -> None:
    p = Path(artifact_path)
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / p.name
        f.write_text(redact(text))
        client(tracking_uri).log_artifact(run_id, str(f), artifact_path=str(p.parent) if str(p.parent) != "." else None)


def log_file_artifacts(tracking_uri: str, run_id: str, files: Iterable[str | Path], artifact_path: str | None = None) -> None:
    c = client(tracking_uri)
    for f in files:
        c.log_artifact(run_id, str(f), artifact_path=artifact_path)


def load_json_artifact(tracking_uri: str, run_id: str, artifact_path: str) -> Any:
    with tempfile.TemporaryDirectory() as d:
        local = mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path=artifact_path, dst_path=d, tracking_uri=tracking_uri
        )
        return json.loads(Path(local).read_text())


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client(tracking_uri).get_metric_history(run_id, key)]


def run_status(tracking_uri: str, run_id: str) -> str:
    return client(tracking_uri).get_run(run_id).info.status


__all__ = [
    "client", "ensure_experiment", "start_run", "reopen_run", "end_run", "log_params", "set_tags",
    "MetricLogger", "log_json_artifact", "log_text_artifact", "log_file_artifacts",
    "load_json_artifact", "metric_history", "run_status", "run_exists", "git_commit", "artifact_root", "RunStatus", "redact",
]
