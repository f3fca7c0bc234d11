"""MLflow store access shared by every process of the harness."""
import multiprocessing as mp

from harness import tracking


def _open_store(uri: str) -> str:
    return tracking.ensure_experiment(uri, "race")


def test_parallel_processes_can_create_a_fresh_sqlite_store(tmp_path):
    # a brand-new store opened by several processes at once used to die in MLflow's migration
    uri = f"sqlite:///{tmp_path / 'fresh.db'}"
    with mp.get_context("spawn").Pool(3) as pool:
        ids = pool.map(_open_store, [uri] * 3)
    assert len(set(ids)) == 1


def test_metric_logger_batches_and_drops_non_finite(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    run_id = tracking.start_run(uri, "exp", "r")
    log = tracking.MetricLogger(uri, run_id)
    log.log({"a/x": 1.0, "a/y": float("nan"), "a/z": 2.5}, step=3)
    assert log.dropped == 1
    assert tracking.metric_history(uri, run_id, "a/z") == [(3, 2.5)]
    assert tracking.metric_history(uri, run_id, "a/y") == []
