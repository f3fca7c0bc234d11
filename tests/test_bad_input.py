"""Bad input is refused before anything is created, in the CLIs' one error form (file or flag, field, value,
what is allowed), never as a traceback: Optuna storage URLs (harness.sweep, analysis.sweep_plots), an
unreachable tracking server (in seconds, and no Optuna study left beside it), collapse settings a run never
reaches, --smooth 0, and --nproc over which the batch does not split. Real sqlite stores in tmp_path."""
from __future__ import annotations

import pytest

from analysis import sweep_plots
from harness import ablate, sweep
from harness.config import load_config
from harness.schema import ConfigError
from reports import build

from helpers import fast_overrides, grid_argv, runs_in, store_uri, tiny_grid, write_sweep
from servers import free_port

BAD_STORAGE = {
    "nonsense": "Could not parse SQLAlchemy URL",
    "foo://x/y": "Can't load plugin: sqlalchemy.dialects:foo",
    "mysql://me@db.invalid/optuna": "its driver is not installed",
    "postgresql://me:s3cret@127.0.0.1:{port}/optuna": "Connection refused",
}


@pytest.mark.parametrize("url", list(BAD_STORAGE))
def test_bad_storage_urls_are_refused_naming_flag_value_and_allowed(tmp_path, tiny_world, monkeypatch, capsys, url):
    monkeypatch.chdir(tmp_path)
    why, url = BAD_STORAGE[url], url.format(port=free_port())
    path = write_sweep(tmp_path, tiny_world, "bad_storage")
    assert sweep.main([str(path), "--tracking-uri", store_uri(tmp_path), "--storage", url]) == 2
    assert sweep_plots.main(["bad_storage", "--tracking-uri", store_uri(tmp_path), "--storage", url]) == 2
    out, err = capsys.readouterr()
    for text in err.split("error: ")[1:]:
        assert "--storage: got" in text and why in text and "allowed: an SQLAlchemy database URL" in text, err
    assert err.count("--storage: got") == 2 and "Traceback" not in out + err and "s3cret" not in out + err
    assert not runs_in(store_uri(tmp_path), "bad_storage", "parent")  # no parent run, no study
    assert not (tmp_path / "optuna.db").exists()


def test_an_unreachable_tracking_server_fails_at_once_and_leaves_no_study(tmp_path, tiny_world, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, tiny_world, "no_server")
    assert sweep.main([str(path), "--tracking-uri", f"http://127.0.0.1:{free_port()}"]) == 2
    err = capsys.readouterr().err
    assert "cannot be opened" in err and "MLFLOW_HTTP_REQUEST_MAX_RETRIES=2" in err and "Traceback" not in err
    assert not (tmp_path / "optuna.db").exists()  # the default storage beside a server store: not made


@pytest.mark.parametrize("key", ["collapse.baseline_steps", "collapse.confirm"])
def test_collapse_settings_longer_than_the_run_are_refused(key):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["ppo.steps=10", f"{key}=30"])
    assert f"--set: {key}: got 30 with ppo.steps=10; allowed: at most ppo.steps" in str(e.value)
    load_config(None, ["ppo.steps=3"])  # the defaults stay valid for short runs (no collapse judged in them)


@pytest.mark.parametrize("k", ["0", "-1", "x"])
def test_smooth_below_one_is_refused(capsys, k):
    with pytest.raises(SystemExit) as e:
        build.main(["--smooth", k])
    assert e.value.code == 2
    assert f"argument --smooth: got {k!r}; allowed: an integer >= 1" in capsys.readouterr().err


def test_nproc_over_which_the_batch_does_not_split_is_refused_before_the_grid(tmp_path, tiny_world, capsys):
    path = tiny_grid(tmp_path, tiny_world, "split_grid")  # rollout 8 in 2 minibatches: 4 rows, not over 3 ranks
    assert ablate.main(grid_argv(tmp_path, path, "--nproc", "3")) == 2
    err = capsys.readouterr().err
    assert "ppo.rollout_batch_size: got 8 with ppo.num_minibatches=2 on 3 ranks; allowed: a multiple of" in err, err
    assert "Traceback" not in err
    assert not runs_in(store_uri(tmp_path), "split_grid", "parent")


@pytest.mark.parametrize("nproc, why", [("0", "--nproc: got 0; allowed: an integer >= 1"),
                                        ("-2", "--nproc: got -2; allowed: an integer >= 1"),
                                        ("3", "ppo.rollout_batch_size: got 8 with ppo.num_minibatches=2 on 3 ranks")])
def test_harness_launch_refuses_ranks_below_one_or_a_batch_that_does_not_split_before_the_run(
        tmp_path, tiny_world, capsys, nproc, why):
    from harness import launch

    sets = [f"--set={o}" for o in fast_overrides(tiny_world, tmp_path, **{"ppo.rollout_batch_size": 8})]
    assert launch.main(["--nproc", nproc, *sets]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()  # no run folder, no store


def test_a_sweep_refuses_nproc_over_which_the_batch_does_not_split_before_its_study(tmp_path, tiny_world, capsys):
    path = write_sweep(tmp_path, tiny_world, "split_sweep")  # rollout 8 in 2 minibatches: 4 rows, not over 3 ranks
    assert sweep.main([str(path), "--tracking-uri", store_uri(tmp_path), "--nproc", "3"]) == 2
    err = capsys.readouterr().err
    assert "ppo.rollout_batch_size: got 8 with ppo.num_minibatches=2 on 3 ranks; allowed: a multiple of" in err, err
    assert "Traceback" not in err
    assert not runs_in(store_uri(tmp_path), "split_sweep", "parent") and not (tmp_path / "optuna.db").exists()
