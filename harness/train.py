"""One training run: `python -m harness.train CONFIG.yaml [--set key=value ...] [--resume]`, from
config checks to the MLflow run's end (FAILED with the reason when anything goes wrong)."""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import textwrap
import time
import traceback
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from filelock import FileLock, Timeout

from . import keys, parallel, prog, provenance, statefile, tracking
from .algorithms import names
from .algorithms.estimators import NEEDS_CRITIC
from .config import (
    ConfigError,
    TrainConfig,
    computed_fields,
    config_hash,
    flatten,
    help_text,
    load_config,
    to_dict,
    to_yaml,
)
from .detector import fingerprint
from .metrics import Monitor

OnStep = Callable[[int, dict[str, float]], bool]


@dataclass
class RunResult:
    run_id: str
    status: str  # FINISHED | FAILED | KILLED
    steps_done: int
    collapsed: bool = False
    collapse_step: int | None = None
    final_metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    run_dir: str = ""


def default_run_name(cfg: TrainConfig) -> str:
    return f"{cfg.logging.experiment}-{cfg.ppo.policy_loss}-seed{cfg.seed}"


# ------------------------------------------------------------------ run files and checkpoints
RUN_FILE = "run.json"  # run_id, config_hash, status, step, config: the run folder's link to its MLflow run
CHECKPOINTS = ("state.pt", "state.prev.pt")  # the latest and the one before it
BEST_POLICY = "best_policy.pt"  # the run dir's policy weights at its best eval before collapse
RUN_LOCK = "run.lock"  # held by the process that trains the run (rank 0)
RUN_LOCK_WAIT_S = 120.0  # a worker whose runner died ends its run within seconds; wait that long for it


def save_checkpoint(run_dir: Path, state: dict) -> None:
    """Write to a temp file and rename, so a kill mid-save leaves the previous checkpoint intact;
    the one before is kept too, for a latest one damaged later (a full disk, a bad copy)."""
    ckpt = run_dir / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    tmp = ckpt / "state.pt.tmp"
    torch.save(state, tmp)
    if (ckpt / CHECKPOINTS[0]).exists():
        os.replace(ckpt / CHECKPOINTS[0], ckpt / CHECKPOINTS[1])
    os.replace(tmp, ckpt / CHECKPOINTS[0])


def load_checkpoint(run_dir: Path) -> dict | None:
    """The newest readable checkpoint of run_dir (falling back to the previous one, and saying so),
    or None when there is none or none can be read (the run then restarts from step 0)."""
    tried = []
    for name in CHECKPOINTS:
        f = run_dir / "ckpt" / name
        if not f.exists():
            continue
        try:
            # weights_only: tensors, numbers, strings and containers only; no pickled code is executed
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - truncated, empty or not a checkpoint at all
            tried.append(f"{f}: unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else 'empty'})")
            continue
        if tried:
            print(f"[harness] {'; '.join(tried)}; resuming from the previous checkpoint {f} (step {state.get('step')})",
                  file=sys.stderr)
        return state
    if tried:
        print(f"[harness] {'; '.join(tried)}; no readable checkpoint left: restarting the run from step 0", file=sys.stderr)
    return None


class RunLog:
    """Rank 0's side of a run: its MLflow run, `run.json` and the checkpoint file."""

    def __init__(self, uri: str, run_id: str, run_dir: Path, info: dict, logged: dict[str, int] | None = None):
        self.uri, self.run_id, self.run_dir, self.info = uri, run_id, run_dir, info
        self.logger = tracking.MetricLogger(uri, run_id)
        # a resumed run replays the steps after its checkpoint with identical numbers, and one without
        # a checkpoint replays everything from its start (critic pretraining, the step-0 eval): the
        # points the store already holds, per metric key up to its last logged step, are not logged twice
        self.logged = logged or {}
        self._write()

    def _write(self, **info) -> None:
        """RUN_FILE, replaced atomically (a kill, a crash or a full disk mid-write leaves the previous one)."""
        self.info.update(info)
        statefile.write_json(self.run_dir / RUN_FILE, self.info, indent=1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        new = {k: v for k, v in metrics.items() if step > self.logged.get(k, -1)}
        if new:
            self.logger.log(new, step=step)

    def tags(self, tags: dict[str, str]) -> None:
        tracking.set_tags(self.uri, self.run_id, tags)

    def artifact(self, obj: dict, path: str) -> None:
        tracking.log_json_artifact(self.uri, self.run_id, obj, path)

    def save_best(self, weights: dict, step: int) -> None:
        """BEST_POLICY (temp file, then rename) and its step as tag harness.best_step."""
        torch.save(weights, self.run_dir / f"{BEST_POLICY}.tmp")
        os.replace(self.run_dir / f"{BEST_POLICY}.tmp", self.run_dir / BEST_POLICY)
        self.tags({keys.TAG_BEST_STEP: str(step)})

    def checkpoint(self, state: dict, step: int) -> None:
        # the checkpoint names its run: a folder reused by another run never resumes this one's weights
        save_checkpoint(self.run_dir, {**state, "run_id": self.run_id, "config_hash": self.info["config_hash"]})
        self._write(step=step)

    def end(self, status: str, error: str | None = None, tb: str = "") -> None:
        try:
            if error:
                tracking.set_tags(self.uri, self.run_id, {keys.TAG_FAILURE: error[:4000]})
                tracking.log_text_artifact(self.uri, self.run_id, tb, "failure_traceback.txt")
        finally:
            tracking.end_run(self.uri, self.run_id, status)
        self._write(status=status, **({"error": error} if error else {}))


class NullRunLog(RunLog):
    """The other ranks: the same calls, nothing logged or written (rank 0 speaks for the job)."""

    def __init__(self) -> None:
        self.run_id = None

    def _ignore(self, *args, **kwargs) -> None:
        pass

    log = tags = artifact = save_best = checkpoint = end = _ignore


def _read_run_file(cfg: TrainConfig, run_dir: Path, chash: str) -> dict | None:
    """run_dir's RUN_FILE for --resume (None when there is none). One that cannot be read (cut short
    by a crash or a full disk, a bad copy) is replaced by what the store knows: the newest MLflow
    run of this name and config hash (tag harness.config_hash) is continued from the checkpoint;
    with none there the run starts over from step 0. Either way it says so, naming the file."""
    try:
        return statefile.read_json_object(run_dir / RUN_FILE)
    except FileNotFoundError:
        return None
    except statefile.StateFileError as e:
        problem = str(e)
    uri, name = cfg.logging.tracking_uri, run_dir.name
    same = [r for r in tracking.find_runs(uri, cfg.logging.experiment, {keys.TAG_CONFIG_HASH: chash})
            if r.info.run_name == name]
    where = f"the store {tracking.redact(uri)}, experiment {cfg.logging.experiment!r}"
    if not same:
        print(f"[harness] {problem}; {where} holds no run named {name!r} with config hash {chash}: "
              "starting the run over from step 0", file=sys.stderr)
        return None
    run_id = same[-1].info.run_id  # the newest
    print(f"[harness] {problem}; continuing MLflow run {run_id} (found in {where} by its name {name!r} and "
          f"config hash {chash}) from its checkpoint", file=sys.stderr)
    return {"run_id": run_id, "config_hash": chash}


def _open_run(cfg: TrainConfig, run_dir: Path, resume: bool) -> tuple[RunLog, dict | None]:
    """Rank 0: reopen the run of the checkpoint in run_dir (resume, same config), else start a new one.

    --resume of a folder whose run had another config is refused, naming the keys that differ:
    continuing it would mix two configs in one run, and starting over would destroy it. Once the
    run exists, a failure here ends it FAILED (never left RUNNING)."""
    log, uri, chash = cfg.logging, cfg.logging.tracking_uri, config_hash(cfg)
    flat = computed_fields(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_info = _read_run_file(cfg, run_dir, chash) if resume else None
    if run_info is not None and run_info.get("config_hash") != chash:
        old = run_info.get("config") or dict(flat)  # a run.json of an older harness holds no config to compare
        diff = [f"{k}: {old.get(k)!r} -> {flat.get(k)!r}" for k in sorted(set(old) | set(flat)) if old.get(k) != flat.get(k)]
        raise ConfigError([f"--resume: {run_dir} holds run {run_info.get('run_id')} of another config ("
                           + ("; ".join(diff) if diff else "config hash differs") + "); resume it with its own config, "
                           "or give this one another logging.run_name"])
    state = load_checkpoint(run_dir) if run_info is not None else None
    if state is not None and state.get("run_id", run_info.get("run_id")) != run_info.get("run_id"):
        print(f"[harness] {run_dir}/ckpt holds the checkpoint of run {state['run_id']}, not of run "
              f"{run_info.get('run_id')} ({RUN_FILE}): restarting the run from step 0", file=sys.stderr)
        state = None
    if run_info is not None and run_info.get("run_id") and tracking.run_exists(uri, run_info["run_id"]):
        run_id = run_info["run_id"]
        logged = tracking.last_logged_steps(uri, run_id)
        tracking.reopen_run(uri, run_id)
        tracking.set_tags(uri, run_id, {keys.TAG_PID: str(os.getpid())})
    else:
        state, logged = None, {}
        tags = {
            keys.TAG_SEED: str(cfg.seed), keys.TAG_COMMIT: tracking.git_commit(), keys.TAG_CONFIG_HASH: chash,
            keys.TAG_POLICY_LOSS: cfg.ppo.policy_loss, keys.TAG_ROLE: "train",
            keys.TAG_ADV_ESTIMATOR: cfg.ppo.adv_estimator,
            keys.TAG_CRITIC_FREE: str(cfg.ppo.adv_estimator not in NEEDS_CRITIC).lower(), keys.TAG_PID: str(os.getpid()),
            **provenance.record(cfg.data.world_dir if cfg.data.source == "world" else None), **log.tags,
        }
        run_id = tracking.start_run(uri, log.experiment, run_dir.name, tags=tags, parent_run_id=log.parent_run_id)
        with _failing_run(uri, run_id):
            tracking.log_params(uri, run_id, flatten(to_dict(cfg)))
            tracking.log_text_artifact(uri, run_id, to_yaml(cfg), keys.ARTIFACT_CONFIG)
    info = {"run_id": run_id, "config_hash": chash, "status": "RUNNING", "step": 0, "config": flat}
    with _failing_run(uri, run_id):
        return RunLog(uri, run_id, run_dir, info, logged), state


@contextlib.contextmanager
def _failing_run(uri: str, run_id: str):
    """An exception inside ends the run FAILED with its reason (then propagates): a run whose
    process went on without it must not stay RUNNING."""
    try:
        yield
    except Exception as e:
        with contextlib.suppress(Exception):  # the store itself may be what failed
            tracking.set_tags(uri, run_id, {keys.TAG_FAILURE: f"{type(e).__name__}: {e}"[:4000]})
            tracking.end_run(uri, run_id, "FAILED")
        raise


class BestPolicy:
    """Paper App. A: the best model comes before collapse. Keeps the policy weights of the best held-out
    score (eval gold, or eval RM score without a gold reward) among the evals made before the collapse
    rule fired, in run_dir/BEST_POLICY; `state` ([step, score]) travels in the checkpoint."""

    def __init__(self) -> None:
        self.state: list = [None, None]

    def offer(self, trainer, run: RunLog, step: int, evals: dict[str, float], collapsed: bool) -> None:
        score = evals.get(keys.EVAL_GOLD, evals.get(keys.EVAL_RM))
        if (not trainer.cfg.logging.keep_best or collapsed or score is None
                or (self.state[1] is not None and score <= self.state[1])):
            return
        self.state = [step, score]
        run.save_best(trainer.policy.full_state()[0], step)  # full_state: collective under ZeRO


def store_problems(cfg: TrainConfig) -> list[str]:
    """What the run needs of its MLflow store, checked before the run exists: the parent run
    (logging.parent_run_id), when one is named, is in that store."""
    parent, uri = cfg.logging.parent_run_id, cfg.logging.tracking_uri
    if parent and not tracking.run_exists(uri, parent):
        return [f"logging.parent_run_id: got {parent!r}; the store {tracking.redact(uri)} holds no run with that id; "
                "allowed: the id of a run in that store (the parent the run is nested under), or null"]
    return []


# ------------------------------------------------------------------ the run
def train(cfg: TrainConfig, *, resume: bool = False, on_step: OnStep | None = None) -> RunResult:
    """Run PPO (or APA/AWR) to `cfg.ppo.steps`; see docs/CONTRACTS.md. Never raises on divergence.

    Every rank of a launched job calls this: rank 0 opens the MLflow run and writes the run files,
    the other ranks train alongside it with a `NullRunLog`."""
    # the store is the config's: a CLI resolves it at its edge (--tracking-uri, else $MLFLOW_TRACKING_URI,
    # else the file's) and a runner hands its own to every run; null = MLflow's convention
    cfg = replace(cfg, logging=replace(cfg.logging, tracking_uri=cfg.logging.tracking_uri or tracking.resolve_uri()))
    # ConfigError here, before any model or MLflow run, when the hardware or launch cannot run cfg;
    # joins the process group when started by torchrun / deepspeed
    env = parallel.setup(cfg)
    from .models import preflight  # paths, models and vocabularies, before any MLflow run exists

    problems = preflight(cfg)  # on every rank, so that all of them stop together
    # what the run needs of the store (rank 0's): rank 0 checks, every rank hears the answer
    problems += env.broadcast_object(store_problems(cfg) if env.is_main and not problems else [])
    if problems:
        raise ConfigError(problems)
    run_dir = Path(cfg.logging.output_dir) / (cfg.logging.run_name or default_run_name(cfg))
    with _run_folder_lock(run_dir, env):
        return _train(cfg, env, run_dir, resume, on_step)


@contextlib.contextmanager
def _run_folder_lock(run_dir: Path, env: parallel.DistEnv):
    """Rank 0 holds the run folder's lock while it trains: two processes never train one run (a
    worker whose runner died, still finishing, and the rerun that resumes its run)."""
    if not env.is_main:
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(run_dir / RUN_LOCK)
    try:
        lock.acquire(timeout=RUN_LOCK_WAIT_S)
    except Timeout:
        raise ConfigError([f"logging.run_name: {run_dir} is being trained by another process (lock {lock.lock_file} "
                           f"held for {RUN_LOCK_WAIT_S:.0f} s); wait for it to end, or give this run another name"]) from None
    try:
        yield
    finally:
        lock.release()


def _train(cfg: TrainConfig, env: parallel.DistEnv, run_dir: Path, resume: bool, on_step: OnStep | None) -> RunResult:
    run, state = _open_run(cfg, run_dir, resume) if env.is_main else (NullRunLog(), None)
    shared = env.broadcast_object({"run_id": run.run_id, "resumed": state is not None})
    if shared["resumed"] and not env.is_main:
        state = load_checkpoint(run_dir)
        if state is None:
            raise FileNotFoundError(f"rank {env.rank}: rank 0 resumes {run_dir}/ckpt/state.pt but this rank cannot read it "
                                    "(logging.output_dir must be on a shared filesystem)")
    result = RunResult(run_id=shared["run_id"], status="RUNNING", steps_done=0, run_dir=str(run_dir))
    interrupted = False
    try:
        _train_loop(cfg, env, run, run_dir, state, on_step, result)
    except KeyboardInterrupt:
        interrupted = True  # the run is ended KILLED below, outside this block (tracking.release_interrupted_writes)
    except Exception as e:  # noqa: BLE001 - a failed run must never take its caller down
        # redacted here: the reason travels to the caller (a grid runner's process, its summary)
        result.status, result.error = "FAILED", tracking.redact(f"{type(e).__name__}: {e}")
        run.end("FAILED", result.error, traceback.format_exc())
        if cfg.logging.progress or not env.is_main:
            print(f"[harness] run {run_dir.name} (rank {env.rank}) FAILED: {result.error}", file=sys.stderr)
        return result
    if interrupted:
        tracking.release_interrupted_writes()
        result.status = "KILLED"
        run.end("KILLED")
        raise KeyboardInterrupt
    result.status = "FINISHED"
    run.end("FINISHED")
    return result


def _train_loop(cfg: TrainConfig, env: parallel.DistEnv, run: RunLog, run_dir: Path, state: dict | None,
                on_step: OnStep | None, result: RunResult) -> None:
    from .data import load_source
    from .models import Models
    from .trainer import PPOTrainer

    log = cfg.logging
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = parallel.device_of(cfg)
    trainer = PPOTrainer(cfg, Models(cfg, device), load_source(cfg), device, env)
    detector = Monitor(cfg.collapse, has_gold=trainer.source.gold is not None, has_audit=bool(trainer.audit))
    best, start_step = BestPolicy(), 0

    def evaluate(step: int) -> dict[str, float]:
        evals = _evaluate(trainer, run, step)
        best.offer(trainer, run, step, evals, detector.event is not None)
        return evals

    if state is not None:
        trainer.load_state_dict(state)
        detector.load_state_dict(json.loads(state["detector"]))
        best.state, start_step = json.loads(state["best"]), int(state["step"])
        # what the checkpoint's steps did: a collapse before it (flagged once, never again), and its
        # step when none is left to train (a run killed after its last checkpoint, before its end)
        result.steps_done = start_step
        if detector.event is not None:
            result.collapsed, result.collapse_step = True, detector.event.step
    else:
        trainer.seed_reward_stats()
        for k in range(cfg.ppo.critic_pretrain_steps):
            m = trainer.pretrain_critic()
            run.log({f"critic_pretrain/{key.split('/')[-1]}": v for key, v in m.items() if key.startswith("val/")}, step=k)
        if log.eval_every:
            run.log(evaluate(0), step=0)

    if detector.detector is not None:  # the detector it runs with (a resumed run's: the one it started with)
        run.tags({keys.TAG_DETECTOR: fingerprint(detector.detector.params)})

    def checkpoint(step: int) -> None:
        # trainer.state_dict() is collective under ZeRO: every rank gathers, rank 0 writes
        run.checkpoint({**trainer.state_dict(), "step": step, "detector": json.dumps(detector.state_dict()),
                        "best": json.dumps(best.state)}, step)

    bar = None
    if log.progress and env.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.ppo.steps, initial=start_step, desc=log.run_name or "train", unit="step", dynamic_ncols=True, leave=False)
    last_log_s = 0.0
    snapshots: deque[tuple[int, dict]] = deque(maxlen=2)  # on_warning=rollback: where it goes back to
    metrics: dict[str, float] = {}
    step = start_step
    b = None
    try:
        for step in range(start_step + 1, cfg.ppo.steps + 1):
            metrics, b = trainer.step()
            t_log = time.perf_counter()
            metrics[keys.TIME_LOGGING] = last_log_s
            flags, event = detector.update(step, metrics)
            metrics.update(flags)
            action = cfg.collapse.on_warning if keys.WARNING_STEP in flags else "none"
            if action != "none":
                metrics[keys.ACTION_STEP] = step
                run.tags({keys.TAG_WARNING_ACTION: action})
                if action in ("raise_kl", "rollback"):
                    warning_action(trainer, cfg.collapse, snapshots if action == "rollback" else None)
            if event is not None:
                result.collapsed, result.collapse_step = True, event.step
                run.tags({keys.TAG_COLLAPSED: "true", keys.TAG_COLLAPSE_REASON: event.reason})
            if log.eval_every and step % log.eval_every == 0:
                metrics.update(evaluate(step))
            run.log(metrics, step=step)
            if (log.sample_every and step % log.sample_every == 0) or step == cfg.ppo.steps:
                _log_samples(trainer, b, run, step)
            last_log_s = time.perf_counter() - t_log
            result.steps_done = step
            if bar is not None:
                post = {"rm": f"{metrics[keys.RM_SCORE]:.2f}", "kl": f"{metrics[keys.KL]:.3f}"}
                if keys.GOLD_SCORE in metrics:
                    post["gold"] = f"{metrics[keys.GOLD_SCORE]:.2f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
            stop_cb = on_step(step, metrics) if on_step is not None else False
            stop_cb = parallel.agree_stop(env, stop_cb, run_dir)  # rank 0 decides (or a STOP file); all ranks follow
            if log.checkpoint_every and step % log.checkpoint_every == 0 and step < cfg.ppo.steps:
                checkpoint(step)
            if cfg.collapse.on_warning == "rollback" and step % cfg.collapse.rollback_steps == 0:
                snapshots.append((step, copy.deepcopy(trainer.state_dict())))  # collective under ZeRO
            collapse_stop = event is not None and cfg.collapse.stop_on_collapse
            stopped_by = ("callback" if stop_cb else "collapse" if collapse_stop else
                          "warning" if action == "stop" else None)
            if stopped_by:
                run.tags({keys.TAG_STOPPED: stopped_by})
                break
    finally:
        if bar is not None:
            bar.close()
    if result.steps_done and b is not None and log.sample_every and result.steps_done % log.sample_every and result.steps_done != cfg.ppo.steps:
        _log_samples(trainer, b, run, result.steps_done)
    if log.eval_every and result.steps_done % log.eval_every:
        run.log(evaluate(result.steps_done), step=result.steps_done)
    checkpoint(result.steps_done)
    if not result.collapsed:
        run.tags({keys.TAG_COLLAPSED: "false"})
    result.final_metrics = metrics


def warning_action(trainer, c, snapshots: deque | None) -> None:
    """collapse.on_warning raise_kl / rollback: back to the older of the kept snapshots (rollback: at
    least rollback_steps steps before the warning; none yet: from where it is), then a larger KL coefficient."""
    if snapshots:
        trainer.restore_models(snapshots[0][1])
    trainer.kl_ctl.value = max(trainer.kl_ctl.value * c.warning_kl_factor, c.warning_kl_min)


def _evaluate(trainer, run: RunLog, step: int) -> dict[str, float]:
    """Eval metrics (collective: every rank evaluates its shard); rank 0 logs the scores as an artifact."""
    m, scores = trainer.evaluate()
    if scores:
        run.artifact({"step": step, **scores}, f"{keys.EVAL_SCORES_DIR}/rm_scores_step_{step:06d}.json")
    return m


def _log_samples(trainer, b, run: RunLog, step: int) -> None:
    n = trainer.cfg.logging.num_samples
    if not n:
        return
    rows = [{
        "prompt": b.prompts[i], "response": b.responses[i], "rm_score": round(b.scores[i].item(), 4),
        "gold_score": None if b.gold is None else round(b.gold[i].item(), 4),
        "length": int(b.rollout.lengths[i].item()), "ended": bool(b.rollout.ended[i].item()),
    } for i in range(min(n, len(b.prompts)))]
    run.artifact({"step": step, "rows": rows}, f"{keys.SAMPLES_DIR}/step_{step:06d}.json")


# ------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog("harness.train"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            f"Train one RLHF run (policy loss {' / '.join(names.POLICY_LOSSES)}; advantage estimator "
            f"{' / '.join(names.ADV_ESTIMATORS)}) and log it to MLflow. Every trick of the paper, and the "
            "tricks after it (docs/PAPER.md), is a config key below.", 100),
        epilog="Every config key (use with --set KEY=VALUE or in the YAML file):\n" + help_text(),
    )
    ap.add_argument("config", nargs="?", help="YAML config file (optional: defaults + --set work alone)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set ppo.kl_coef=0.1 (repeatable)")
    ap.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint into the same MLflow run")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return ap


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        cfg = tracking.at_cli_edge(cfg)  # a launched job's ranks get their runner's store in the variable (harness.launch)
        if args.print_config:
            print(to_yaml(cfg))
            return 0
        result = train(cfg, resume=args.resume)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        parallel.teardown()
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 (RANK from torchrun / deepspeed) prints the summary of the job
        summary = {k: round(v, 4) for k, v in result.final_metrics.items() if k.startswith(("objective/", "response/"))}
        print(json.dumps({"run_id": result.run_id, "status": result.status, "steps": result.steps_done,
                          "collapsed": result.collapsed, "collapse_step": result.collapse_step, "error": result.error,
                          "final": summary}, indent=1))
    return 0 if result.status == "FINISHED" else 1


if __name__ == "__main__":
    sys.exit(main())
