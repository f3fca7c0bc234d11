"""Which runner owns a sweep's running trial is decided in the study's database (harness.trials), on a real
sqlite Optuna storage and MLflow store in tmp_path and fake training tasks (tests/fakes.py): a trial of a runner
on another machine, whose heartbeat beats, is never failed by a runner here; once its heartbeat stops, it is
made up exactly once. A grid's lease in the store (harness.lease): refused while its holder beats, taken over
once it is stale or its process gone. (Real servers, two runners and kill -9: tests/test_servers.py.)"""
from __future__ import annotations

import threading
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from harness import sweepfile
from harness.sweepstore import make_storage
from harness.trials import ATTR_RUNNER, trial_id_of

from fakes import runner_command
from helpers import started, store_uri, study_storage, wait_for, write_sweep

REPO = Path(__file__).resolve().parents[1]


def test_a_live_trial_of_another_machine_is_left_alone_and_made_up_once_its_heartbeat_stops(tmp_path, tiny_world):
    path, storage_url = write_sweep(tmp_path, tiny_world, "beats", trials=3), study_storage(tmp_path)
    spec = sweepfile.load_sweep(path, ["sweep.sampler.name=random"], store_uri(tmp_path))
    storage = make_storage(storage_url, heartbeat_s=1)
    study = optuna.create_study(storage=storage, study_name="beats", sampler=sweepfile.make_sampler(spec),
                                direction=spec.direction)
    with pytest.warns(UserWarning, match="Heartbeat of storage"):  # Optuna would beat in Study.optimize
        foreign = study.ask()  # what a runner on another machine holds: its values, its owner, its heartbeat
    for k, d in spec.space.items():
        d.suggest(foreign, k)
    foreign.set_user_attr(ATTR_RUNNER, {"pid": 1, "started": 0.0, "host": "another-machine"})
    beating, stop = threading.Event(), threading.Event()

    def beat() -> None:
        while not stop.wait(0.5):
            storage.record_heartbeat(trial_id_of(storage, "beats", foreign.number))
        beating.clear()

    beating.set()
    storage.record_heartbeat(trial_id_of(storage, "beats", foreign.number))
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    argv = [str(path), "--tracking-uri", store_uri(tmp_path), "--threads", "1", "--heartbeat", "1",
            "--set", "sweep.sampler.name=random"]
    log = tmp_path / "runner.log"
    try:
        with started("harness.sweep", argv, tmp_path, log, command=runner_command("harness.sweep", *argv)) as proc:
            # the runner runs the two trials the study lacks, then waits on the foreign one (it might die)
            wait_for(lambda: len(study.get_trials(states=(TrialState.COMPLETE,))) == 2, proc, "two trials done", log)
            assert study.get_trials()[foreign.number].state == TrialState.RUNNING  # alive: untouched
            assert proc.poll() is None  # waiting on it
            stop.set()  # the other machine dies: no heartbeat from now on
            assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        stop.set()
        thread.join(timeout=10)
    trials = study.get_trials()
    assert trials[foreign.number].state == TrialState.FAIL
    retries = [t for t in trials if t.user_attrs.get("retry_of") == foreign.number]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE and retries[0].params == foreign.params
    assert [t.state for t in trials].count(TrialState.COMPLETE) == 3
    out = log.read_text()
    assert f"trial {foreign.number} " in out and "no heartbeat from its runner; made up with the same values" in out


def test_a_grid_lease_is_refused_while_its_holder_beats_and_taken_over_once_it_is_dead(tmp_path):
    """harness.lease on a real MLflow store (sqlite here; a grid takes it on a server store, tests/test_servers.py)."""
    import json
    import time

    from harness import tracking
    from harness.lease import PREFIX, STALE_AFTER, Lease, LeaseHeld
    from harness.study import Runner

    uri = store_uri(tmp_path)
    me = Runner.this()
    exp = tracking.ensure_experiment(uri, "leased")

    def holder(**over) -> None:
        beat = {"pid": 1, "started": 0.0, "host": "another-machine", "beat": time.time(), "every": 10.0} | over
        tracking.client(uri).set_experiment_tag(exp, PREFIX + "g", json.dumps(beat))

    holder()  # alive on another machine: refused, named
    with pytest.raises(LeaseHeld, match="runner pid 1 on another-machine"):
        Lease(uri, "leased", "g", me).__enter__()
    holder(beat=time.time() - STALE_AFTER * 10.0 - 1)  # its heartbeat stopped a while ago: taken over
    with Lease(uri, "leased", "g", me):
        assert json.loads(tracking.client(uri).get_experiment(exp).tags[PREFIX + "g"])["pid"] == me.pid
    assert PREFIX + "g" not in tracking.client(uri).get_experiment(exp).tags  # let go at the end
    holder(host=me.host, pid=2 ** 22 + 7, started=1.0)  # on this machine, its process gone: taken over at once
    with Lease(uri, "leased", "g", me):
        pass
