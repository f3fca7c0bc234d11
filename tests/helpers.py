"""Helpers the test modules share (plain functions and constants; fixtures live in conftest.py): fast run
settings, the tiny two-variant grid and the tiny sweep files, runners started as a user starts them, in
processes of their own, the synthetic metric streams and the hand-set detector, the analysis tests'
registry and scratch folders, the config fuzzers' bad values, and a PDF's text. A test module imports
these from here, never from another test module (tests/test_architecture.py checks it)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import typing
from collections import Counter
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import numpy as np
import psutil
from pydantic import AfterValidator

from harness import keys as K
from harness import tracking
from harness.world.config import TINY

REPO = Path(__file__).resolve().parents[1]
"""The checkout's root."""
# the shared data folder lies beside the checkout (../shared), in CI too
HH = REPO.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
"""The HH-RLHF sample (harmless-base test split, gzipped JSON lines)."""


def fast_overrides(world_dir, tmp_path, **extra) -> list[str]:
    """Config overrides for a run of a few seconds on the tiny world, logging into tmp_path."""
    base = {
        "data.world_dir": str(world_dir),
        "data.eval_prompts": 8,
        "ppo.steps": 4,
        "ppo.rollout_batch_size": 8,
        "ppo.num_minibatches": 2,
        "ppo.ppo_epochs": 1,
        "generation.max_new_tokens": 12,
        "logging.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "logging.output_dir": str(tmp_path / "runs"),
        "logging.eval_every": 2,
        "logging.sample_every": 2,
        "logging.checkpoint_every": 2,
        "logging.progress": False,
        "threads": 1,
    }
    base.update(extra)
    return [f"{k}={'null' if v is None else v}" for k, v in base.items()]


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


MICRO = {
    **TINY,
    "corpus.pretrain_docs": 200, "corpus.sft_examples": 200,
    "pretrain.steps": 4, "sft.steps": 4, "rm.steps": 4, "rm.eval_every": 2,
    "prefs.train_pairs": 48, "prefs.eval_pairs": 24,
}
"""A world smaller still than TINY (1.5 s of a core to build against 6.8): for tests of files, hashes and bookkeeping
that build worlds of their own; its models are trained 4 steps each, so barely trained."""

VARIANTS = ["reward scale", "reward normalize, δ=0.8"]
"""The two variants of `tiny_grid`."""
STEPS = 20  # long enough that a run past step 2 is still in flight when the kill test kills it
"""Steps of each run of `tiny_grid`."""


def tiny_grid(tmp_path: Path, world: Path, name: str, extra_variant: str = "") -> Path:
    """A figure file tmp_path/NAME.yaml: the two VARIANTS, seed 0, STEPS steps on `world` at the tiny sizes
    (`extra_variant`: YAML appended to its variants)."""
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
"""The PPO-max base the tiny sweeps start from."""

DELTA_ETA = """\
  reward.clip: {low: 0.1, high: 10.0, log: true}
  ppo.kl_coef: {low: 0.001, high: 0.5, log: true}
"""
"""A search space of two log-scaled parameters, the reward clip δ and the KL coefficient η."""


def write_sweep(tmp_path: Path, world: Path, name: str, *, space: str = DELTA_ETA, trials: int = 4,
                steps: int = 2, extra: str = "", output_dir: bool = True) -> Path:
    """A sweep file on `world` at the tiny sizes from PPO_MAX: `trials` TPE trials of `steps` steps over
    `space` (`extra`: YAML appended; `output_dir`: run folders under tmp_path/runs, else the default)."""
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


def sqlite_uri(path: Path | str) -> str:
    """A SQLite database file as an MLflow tracking URI or an Optuna storage URL (the one place the scheme is spelled)."""
    return f"sqlite:///{path}"


def store_uri(folder: Path) -> str:
    """The SQLite MLflow store folder/mlflow.db as a tracking URI."""
    return sqlite_uri(folder / "mlflow.db")


def study_storage(folder: Path) -> str:
    """The Optuna storage folder/optuna.db (a sweep's default: next to its MLflow sqlite file)."""
    return sqlite_uri(folder / "optuna.db")


def grid_argv(store: Path, path: Path, *more: str) -> list[str]:
    """harness.ablate's arguments for the figure file `path`, its store and run folders in `store`."""
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
    """The last step the run logged its RM score at (0 before any)."""
    return max((m.step for m in tracking.client(uri).get_metric_history(run_id, K.RM_SCORE)), default=0)


def points(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """metric -> every logged (step, value), in step order (perf/ timings left out)."""
    c = tracking.client(uri)
    return {k: sorted((m.step, m.value) for m in c.get_metric_history(run_id, k))
            for k in c.get_run(run_id).data.metrics if not k.startswith("perf/")}


def logged_twice(pts: dict[str, list[tuple[int, float]]]) -> list[str]:
    """metric@step for every step `pts` (from `points`) holds more than one value of a metric."""
    return [f"{k}@{s}" for k, p in pts.items() for s, n in Counter(s for s, _ in p).items() if n > 1]


def assert_resumed_like(uri: str, run_id: str, want: dict[str, list[tuple[int, float]]]) -> None:
    """The resumed run holds every point of the uninterrupted one (`want`: metric -> [(step, value)]),
    each once, with the same value."""
    got = points(uri, run_id)
    assert not logged_twice(got), f"points logged twice after the resume: {logged_twice(got)[:5]}"
    assert got == want


def foreground_signals() -> None:
    """In a child before it starts: Ctrl-C's default, as a terminal's foreground job has it, whatever the test run
    inherited (a suite started in the background, `cmd &`, runs with SIGINT ignored, and so would its children)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def started(module: str, argv: list[str], cwd: Path, log: Path, command: list[str] | None = None, **env: str):
    """`python -m module argv` in a session of its own (as a runner started from a shell's foreground); whatever
    of that session is still alive at the end is killed."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    with open(log, "w") as out:
        proc = subprocess.Popen(command or [sys.executable, "-m", module, *argv], cwd=cwd, env=full_env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=foreground_signals)
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


def stream(n: int, *, at: int | None = None, rate: float = 1.0, seed: int = 0, entropy: float = 1.4,
           cap: int = 24) -> list[dict[str, float]]:
    """Per-step metrics of a run: healthy until `at` (KL creeps, perplexities hold), then the paper's
    pattern (KL climbs, perplexity and entropy fall, lengths run to the cap, RM score climbs), faster
    with `rate`; noise of a 32-response batch. The samples' diversity (harness.signals) falls with it: fewer
    distinct words and bigrams, more repeated bigrams (its own noise, so the other signals' draws stay as they were)."""
    rng, div = np.random.default_rng(seed), np.random.default_rng([seed, 1])
    out = []
    for t in range(1, n + 1):
        a = 0.0 if at is None else max(0.0, t - at) * 0.05 * rate
        kl = 0.002 * t + a * entropy
        d1, d2, rep = div.standard_normal(3) * 0.01
        out.append({
            K.DISTINCT_1: 0.35 * math.exp(-0.3 * a) + d1, K.DISTINCT_2: 0.7 * math.exp(-0.4 * a) + d2,
            K.REPEATED_2GRAM: min(1.0, 0.05 + 0.2 * a + abs(rep)),
            K.KL_K3: kl * (1 + 0.05 * rng.standard_normal()), K.KL: kl, K.ENTROPY: entropy * math.exp(-0.5 * a),
            K.PPL_TOKENS: 3.0 * math.exp(-0.4 * a) * (1 + 0.02 * rng.standard_normal()),
            K.PPL: 3.0 * math.exp(-0.4 * a), K.PPL_REF: 3.2 * math.exp(0.8 * a) * (1 + 0.02 * rng.standard_normal()),
            K.LENGTH: min(cap, 12.0 * math.exp(0.3 * a)), K.LENGTH_STD: 4.0 * math.exp(-0.5 * a) + 0.1,
            K.FRAC_AT_CAP: min(1.0, 0.02 + 0.4 * a), K.RM_SCORE: 0.1 + 0.8 * a + 0.05 * rng.standard_normal(),
            K.RM_SCORE_STD: 1.0 + 0.2 * a, K.POLICY_CLIPFRAC: 0.05 + 0.05 * min(a, 2.0),
            K.APPROX_KL: 0.01 + 0.02 * a, K.GOLD_SCORE: -0.5 - 0.8 * a + 0.1 * rng.standard_normal(),
        })
    return out


def collapsing_stream(n: int, at: int) -> list[dict[str, float]]:
    """`stream` of n steps whose collapse starts at step `at`."""
    return stream(n, at=at)


def write_detector(path, threshold: float = 0.5) -> str:
    """A hand-set detector: warns once KL has grown past about half the start's entropy."""
    from harness.detector import DetectorParams

    p = DetectorParams(features=["kl"], mean=[0.0], scale=[1.0], coef=[12.0], intercept=-6.0, threshold=threshold)
    path.write_text(json.dumps(dataclasses.asdict(p)))
    return str(path)


ETAS = ["KL penalty η=0.05", "KL penalty η=0.1", "KL penalty η=0.2"]
"""The three variants of the analysis tests' KL-penalty grid (kl_eta in REGISTRY)."""
SEEDS = (0, 1, 2, 3, 4)  # stats.MIN_SEEDS: fewer seeds never decide
"""The seeds of every variant of the analysis tests' synthetic grids."""

REGISTRY = {
    "kl_eta.yaml": """
name: kl_eta
figure: "15"
order: 15
title: "Fig. 15: KL penalty eta"
kind: train
base: bases/vanilla.yaml
set: {ppo.steps: 20}
seeds: [0, 1]
grid:
  name: "KL penalty η={ppo.kl_coef}"
  axes: {ppo.kl_coef: [0.05, 0.1, 0.2]}
panels: [objective/rm_score, response/length_mean, objective/kl, objective/ppl]
claims:
  - statement: "A larger KL penalty η keeps KL lower."
    source: paper
    section: "App. B.2"
    rule: {kind: trend, metric: objective/kl, axis: ppo.kl_coef, direction: decreasing}
  - statement: "η 0.05 and 0.2 end at the same KL."
    source: ours
    rule: {kind: similar, metric: objective/kl, variants: ["KL penalty η=0.05", "KL penalty η=0.2"],
           margin: {share: 0.1, of: "KL penalty η=0.2"}, margin_reason: "a tenth of the tightest penalty's KL"}
  - statement: "Every η ends at the same RM score."
    source: ours
    rule:
      kind: similar
      metric: objective/rm_score
      variants: ["KL penalty η=0.05", "KL penalty η=0.1", "KL penalty η=0.2"]
      margin: {abs: 0.1}
      margin_reason: "a tenth of a unit of RM score"
  - statement: "A larger η raises KL."
    source: ours
    rule: {kind: trend, metric: objective/kl, axis: ppo.kl_coef, direction: increasing}
  - statement: "A larger η lowers the RM score."
    source: ours
    rule: {kind: trend, metric: objective/rm_score, axis: ppo.kl_coef, direction: decreasing}
  - statement: "KL ends above zero for every η."
    source: ours
    rule: {kind: threshold, metric: objective/kl, op: ">", value: 0.0}
  - statement: "KL ends below 0.01 for η=0.05."
    source: ours
    rule: {kind: threshold, metric: objective/kl, op: "<", value: 0.01, variant: "KL penalty η=0.05"}
""",
    "apa.yaml": """
name: apa
figure: "apa"
order: 20
title: "APA vs PPO vs AWR"
kind: train
seeds: [0, 1]
variants:
  - name: "PPO"
    set: {ppo.policy_loss: ppo}
  - name: "AWR"
    set: {ppo.policy_loss: awr}
  - name: "APA"
    inherit: "PPO"
    set: {ppo.policy_loss: apa, ppo.apa_lambda: 0.1}
panels: [objective/rm_score, objective/kl]
claims:
  - statement: "APA stays closer to the initial policy (lower KL) than PPO at equal samples."
    source: paper
    section: "APA paper"
    rule: {kind: compare, metric: objective/kl, lower: "APA", higher: "PPO"}
  - statement: "APA reaches a higher RM score than AWR at equal samples."
    source: paper
    section: "APA paper"
    rule: {kind: compare, metric: objective/rm_score, lower: "AWR", higher: "APA"}
  - statement: "PPO keeps KL lower than APA."
    source: ours
    rule: {kind: compare, metric: objective/kl, lower: "PPO", higher: "APA"}
""",
    "vanilla.yaml": """
name: vanilla
figure: "4"
order: 4
title: "Fig. 4: vanilla PPO collapses"
inferred: ["Two seeds stand for the paper's one run."]
kind: train
seeds: [0, 1]
variants:
  - name: "vanilla PPO"
panels: [objective/rm_score, eval/win_rate_vs_sft, policy/pg_loss, val/vf_loss, objective/kl, objective/ppl, response/length_mean]
claims:
  - statement: "Vanilla PPO collapses."
    source: paper
    section: "5.2"
    rule: {kind: collapses, variant: "vanilla PPO"}
  - statement: "Vanilla PPO stays stable."
    source: ours
    rule: {kind: collapses, variant: "vanilla PPO", expected: false}
""",
    "score_reparam.yaml": """
name: score_reparam
figure: "6"
order: 6
title: "Fig. 6: score reparameterization"
kind: train
seeds: [0, 1, 2]
variants:
  - name: "reward scale"
    set: {reward.scale: true}
  - name: "reward normalize, δ=0.8"
    set: {reward.normalize: true, reward.clip: 0.8}
panels: [objective/rm_score, objective/kl]
claims:
  - statement: "Reward normalization with δ=0.8 keeps KL below reward scaling alone."
    source: ours
    rule: {kind: compare, metric: objective/kl, lower: "reward normalize, δ=0.8", higher: "reward scale"}
  - statement: "Reward normalization with δ=0.8 keeps training stable (no collapse)."
    source: ours
    rule: {kind: collapses, variant: "reward normalize, δ=0.8", expected: false}
  - statement: "Both end at the same KL, as far as the seeds tell."
    source: ours
    rule: {kind: similar, metric: objective/kl, variants: ["reward scale", "reward normalize, δ=0.8"],
           margin: {share: 0.1, of: "reward scale"}, margin_reason: "a tenth of reward scaling's KL"}
  - statement: "Reward normalization collapses later than reward scaling."
    source: ours
    rule: {kind: compare, metric: collapse/step, lower: "reward scale", higher: "reward normalize, δ=0.8"}
  - statement: "Reward normalization with δ=0.8 collapses."
    source: ours
    rule: {kind: collapses, variant: "reward normalize, δ=0.8"}
""",
    "rm_scores.yaml": """
name: rm_scores
figure: "2"
order: 2
title: "Fig. 2: RM score difference"
kind: world
seeds: [0]
variants:
  - name: "reward model"
  - name: "reward model, 1/4 of the pairs"
    set: {prefs.train_pairs: 1000}
panels: [rm_score_diff_hist]
claims:
  - statement: "Each RM orders most held-out pairs as the labeler did."
    source: ours
    rule: {kind: pairs_above_chance}
""",
    "rm_accuracy.yaml": """
name: rm_accuracy
figure: "3"
order: 3
title: "Fig. 3: RM accuracy"
kind: world
seeds: [0]
variants:
  - name: "reward model"
panels: [rm_accuracy]
claims:
  - statement: "The RM's held-out accuracy beats chance."
    source: ours
    rule: {kind: threshold, metric: rm/eval_acc, op: ">", value: 0.5}
""",
    "rm_score_dist.yaml": """
name: rm_score_dist
figure: "13"
order: 13
title: "Fig. 13: RM score distribution"
kind: train
seeds: [0]
variants:
  - name: "PPO-max"
panels: [eval_rm_score_hist]
claims:
  - statement: "The held-out RM-score distribution grows a long tail."
    source: paper
    section: "App. A"
    rule: {kind: eval_scores_shift, what: sd}
  - statement: "The held-out RM-score distribution moves up."
    source: ours
    rule: {kind: eval_scores_shift, what: mean}
  - statement: "PPO-max collapses."
    source: ours
    rule: {kind: collapses, variant: "PPO-max"}
""",
    "policy_constraints.yaml": """
name: policy_constraints
figure: "7"
order: 7
kind: train
variants:
  - name: "KL penalty"
panels: [objective/kl]
claims:
  - statement: "The KL penalty keeps training stable."
    source: paper
    section: "5.3.2"
    rule: {kind: collapses, variant: "KL penalty", expected: false}
""",
    "bases/vanilla.yaml": "ppo: {kl_coef: 0.0}\n",
}
"""The analysis tests' ablation registry: file path under the registry folder -> its YAML text."""


def write_registry(root):
    """Write REGISTRY's files under `root` (parents made as needed); returns `root`."""
    for rel, text in REGISTRY.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def fast_dir(tmp_path_factory, name: str):
    """A scratch folder on tmpfs when there is one: sqlite fsyncs every commit (tens of ms on a
    disk) and writing a store takes hundreds of commits."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = Path(tempfile.mkdtemp(prefix=f"harness-{name}-", dir=shm))
        return d, lambda: shutil.rmtree(d, ignore_errors=True)
    return tmp_path_factory.mktemp(name), lambda: None


def field_parts(tp: Any, meta: list) -> tuple[bool, Any, dict[str, Any], bool]:
    """(optional, base type, numeric bounds, has a custom string check) of a field annotation."""
    optional = get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp)
    if optional:
        tp = next(a for a in get_args(tp) if a is not type(None))
    meta = list(meta)
    if get_origin(tp) is typing.Annotated:
        tp, *more = get_args(tp)
        meta += more
    meta = [x for m in meta for x in ([m, *m.metadata] if hasattr(m, "metadata") else [m])]
    bounds = {a: getattr(m, a) for m in meta for a in ("gt", "ge", "lt", "le") if getattr(m, a, None) is not None}
    checked = any(isinstance(m, AfterValidator) for m in meta)
    return optional, tp, bounds, checked


def bad_values(tp: Any, meta: list) -> list[tuple[str, Any]]:
    """(what, value) pairs the field must refuse."""
    optional, base, bounds, checked = field_parts(tp, meta)
    out: list[tuple[str, Any]] = [("wrong type (list)", [1, 2])]
    if not optional:
        out.append(("null", None))
    if base in (int, float):
        out.append(("wrong type (text)", "twelve"))
        out.append(("wrong type (bool)", True))
        step = 1 if base is int else 0.5
        if "ge" in bounds:
            out.append(("below range", bounds["ge"] - step))
        if "gt" in bounds:
            out.append(("at the open end", bounds["gt"]))
        if "le" in bounds:
            out.append(("above range", bounds["le"] * 10 + step))
        if "lt" in bounds:
            out.append(("at the open end", bounds["lt"]))
        if base is int:
            out.append(("fraction", 2.5))
    elif base is bool:
        out += [("text for a bool", "yes"), ("int for a bool", 1)]
    elif get_origin(base) is Literal:
        out += [("not a choice", "zzz-not-a-choice"), ("int for a choice", 7)]
    elif base is str:
        out.append(("int for text", 7))
        if checked:
            out.append(("NUL byte", "a\x00b"))
    elif get_origin(base) is dict:
        out.append(("non-text value", {"k": [1]}))
    return out


def mistype(name: str) -> str:
    """Drop one letter from the middle of a key (kl_coef -> kl_cef)."""
    i = len(name) // 2
    return name[:i] + name[i + 1:] if len(name) > 2 else name + "x"


def pdf_text(path) -> tuple[int, str]:
    """Page count and the text with whitespace collapsed (table cells wrap sentences)."""
    from pypdf import PdfReader

    reader = PdfReader(str(path))
    return len(reader.pages), " ".join(" ".join(page.extract_text() for page in reader.pages).split())


def uts_problem() -> str | None:
    """Why a runner cannot be given a host name of its own here (`unshare --uts`: root or CAP_SYS_ADMIN and
    util-linux), or None where it can."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    try:
        done = subprocess.run(["unshare", "--uts", "sh", "-c", "hostname host-probe && hostname"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare --uts failed: {e}"
    if done.returncode or done.stdout.strip() != "host-probe":
        return f"unshare --uts is not permitted here (root or CAP_SYS_ADMIN): {(done.stderr or done.stdout).strip()[:200]}"
    return None


def on_host(host: str, command: list[str]) -> list[str]:
    """`command` in a UTS namespace of its own whose host name is `host` (a machine of its own, as far as the
    runners' ownership checks go: socket.gethostname() differs, so another runner's pid means nothing here);
    the same pid as the command (unshare and sh exec it)."""
    return ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *command]
