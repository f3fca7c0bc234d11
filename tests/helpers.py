"""Helpers the test modules share (plain functions; fixtures live in conftest.py): the tiny two-variant
grid and the tiny sweep files, and runners started as a user starts them, in processes of their own."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

from harness import keys as K
from harness import tracking

REPO = Path(__file__).resolve().parents[1]
# the shared data folder lies beside the checkout (../shared), in CI too
HH = REPO.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"


def hh_texts(n: int) -> list[str]:
    """The first n chosen dialogues of the HH-RLHF sample."""
    import gzip
    import json

    with gzip.open(HH, "rt") as f:
        return [json.loads(line)["chosen"] for _, line in zip(range(n), f)]


def word_tokenizer(n_texts: int, vocab: int, specials: list[str]):
    """A word-level `tokenizers.Tokenizer` trained on the first n_texts HH-RLHF dialogues (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.train_from_iterator(hh_texts(n_texts), trainers.WordLevelTrainer(vocab_size=vocab, special_tokens=specials))
    return tk


def hh_tokenizer(n_texts: int, vocab: int):
    """`word_tokenizer` as a transformers tokenizer with <pad>, <eos> and <unk>, as a GPT-2-style model saves it."""
    from transformers import PreTrainedTokenizerFast

    tk = word_tokenizer(n_texts, vocab, ["<pad>", "<eos>", "<unk>"])
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


VARIANTS = ["reward scale", "reward normalize, δ=0.8"]
STEPS = 20  # long enough that a run past step 2 is still in flight when the kill test kills it


def tiny_grid(tmp_path: Path, world: Path, name: str, extra_variant: str = "") -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"""
name: {name}
figure: "6"
title: tiny two-variant grid
base: bases/vanilla.yaml
set:
  data.world_dir: {world}
  data.eval_prompts: 8
  ppo.steps: {STEPS}
  ppo.rollout_batch_size: 8
  ppo.num_minibatches: 2
  ppo.ppo_epochs: 1
  generation.max_new_tokens: 8
  logging.eval_every: 2
  logging.sample_every: 0
  logging.checkpoint_every: 1
seeds: [0]
variants:
  - name: "{VARIANTS[0]}"
    set: {{reward.scale: true}}
  - name: "{VARIANTS[1]}"
    set: {{reward.normalize: true, reward.clip: 0.8}}
{extra_variant}
""")
    return p


PPO_MAX = REPO / "ablations" / "bases" / "ppo_max.yaml"

DELTA_ETA = """\
  reward.clip: {low: 0.1, high: 10.0, log: true}
  ppo.kl_coef: {low: 0.001, high: 0.5, log: true}
"""


def write_sweep(tmp_path: Path, world: Path, name: str, *, space: str = DELTA_ETA, trials: int = 4,
                steps: int = 2, extra: str = "", output_dir: bool = True) -> Path:
    p = tmp_path / f"{name.replace('/', '_')}.yaml"
    p.write_text(f"""\
name: {name}
base: {PPO_MAX}
set:
  data.world_dir: {world}
  data.eval_prompts: 8
  ppo.rollout_batch_size: 8
  ppo.num_minibatches: 2
  ppo.ppo_epochs: 1
  ppo.critic_pretrain_steps: 0
  generation.max_new_tokens: 8
  logging.eval_every: 0
  logging.sample_every: 0
  logging.checkpoint_every: 0
{f"  logging.output_dir: {tmp_path / 'runs'}" if output_dir else "  # logging.output_dir: the default"}
  logging.progress: false
steps: {steps}
trials: {trials}
sampler: {{name: tpe, seed: 0, n_startup_trials: 2}}
objective: {{last_steps: 2}}
search_space:
{space}{extra}""")
    return p


def store_uri(folder: Path) -> str:
    return f"sqlite:///{folder / 'mlflow.db'}"


def grid_argv(store: Path, path: Path, *more: str) -> list[str]:
    return [str(path), "--tracking-uri", store_uri(store), "--runs-dir", str(store / "runs"), "--threads", "1",
            "--no-progress", *more]


def runs_in(uri: str, experiment: str, role: str = "train") -> list:
    """Runs of the experiment with this harness.role, oldest first ([] before it exists). The client
    creates a new store under the lock the runners take."""
    c = tracking.client(uri)
    exp = c.get_experiment_by_name(experiment)
    found = c.search_runs([exp.experiment_id], f"tags.`{K.TAG_ROLE}` = '{role}'") if exp else []
    return sorted(found, key=lambda r: r.info.start_time)


def last_step(uri: str, run_id: str) -> int:
    return max((m.step for m in tracking.client(uri).get_metric_history(run_id, K.RM_SCORE)), default=0)


def points(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """metric -> every logged (step, value), in step order (perf/ timings left out)."""
    c = tracking.client(uri)
    return {k: sorted((m.step, m.value) for m in c.get_metric_history(run_id, k))
            for k in c.get_run(run_id).data.metrics if not k.startswith("perf/")}


def logged_twice(pts: dict[str, list[tuple[int, float]]]) -> list[str]:
    return [f"{k}@{s}" for k, p in pts.items() for s, n in Counter(s for s, _ in p).items() if n > 1]


def assert_resumed_like(uri: str, run_id: str, want: dict[str, list[tuple[int, float]]]) -> None:
    """The resumed run holds every point of the uninterrupted one (`want`: metric -> [(step, value)]),
    each once, with the same value."""
    got = points(uri, run_id)
    assert not logged_twice(got), f"points logged twice after the resume: {logged_twice(got)[:5]}"
    assert got == want


@contextlib.contextmanager
def started(module: str, argv: list[str], cwd: Path, log: Path, command: list[str] | None = None, **env: str):
    """`python -m module argv` in a session of its own (as a runner started from a shell); whatever
    of that session is still alive at the end is killed."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    with open(log, "w") as out:
        proc = subprocess.Popen(command or [sys.executable, "-m", module, *argv], cwd=cwd, env=full_env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for(found, proc: subprocess.Popen, what: str, log: Path, timeout_s: float = 300):
    """Poll `found()` until it is truthy (the runner must still be alive meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while not (hit := found()):
        assert proc.poll() is None, f"the runner ended before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    return hit


def alive_in(session: int, folder: Path) -> list[str]:
    """Processes (zombies aside) of this session, or whose command line names `folder`."""
    left = []
    for p in psutil.process_iter(["status", "cmdline"]):
        try:
            mine = os.getsid(p.pid) == session or str(folder) in " ".join(p.info["cmdline"] or [])
            if mine and p.info["status"] != psutil.STATUS_ZOMBIE and p.pid != os.getpid():
                left.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:200]}")
        except (OSError, psutil.Error):
            continue  # gone meanwhile, or not ours to see
    return left


