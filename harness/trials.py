"""A sweep's trials as the study layer's tasks (harness.sweep runs them): `TrialSource` asks each trial
from Optuna (ask/tell on the shared storage), makes one task per seed x world, finds a configuration's run
in the store (harness.study.plan), reports to the pruner while the runs train, scores the finished runs
(`score_run`, `run_objectives`) and tells the trial.

Which runner owns a running trial is decided in the study's database, which every machine sees, never by a
file only one machine sees: the runner records itself on the trial (ATTR_RUNNER) and keeps a heartbeat on it
(Optuna's RDBStorage heartbeat, `Heartbeat`). A trial is dead when its heartbeat is stale (Optuna's
`fail_stale_trials`, on any machine) or, seen from its runner's own machine, when that runner process is gone
(at once, no grace period to wait). Failing it is one row update under the database's lock, so exactly one
runner wins, and that one makes it up (`make_up`: enqueued again with the same values); a live trial of
another machine is never touched."""
from __future__ import annotations

import dataclasses
import math
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from statistics import fmean
from typing import Any

import optuna
from optuna.trial import TrialState

from harness import config, design, keys, tracking
from harness.config import config_hash, merge
from harness.study import REUSED, Outcome, Runner, Task, plan
from harness.summary import by_step, reduce_run
from harness.sweepfile import Objective, StudyObjective, SweepSpec, build_config, fmt_value, trial_config
from harness.sweepstore import ATTR_OUTCOME, database_problem, fail_stale

ATTR_RUNNER = "runner"
"""Trial user attr: the runner that asked it ({host, pid, started}: a pid with its start time is one process)."""
LOOK_S = 1.0
"""While a runner waits on other runners' trials (its own all done): seconds between its looks at the study."""

def trial_counts(study: Any) -> dict[str, int]:
    """Trials that count toward the total (an outcome), were interrupted, are running or queued."""
    names = {TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}
    counts = Counter("interrupted" if t.state == TrialState.FAIL and ATTR_OUTCOME not in t.user_attrs
                     else names.get(t.state, "counted") for t in study.get_trials(deepcopy=False))
    return {k: counts[k] for k in ("counted", "interrupted", "running", "waiting")}


class TrialFailed(Exception):
    """A trial whose training run ended FAILED (stored as an Optuna FAIL trial)."""


def score_run(history: list[tuple[int, float]], objective: Objective, direction: str,
              collapse_step: int | None) -> tuple[float, float]:
    """(score, raw) of one run: raw = mean of the last `last_steps` values; a collapsed run under `penalty`
    scores mean(last `last_steps` values up to the collapse step) -/+ collapse_penalty (maximize/minimize)."""
    history = sorted((s, v) for s, v in history if math.isfinite(v))
    if not history:
        raise TrialFailed(f"{objective.metric} was never logged (finite) in this run")
    raw = fmean([v for _, v in history[-objective.last_steps:]])
    if collapse_step is None or objective.collapsed == "ignore":
        return raw, raw
    upto = [v for s, v in history if s <= collapse_step] or [history[0][1]]
    worse = -1.0 if direction == "maximize" else 1.0
    return fmean(upto[-objective.last_steps:]) + worse * objective.collapse_penalty, raw


Unit = tuple[int, "int | None"]
"""(seed, world) of one run of a trial (world None: the base's world)."""


@dataclasses.dataclass
class OpenTrial:
    """A trial asked from the study whose runs (one per seed x world) are in flight (this runner's)."""

    trial: Any
    params: dict[str, Any]
    tasks: dict[Unit, Task]
    """(seed, world) -> its task."""
    outcomes: dict[Unit, Outcome] = dataclasses.field(default_factory=dict)
    t0: float = dataclasses.field(default_factory=time.time)
    reported: int = 0
    """The last step reported to the pruner."""
    pruned_at: int | None = None

    def in_order(self, units: list[Unit]) -> list[tuple[Unit, Outcome]]:
        return [(u, self.outcomes[u]) for u in units if u in self.outcomes]


def unit_label(unit: Unit) -> str:
    """How user attrs key a run of a trial: its seed, with its world in a grid over worlds ('0', '0@w1')."""
    return str(unit[0]) if unit[1] is None else f"{unit[0]}@w{unit[1]}"


class TrialSource:
    """The study layer's tasks of a sweep: each trial asked from Optuna (ask/tell, on the shared
    storage) becomes one task per seed (x world); finished runs are scored and told; a pruner sees the
    running objective, read from the store while the runs train, and stops a weak trial's runs
    (a STOP file in each run folder: a step or two late).

    A run is found by its config (tags harness.sweep + harness.config_hash; named after the hash), not
    by its trial: a configuration already FINISHED in the store is not trained again (a made-up trial, a
    design that draws a configuration twice), one left KILLED (a runner or worker that died) resumes from
    its last checkpoint, one that FAILED starts over."""

    def __init__(self, spec: SweepSpec, study: Any, storage: Any, threads: int | None, nproc: int | None,
                 launcher: str, parent_run_id: str, heartbeat: "Heartbeat | None" = None):
        self.spec, self.study, self.storage, self.threads = spec, study, storage, threads
        self.nproc, self.launcher, self.parent_run_id = nproc, launcher, parent_run_id
        self.open: dict[int, OpenTrial] = {}
        self.unit_of: dict[str, tuple[int, Unit]] = {}
        """Task key -> (trial number, unit)."""
        counts = trial_counts(study)
        self.total = len(spec.units) * max(0, spec.trials - counts["counted"] - counts["running"])
        self.worker_died: list[str] = []
        self.heartbeat = heartbeat
        self.runner = Runner.this()
        self.others = 0
        """Trials other live runners hold (at the last look): this runner waits for them, to make up any that dies."""
        self.looked, self.want = 0.0, True
        self.deferred = 0
        """Trials interrupted here (their worker died, their runs KILLED): made up by the next invocation, not
        this one (a run that kills its worker, out of memory, would otherwise be retried for ever). A dead
        runner's trials are made up at once."""

    # -- asking
    def _wanted(self) -> bool:
        """The study holds fewer trials with an outcome or running than the sweep's total (every runner's count;
        interrupted ones do not: their made-up copies, queued, are asked first)."""
        c = trial_counts(self.study)
        self.others = c["running"] - len(self.open)
        self.want = c["counted"] + c["running"] + self.deferred < self.spec.trials
        return self.want

    def take(self, free: int) -> list[Task]:
        out: list[Task] = []
        if not self.open and time.monotonic() - self.looked < LOOK_S:
            return out  # waiting on other runners' trials: look again in a moment
        self.looked = time.monotonic()
        made_up(self.spec, self.study, self.storage)
        while free > len(out) and self._wanted():
            with warnings.catch_warnings():  # ask/tell with heartbeats: ours (Heartbeat), not Study.optimize's
                warnings.filterwarnings("ignore", "Heartbeat of storage is supposed")
                trial = self.study.ask()
            if self.heartbeat is not None:
                self.heartbeat.add(trial.number)
            params = design.suggest(self.spec.space, trial)
            trial.set_user_attr(ATTR_RUNNER, {k: v for k, v in dataclasses.asdict(self.runner).items() if k != "stop_file"})
            index = design.design_index(self.study, trial)
            if index is not None:
                trial.set_user_attr(design.ATTR_DESIGN_INDEX, index)
            ot = OpenTrial(trial, params, {u: self._task(trial, params, *u) for u in self.spec.units})
            self.open[trial.number] = ot
            for unit, task in ot.tasks.items():
                self.unit_of[task.key] = (trial.number, unit)
                earlier = self._plan(task)
                if earlier is None:
                    out.append(task)
                else:  # its run finished earlier: told with the others, not trained again
                    ot.outcomes[unit] = earlier
            if len(ot.outcomes) == len(ot.tasks):
                del self.open[trial.number]
                self._tell(ot)
        return out

    def _task(self, trial: Any, params: dict[str, Any], seed: int, world: int | None) -> Task:
        spec, uri = self.spec, self.spec.tracking_uri
        data = merge(trial_config(spec, params, world), {"seed": seed})
        cfg, _ = build_config(data)  # values that make no valid config fail the trial in its worker (ConfigError)
        chash = config_hash(cfg) if cfg is not None else None
        where = f"-s{seed}" + ("" if world is None else f"-w{world}")
        name = f"{spec.name}-{chash}{where}" if chash else f"{spec.name}-t{trial.number:04d}{where}"
        tags = {keys.TAG_SWEEP: spec.name, keys.TAG_TRIAL: str(trial.number), keys.TAG_SEED: str(seed),
                **({} if world is None else {keys.TAG_WORLD_SEED: str(world)})}
        # the run folder pinned (default or the file's): a fresh start clears it, a pruned trial's STOP file goes there
        out_dir = (data.get("logging") or {}).get("output_dir", config.LoggingConfig.output_dir)
        over = {"logging.tracking_uri": uri, "logging.experiment": spec.name, "logging.output_dir": str(out_dir),
                "logging.progress": False,  # a line per finished run (the study's Progress), no bars from workers
                "logging.run_name": name, "logging.parent_run_id": self.parent_run_id,
                "logging.tags": {**((spec.base_config.get("logging") or {}).get("tags") or {}), **tags},
                **({"threads": self.threads} if self.threads else {})}
        shown = ", ".join(f"{k}={fmt_value(v)}" for k, v in params.items())
        return Task(f"{name}@t{trial.number}", f"trial {trial.number} · seed {seed}"
                    + ("" if world is None else f" · world {world}") + f" ({shown})", merge(data, over),
                    tags={keys.TAG_SWEEP: spec.name, keys.TAG_CONFIG_HASH: chash} if chash else tags, steps=spec.steps,
                    nproc=self.nproc, launcher=self.launcher, parent_run_id=self.parent_run_id)

    def _plan(self, task: Task) -> Outcome | None:
        """What the store holds of the task's configuration (harness.study.plan; found by its config hash)."""
        log = task.cfg["logging"]
        runs = tracking.find_runs(self.spec.tracking_uri, self.spec.name, task.tags) if keys.TAG_CONFIG_HASH in task.tags else []
        return plan(task, runs, run_dir=Path(log["output_dir"]) / log["run_name"], steps=self.spec.steps,
                    prune_stops=True)

    def exhausted(self) -> bool:
        """Nothing to ask, nothing open here, and no other runner's trial running (one that dies is made up)."""
        return not self.open and not self.want and self.others <= 0  # as take() last looked

    # -- while the runs train
    def poll(self, running: list[Task]) -> None:
        """Report each open trial's running objective to the pruner while its runs train."""
        for ot in list(self.open.values()):
            self._report(ot)

    def _report(self, ot: OpenTrial) -> None:
        """Report the steps not reported yet: at each step every run has logged, the mean over the
        runs of the last `last_steps` values of the objective; once the pruner says prune, STOP
        files end the trial's runs at their next step (FINISHED, tag harness.stopped_by=callback)."""
        if ot.pruned_at is not None or isinstance(self.study.pruner, optuna.pruners.NopPruner):
            return
        obj, uri = self.spec.file.objective, self.spec.tracking_uri
        series = []
        for task in ot.tasks.values():
            run = _run_of(uri, self.spec.name, task)
            series.append(dict(tracking.metric_history(uri, run.info.run_id, self.spec.metric)) if run else {})
        for step in sorted(set.intersection(*(set(x) for x in series))):
            value = fmean(_running(x, step, obj.last_steps) for x in series)
            if step <= ot.reported or not math.isfinite(value):
                continue
            ot.trial.report(value, step)
            ot.reported = step
            if ot.trial.should_prune():
                ot.pruned_at = step
                for task in ot.tasks.values():
                    run_dir = Path(task.cfg["logging"]["output_dir"]) / task.cfg["logging"]["run_name"]
                    if run_dir.is_dir():
                        (run_dir / keys.STOP_FILE).touch()
                return

    # -- telling
    def done(self, task: Task, outcome: Outcome) -> None:
        n, unit = self.unit_of.pop(task.key)
        ot = self.open[n]
        ot.outcomes[unit] = outcome
        if len(ot.outcomes) < len(ot.tasks):
            return
        del self.open[n]
        self._tell(ot)

    def _tell(self, ot: OpenTrial) -> None:
        spec, obj, uri, trial = self.spec, self.spec.file.objective, self.spec.tracking_uri, ot.trial
        if self.heartbeat is not None:
            self.heartbeat.discard(trial.number)
        if trial_state(self.storage, spec.name, trial.number) != TrialState.RUNNING:
            # failed as dead by another runner (no heartbeat from here for the grace period: a suspended
            # machine, a lost database): that runner made it up; telling it now would fail
            print(f"[sweep {spec.name}] warning: trial {trial.number} was taken over by another runner (no heartbeat "
                  "from this one in time); its outcome here is dropped, its made-up copy counts", flush=True)
            return
        for unit, o in ot.outcomes.items():  # a worker that died left no run id in its outcome: the store has it
            if o.run_id is None and (run := _run_of(uri, spec.name, ot.tasks[unit])) is not None:
                o.run_id = run.info.run_id
        if all(o.ok for o in ot.outcomes.values()):
            self._report(ot)  # the steps logged since the last poll (short runs end between two polls)
        ordered = ot.in_order(spec.units)
        run_ids = [o.run_id for _, o in ordered if o.run_id]
        for rid in run_ids:
            tracking.log_params(uri, rid, {f"trial.{k}": v for k, v in ot.params.items()})
        trial.set_user_attr("mlflow_run_ids", run_ids)
        trial.set_user_attr("duration_s", round(time.time() - ot.t0, 2))
        died = [o for o in ot.outcomes.values() if o.worker_died]
        failed = [(u, o) for u, o in ordered if not o.ok and not o.worker_died]
        if died or (not failed and any(o.status == "KILLED" for o in ot.outcomes.values())):
            # interrupted: it does not count, and is made up with the same values
            self.worker_died += [o.why for o in died]
            self.deferred += 1
            self._finish(ot, TrialState.FAIL, "interrupted", "interrupted: " + (died[0].why if died else "runs KILLED"),
                         run_status="KILLED")
            self.study.enqueue_trial(ot.params, user_attrs={"retry_of": trial.number})
            return
        if failed:
            (seed, world), why = failed[0][0], failed[0][1].why
            reason = f"seed {seed}" + ("" if world is None else f" world {world}") + f": {why}"
            trial.set_user_attr("failure_reason", reason[:2000])
            trial.set_user_attr("failed_seed", seed)
            self._finish(ot, TrialState.FAIL, "failed", f"FAILED: {reason[:200]}", tags={keys.TAG_FAILURE: reason[:500]})
            return
        if ot.pruned_at is not None:
            trial.set_user_attr("pruned_at_step", ot.pruned_at)
            self._finish(ot, TrialState.PRUNED, "pruned", f"pruned at step {ot.pruned_at}")
            return
        scores, raws, collapse_steps, runs = [], [], {}, []
        try:
            for unit, o in ordered:
                collapse_step = (o.collapse_step or o.steps_done) if o.collapsed else None
                score, raw = score_run(tracking.metric_history(uri, o.run_id, spec.metric), obj, spec.direction,
                                       collapse_step)
                if collapse_step is not None and obj.collapsed == "worst":
                    done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    score = (min if spec.direction == "maximize" else max)([t.value for t in done] + [score])
                collapse_steps[unit_label(unit)] = collapse_step
                scores.append(score)
                raws.append(raw)
                runs.append({"run_id": o.run_id, "seed": unit[0], "world": unit[1], "collapsed": bool(o.collapsed),
                             **run_objectives(uri, o, spec.objectives, log=o.note != REUSED)})
                if o.note != REUSED:
                    tracking.MetricLogger(uri, o.run_id).log({keys.SWEEP_OBJECTIVE: score}, step=o.steps_done)
        except TrialFailed as e:
            trial.set_user_attr("failure_reason", str(e)[:2000])
            self._finish(ot, TrialState.FAIL, "failed", f"FAILED: {e}", tags={keys.TAG_FAILURE: str(e)[:500]})
            return
        value = fmean(scores)
        collapsed = sorted({u[0] for u, o in ordered if collapse_steps[unit_label(u)] is not None})
        for k, v in {"seed_scores": scores, "seed_raw_scores": raws, "collapsed": bool(collapsed),
                     "collapsed_seeds": collapsed, "collapse_steps": collapse_steps, "runs": runs}.items():
            trial.set_user_attr(k, v)
        reused = sum(o.note == REUSED for _, o in ordered)
        self._finish(ot, TrialState.COMPLETE, "collapsed" if collapsed else "complete", f"{spec.metric}={fmt_value(value)}"
                     + (f" (collapsed seeds {collapsed}, raw {fmt_value(fmean(raws))})" if collapsed else "")
                     + (f" ({reused} of {len(ordered)} runs {REUSED}: not trained again)" if reused else ""), value=value)

    def _finish(self, ot: OpenTrial, state: TrialState, outcome: str, text: str, *, value: float | None = None,
                tags: dict[str, str] | None = None, run_status: str | None = None) -> None:
        """Tag the trial's runs, tell Optuna, log the parent's sweep/ metrics at the trial's own step."""
        uri, trial = self.spec.tracking_uri, ot.trial
        for o in ot.outcomes.values():
            if o.run_id:
                tracking.set_tags(uri, o.run_id, {keys.TAG_TRIAL_STATE: state.name, keys.TAG_TRIAL_OUTCOME: outcome,
                                                  **(tags or {})})
                if run_status and tracking.client(uri).get_run(o.run_id).info.status == "RUNNING":
                    tracking.end_run(uri, o.run_id, run_status)
        if outcome != "interrupted":
            trial.set_user_attr(ATTR_OUTCOME, outcome)
        self.study.tell(trial, value, state=None if state == TrialState.COMPLETE else state)
        shown = ", ".join(f"{k}={fmt_value(v)}" for k, v in ot.params.items())
        print(f"[sweep {self.spec.name}] trial {trial.number} {shown}: {text} [{time.time() - ot.t0:.1f}s]", flush=True)
        counts = trial_counts(self.study)
        metrics = {f"sweep/n_{k}": v for k, v in counts.items()}
        best = next(iter(self.study.best_trials), None) if counts["counted"] else None
        if best is not None:
            metrics[keys.SWEEP_OBJECTIVE] = best.value
        tracking.MetricLogger(uri, self.parent_run_id).log(metrics, step=trial.number)

    def interrupt(self) -> None:
        """The runner stops (Ctrl-C): its open trials are told interrupted and made up next time."""
        for ot in list(self.open.values()):
            self._finish(ot, TrialState.FAIL, "interrupted", "interrupted", run_status="KILLED")
            self.study.enqueue_trial(ot.params, user_attrs={"retry_of": ot.trial.number})
        self.open.clear()


class Heartbeat:
    """A thread of the runner that records a heartbeat (Optuna's RDBStorage.record_heartbeat, in the study's
    database) every `interval_s` for each trial this runner runs; it dies with the runner, so the trials of a
    runner killed with -9 go stale and are made up by the next runner to look, on any machine."""

    def __init__(self, storage: Any, study_name: str, interval_s: float):
        self.storage, self.study_name, self.interval_s = storage, study_name, interval_s
        self.trials: dict[int, int] = {}
        """Trial number -> trial id, the trials beating."""
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="trial-heartbeat", daemon=True)
        self.thread.start()

    def add(self, number: int) -> None:
        """Beat for this trial from now on (one beat at once: a trial without any is never stale)."""
        self.trials[number] = trial_id_of(self.storage, self.study_name, number)
        self.storage.record_heartbeat(self.trials[number])

    def discard(self, number: int) -> None:
        self.trials.pop(number, None)

    def _beat(self) -> None:
        while not self.stopped.wait(self.interval_s):
            for trial_id in list(self.trials.values()):
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception as e:  # noqa: BLE001 - a database hiccup must not end the beat (the trial would go stale)
                    print(f"warning: heartbeat of trial id {trial_id} not recorded ({database_problem(e)[:300]}); "
                          "retrying", flush=True)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=30)


def made_up(spec: SweepSpec, study: Any, storage: Any) -> list[int]:
    """Fail the study's dead trials, each made up once by whichever runner fails it: those whose heartbeat is
    stale (Optuna's fail_stale_trials calls `make_up`, the storage's stale-trial callback) and those whose runner,
    recorded on the trial, was a process of this machine that is gone (now, without waiting for the grace period).
    Returns the trials this runner made up."""
    fail_stale(study)  # its callback prints and returns nothing: counted by the lines below for this machine's ones
    lost = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get(ATTR_RUNNER)
        if not owner or Runner(**owner).alive():  # another machine's (its heartbeat says), or alive here
            continue
        trial_id = trial_id_of(storage, spec.name, t.number)
        try:  # one row update under the database's lock: one runner wins
            won = storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            won = False
        if won:
            make_up(spec, study, t, f"its runner (pid {owner['pid']} on {owner['host']}) is gone")
            lost.append(t.number)
    return lost


def trial_id_of(storage: Any, study_name: str, number: int) -> int:
    """The storage's id of trial `number` of a study (public storage API: a Trial's own id is private)."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study_name), number)


def trial_state(storage: Any, study_name: str, number: int) -> TrialState:
    return storage.get_trial(trial_id_of(storage, study_name, number)).state


def make_up(spec: SweepSpec, study: Any, trial: Any, why: str = "no heartbeat from its runner") -> None:
    """A dead trial (just failed by this runner alone): its runs tagged interrupted (RUNNING ones ended KILLED,
    resumable), then its values enqueued again, so the next trial asked, by any runner, makes it up."""
    uri = spec.tracking_uri
    for r in tracking.find_runs(uri, spec.name, {keys.TAG_SWEEP: spec.name, keys.TAG_TRIAL: str(trial.number)}):
        tracking.set_tags(uri, r.info.run_id, {keys.TAG_TRIAL_STATE: "FAIL", keys.TAG_TRIAL_OUTCOME: "interrupted"})
        if r.info.status == "RUNNING":
            tracking.end_run(uri, r.info.run_id, "KILLED")
    study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
    shown = ", ".join(f"{k}={fmt_value(v)}" for k, v in trial.params.items())
    print(f"[sweep {spec.name}] trial {trial.number} {shown}: {why}; made up with the same values", flush=True)


def run_objectives(uri: str, outcome: Outcome, objectives: list[StudyObjective], *, log: bool) -> dict[str, float]:
    """A finished run's `objectives` (harness.summary over its logged steps; `collapsed` from its flag), NaN
    where it logged no value; with `log`, each also logged on the run as study/<name> at its last step."""
    values, histories = {}, {}
    for o in objectives:
        if o.stat == "collapsed":
            values[o.name] = float(outcome.collapsed)
            continue
        if o.metric not in histories:
            histories[o.metric] = by_step(tracking.metric_history(uri, outcome.run_id, o.metric))
        values[o.name] = reduce_run([v for v in histories[o.metric] if math.isfinite(v)], o.stat)
    finite = {f"{keys.STUDY_PREFIX}{k}": v for k, v in values.items() if math.isfinite(v)}
    if log and finite:
        tracking.MetricLogger(uri, outcome.run_id).log(finite, step=max(1, outcome.steps_done))
    return values


def _running(series: dict[int, float], step: int, last: int) -> float:
    values = [v for t, v in sorted(series.items()) if t <= step and math.isfinite(v)]
    return fmean(values[-last:]) if values else math.nan


def _run_of(uri: str, experiment: str, task: Task) -> Any:
    runs = tracking.find_runs(uri, experiment, task.tags)
    return runs[-1] if runs else None
