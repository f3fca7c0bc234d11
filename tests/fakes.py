"""A fake training task for the runners' own semantics (harness.study.register_task_kind): it logs a
train run to the real MLflow store as harness.train would (its tags, one point per metric per step,
a checkpoint every step, resumed into the same run, KILLED when the runner is gone), but each step is
a sleep of STEP_S instead of PPO. Its values are a function of the variant, seed and step alone, so a
resumed run can be checked point for point against `expected_points`.

Used in-process by the fixture `fake_training` (tests/conftest.py) and, for a runner in a process of
its own, by `python tests/fakes.py MODULE ARGS...` (`runner_command`), which registers it before it
runs the module's main."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from harness import keys as K
from harness import statefile, tracking
from harness.study import Outcome, Task, register_task_kind

HERE = Path(__file__).resolve().parent
STEP_S = 0.05  # one fake step; a 40-step run is 2 s in flight
FAIL_MARK = "fails"
"""A variant whose name holds this ends FAILED at step 2 (a non-finite loss, as harness.train ends it)."""
LOGGED = (K.RM_SCORE, K.GOLD_SCORE, K.KL)


def value(key: str, variant: str, seed: int, step: int) -> float:
    """The fake metric `key` of a run at `step`: deterministic, distinct per variant and seed."""
    return round(sum(map(ord, variant + key)) % 97 / 100 + seed / 10 + step / 1000, 6)


def expected_points(variant: str, seed: int, steps: int) -> dict[str, list[tuple[int, float]]]:
    return {k: [(s, value(k, variant, seed, s)) for s in range(1, steps + 1)] for k in LOGGED}


def fake_train(task: Task, on_step: Callable[..., bool]) -> Outcome:
    cfg, log = task.cfg, task.cfg["logging"]
    uri, steps = log["tracking_uri"], int(cfg["ppo"]["steps"])
    variant, seed = log["tags"].get(K.TAG_VARIANT, "trial"), int(cfg["seed"])
    run_dir = Path(log["output_dir"]) / log["run_name"]
    run_dir.mkdir(parents=True, exist_ok=True)
    state = run_dir / "fake_state.json"
    if task.resume and state.exists():
        saved = json.loads(state.read_text())
        run_id, start = saved["run_id"], saved["step"]
        # as harness.train's RunLog: a step logged before its checkpoint was written (killed in between) is
        # replayed, not logged a second time
        logged = tracking.last_logged_steps(uri, run_id)
        tracking.reopen_run(uri, run_id)
    else:
        parent = {"mlflow.parentRunId": p} if (p := task.parent_run_id or log.get("parent_run_id")) else {}
        run_id = tracking.start_run(uri, log["experiment"], log["run_name"],
                                    tags={**log["tags"], **task.tags, K.TAG_ROLE: "train", K.TAG_SEED: str(seed), **parent})
        start, logged = 0, {}
        statefile.write_json(state, {"run_id": run_id, "step": 0})  # as harness.train's run.json: a run killed
        # before its first step is resumed into the same run, from step 0
    tracking.set_tags(uri, run_id, {K.TAG_PID: str(os.getpid())})
    logger = tracking.MetricLogger(uri, run_id)
    interrupted = False
    try:
        for step in range(start + 1, steps + 1):
            time.sleep(STEP_S)
            if FAIL_MARK in variant and step == 2:
                tracking.set_tags(uri, run_id, {K.TAG_FAILURE: "non-finite loss (fake)"})
                tracking.end_run(uri, run_id, "FAILED")
                return Outcome(task.key, task.label, "FAILED", run_id, step - 1, error="non-finite loss (fake)")
            metrics = {k: value(k, variant, seed, step) for k in LOGGED}
            if new := {k: v for k, v in metrics.items() if step > logged.get(k, -1)}:
                logger.log(new, step=step)
            statefile.write_json(state, {"run_id": run_id, "step": step})  # a checkpoint every step, whole or not at all
            on_step(step, metrics)
    except KeyboardInterrupt:
        interrupted = True  # ended KILLED outside this block, as harness.train does (tracking.release_interrupted_writes)
    if interrupted:
        tracking.release_interrupted_writes()
        tracking.end_run(uri, run_id, "KILLED")
        raise KeyboardInterrupt
    tracking.set_tags(uri, run_id, {K.TAG_COLLAPSED: "false"})
    tracking.end_run(uri, run_id, "FINISHED")
    return Outcome(task.key, task.label, "FINISHED", run_id, steps)


def runner_command(module: str, *argv: str) -> list[str]:
    """The command line of a runner (`python -m module argv`) whose train tasks are fake."""
    return [sys.executable, str(HERE / "fakes.py"), module, *argv]


if __name__ == "__main__":
    import importlib

    from fakes import fake_train as by_name  # pickled by its module's name, which the workers import

    register_task_kind("train", by_name)
    # this process runs fake tasks alone: its fork server imports what they need, not the trainer's torch and
    # transformers (~5 s of a core per runner process)
    from harness.launch import run_context

    run_context().set_forkserver_preload(["fakes", "mlflow.store.tracking.sqlalchemy_store", "sqlalchemy.dialects.sqlite"])
    sys.exit(importlib.import_module(sys.argv[1]).main(sys.argv[2:]))
