"""A grid's exclusive hold on a server store, kept in the store itself (every machine sees it): an experiment
tag `harness.lease.<study hash>` naming the runner (host, pid, start time) and when it last beat. The lock
file beside a sqlite store serves one machine; a tracking server is shared by many, each with its own runs
folder, so two grid runners there would each hold their own lock and both train every run.

Taking it: no holder, or a holder whose heartbeat is older than STALE_AFTER beats (it died, on any
machine), or one of this machine that is gone (at once): write ours, wait SETTLE_S, read it back; a
runner that wrote at the same moment reads the other's and backs off (refused, as a second runner of a
sqlite grid is), as does one whose write the store refused because the other's created the tag first.
The holder beats every BEAT_S in a thread; the tag is removed when the runner ends.
MLflow has no compare-and-set, so this is a lease, not a lock: two runners whose writes reach the server
more than SETTLE_S apart in the same instant cannot both hold it."""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

from mlflow.exceptions import MlflowException

from . import tracking

BEAT_S = 10.0
STALE_AFTER = 6
SETTLE_S = 1.0
PREFIX = "harness.lease."


def _holds(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether the lease read back names this runner (its host, pid, start time; the beat aside)."""
    return {k: holder.get(k) for k in me} == me


class LeaseHeld(RuntimeError):
    """Another live runner holds the lease (its host and pid named)."""


class Lease:
    """The exclusive hold of study `key` in experiment `experiment` of a server store (context manager)."""

    def __init__(self, uri: str, experiment: str, key: str, runner: Any, beat_s: float = BEAT_S):
        self.uri, self.tag, self.runner, self.beat_s = uri, PREFIX + key, runner, beat_s
        self.exp_id = tracking.ensure_experiment(uri, experiment)
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def _read(self) -> dict[str, Any] | None:
        raw = tracking.client(self.uri).get_experiment(self.exp_id).tags.get(self.tag)
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return None

    def _write(self, holder: dict[str, Any] | None) -> None:
        c = tracking.client(self.uri)
        if holder is None:
            c.delete_experiment_tag(self.exp_id, self.tag)
        else:
            c.set_experiment_tag(self.exp_id, self.tag, json.dumps(holder))

    def _dead(self, holder: dict[str, Any]) -> bool:
        if not {"pid", "started", "host", "beat"} <= holder.keys():  # not a lease this code wrote: void
            return True
        owner = type(self.runner)(holder["pid"], holder["started"], holder["host"])  # a study.Runner
        return time.time() - holder["beat"] > STALE_AFTER * holder.get("every", BEAT_S) or not owner.alive()

    def __enter__(self) -> "Lease":
        me = {k: v for k, v in dataclasses.asdict(self.runner).items() if k != "stop_file"}
        holder = self._read()
        if holder is not None and not self._dead(holder):
            raise LeaseHeld(self._who(holder))
        try:
            self._write({**me, "beat": time.time(), "every": self.beat_s})
        except MlflowException:
            # MLflow sets a tag by a read, then an insert: a runner whose insert of the same new tag reached the
            # store first makes ours a duplicate key (PostgreSQL: UniqueViolation, a 400). That runner holds it.
            holder = self._read()
            if holder is None or _holds(holder, me):
                raise  # no other holder: the store refused for another reason, said as it is
            raise LeaseHeld(self._who(holder)) from None
        time.sleep(SETTLE_S)
        holder = self._read()
        if holder is None or not _holds(holder, me):
            raise LeaseHeld(self._who(holder or {}))
        self.thread = threading.Thread(target=self._beat, args=(me,), name="grid-lease", daemon=True)
        self.thread.start()
        return self

    def _beat(self, me: dict[str, Any]) -> None:
        while not self.stopped.wait(self.beat_s):
            self._write({**me, "beat": time.time(), "every": self.beat_s})

    def __exit__(self, *exc: Any) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
            self._write(None)

    def _who(self, holder: dict[str, Any]) -> str:
        return f"runner pid {holder.get('pid', '?')} on {holder.get('host', '?')} (lease {self.tag} in the store)"
