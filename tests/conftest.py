"""Shared fixtures (a tiny embedded world built once per test run, fake training, PostgreSQL and an MLflow
server) and the order the modules run in; shared helpers are in tests/helpers.py."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory, worker_id):
    """A world at the TINY scale (seconds to build), shared by every test of the session: under xdist in the
    run's folder shared by all workers, built by the first that asks (build_world lets one builder work on a
    folder at a time and returns a built world at once), so the suite builds it once, not once per worker."""
    from harness.world import TINY, build_world, load_world_config

    from helpers import store_uri

    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent  # this run's folder, the parent of every worker's own
    return build_world(load_world_config(overrides=TINY), root / "tiny_world" / "world",
                       tracking_uri=store_uri(root / "tiny_world"), progress=False)


@pytest.fixture
def detector_file(tmp_path):
    """A hand-set detector file (tests/helpers.py's write_detector)."""
    from helpers import write_detector

    return write_detector(tmp_path / "detector.json")


@pytest.fixture
def fake_training(monkeypatch):
    """Train tasks of the runners in this process (and their workers) are tests/fakes.py's fake_train:
    milliseconds a step, the store and run folders as real runs leave them."""
    from harness import study

    from fakes import fake_train

    monkeypatch.setattr(study, "TASK_KINDS", dict(study.TASK_KINDS))  # the built-in table back after the test
    study.register_task_kind("train", fake_train)
    return fake_train


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL cluster on 127.0.0.1 for the session (tests/servers.py); skipped, with the command
    that installs it, where its binaries are missing."""
    import servers

    pytest.importorskip("psycopg", reason="the PostgreSQL driver: pip install -e '.[postgres]' (make venv does)")
    try:
        pg = servers.start_postgres()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    yield pg
    servers.stop_postgres(pg)


@pytest.fixture(scope="session")
def mlflow_server(postgres, tmp_path_factory):
    """A real `mlflow server` process on the session's PostgreSQL (database mlflow), on 127.0.0.1."""
    import servers

    server = servers.start_mlflow_server(postgres, tmp_path_factory.mktemp("mlflow-server"))
    yield server
    servers.stop_mlflow_server(server)


HEAVY_FIRST = ("test_study", "test_ablate", "test_redaction", "test_servers", "test_sweep", "test_distributed",
               "test_gpu_check", "test_detector", "test_warning_signals", "test_tricks", "test_reports",
               "test_interrupts", "test_study_e2e", "test_shipped_world", "test_ownership", "test_install")
"""Modules that take longest (bench/RESULTS.md, session 16: the suite's durations), run first. Each module runs on
one xdist worker (--dist loadfile), which hands modules out in collection order (`make test` passes
--no-loadscope-reorder: xdist's default order is by number of tests, which put the few-but-long modules last): one
that starts last holds the run's end while the other workers idle."""


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order
