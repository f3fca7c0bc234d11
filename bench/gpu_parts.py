"""The parts of `bench.gpu_check`: runs of the world's vanilla config compared step by step and
stopped and resumed (read back from their MLflow store), and the speed of a PPO step at a realistic
size against TRL 1.12 (`bench.harness_step` and `bench.trl_step` in fresh processes).

Each part returns a dict with `status` (passed / failed / skipped / error) and what it measured.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VANILLA = REPO / "ablations" / "bases" / "vanilla.yaml"
EXPERIMENT = "gpu_check"
RTOL, ATOL = 1e-3, 1e-4
"""Tolerance of a metric between two runs whose sampled responses agree: the one-rank vs two-rank
tolerance of tests/test_distributed.py (float summation order differs; seen there: ~1e-6)."""
SKIP = ("perf/", "policy/clipfrac", "val/clipfrac", "collapse/")
"""Not compared: wall-clock times, and counts of tokens on either side of a threshold (clip
fractions, the collapse rule's signals), which one rounding can move by a whole token."""
TINY_RUN = {"data.eval_prompts": 8, "ppo.rollout_batch_size": 8, "ppo.num_minibatches": 2, "ppo.ppo_epochs": 1,
            "generation.max_new_tokens": 12}
"""--tiny: the world runs at the test suite's sizes (tests/helpers.py's fast_overrides)."""
DS = {"distributed.deepspeed": "true"}
RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "cpu_fp32": ("cpu", {}),
    "device_fp32": ("device", {}),
    "bf16_autocast": ("device", {"model.autocast": "bf16"}),
    "zero2": ("device", {**DS, "distributed.zero_stage": 2}),
    "zero3": ("device", {**DS, "distributed.zero_stage": 3}),
    "zero2_bf16": ("device", {**DS, "distributed.zero_stage": 2, "distributed.precision": "bf16"}),
}
"""The world runs: where each runs ("device" = --device) and its settings on top of vanilla.yaml."""


@dataclass
class Context:
    """What the parts share: the arguments, the MLflow store of every world run, and the run ids so far."""

    device: str
    """--device: "cuda" or "cpu"."""
    world: str
    """The built embedded world (absolute path)."""
    workdir: Path
    """Holds the MLflow store (mlflow.db, its artifacts beside it) and the run folders (runs/)."""
    steps: int
    """PPO steps of every world run."""
    stop_at: int
    """Where the checkpoint/resume runs stop before resuming."""
    threads: int
    """torch CPU threads of every run."""
    tiny: bool
    """World runs at the test suite's sizes (TINY_RUN)."""
    run_ids: dict[str, str] = field(default_factory=dict)
    """MLflow run id of each world run made so far, by RUNS name."""

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.workdir / 'mlflow.db'}"


def median(xs) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------------------------------------
# world runs
# ---------------------------------------------------------------------------------------------
def run_config(ctx: Context, name: str):
    """The TrainConfig of world run `name` (RUNS): vanilla.yaml on ctx.world, every response of
    every step logged as a sample table, eval at step 0 and at the end."""
    from harness.config import load_config

    where, sets = RUNS[name]
    base = {"seed": 0, "device": ctx.device if where == "device" else "cpu", "threads": ctx.threads,
            "data.world_dir": ctx.world, "ppo.steps": ctx.steps, "logging.tracking_uri": ctx.uri,
            "logging.experiment": EXPERIMENT, "logging.output_dir": str(ctx.workdir / "runs"), "logging.run_name": name,
            "logging.eval_every": ctx.steps, "logging.sample_every": 1, "logging.checkpoint_every": 0,
            "logging.progress": False, **(TINY_RUN if ctx.tiny else {}), **sets}
    sets_ = [f"{k}={v}" for k, v in base.items()]
    batch = load_config(VANILLA, sets_).ppo.rollout_batch_size
    return load_config(VANILLA, [*sets_, f"logging.num_samples={batch}"])  # every row of a step's batch


def history(uri: str, run_id: str) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} of a run, from its MLflow store."""
    from harness import tracking

    c = tracking.client(uri)
    out: dict[int, dict[str, float]] = {}
    for k in c.get_run(run_id).data.metrics:
        for m in c.get_metric_history(run_id, k):
            out.setdefault(m.step, {})[k] = m.value
    return out


def responses(uri: str, run_id: str, step: int) -> list[tuple[str, str]]:
    """The (prompt, response) rows a run sampled at `step` (its logged sample table)."""
    from harness import keys, tracking

    rows = tracking.load_json_artifact(uri, run_id, f"{keys.SAMPLES_DIR}/step_{step:06d}.json")["rows"]
    return [(r["prompt"], r["response"]) for r in rows]


def compare(uri: str, ref_id: str, got_id: str, steps: int) -> dict:
    """Two runs of one config: the steps whose sampled responses are identical (from step 1, sampled by
    the step-0 policy), and every metric at those steps and at step 0 (the eval before training)
    within RTOL / ATOL. Passes when step 1's responses agree and no compared value is outside."""
    same = 0
    for s in range(1, steps + 1):
        if responses(uri, ref_id, s) != responses(uri, got_id, s):
            break
        same = s
    ref, got = history(uri, ref_id), history(uri, got_id)
    bad, n, worst = [], 0, {}
    for s in [0, *range(1, same + 1)]:
        for k, v in ref.get(s, {}).items():
            if k.startswith(SKIP):
                continue
            n += 1
            g = got.get(s, {}).get(k)
            if g is None:
                bad.append(f"step {s} {k}: missing")
                continue
            rel = abs(g - v) / max(abs(v), ATOL)
            if rel > worst.get(k, (-1.0,))[0]:
                worst[k] = (rel, s, v, g)
            if not math.isclose(g, v, rel_tol=RTOL, abs_tol=ATOL):
                bad.append(f"step {s} {k}: {v:.7g} vs {g:.7g}")
    top = sorted(worst.items(), key=lambda kv: -kv[1][0])[:8]
    return {"passed": same >= 1 and not bad, "responses_identical_through_step": same, "steps": steps,
            "values_compared": n, "outside_tolerance": bad[:20], "n_outside": len(bad),
            "tolerance": {"rel": RTOL, "abs": ATOL, "skipped_prefixes": list(SKIP)},
            "largest_rel_diff": {k: {"rel": r, "step": s, "ref": v, "got": g} for k, (r, s, v, g) in top}}


def train_run(ctx: Context, name: str):
    """Run `name` to the end; its RunResult."""
    from harness.train import train

    r = train(run_config(ctx, name))
    ctx.run_ids[name] = r.run_id
    return r


def step_seconds(ctx: Context, run_id: str) -> float:
    from harness import keys

    return median(m[keys.STEP_S] for s, m in history(ctx.uri, run_id).items() if s > 0 and keys.STEP_S in m)


def correctness(ctx: Context) -> dict:
    """vanilla.yaml in fp32 on the device and on CPU: identical responses at step 1, metrics within tolerance."""
    cpu, dev = train_run(ctx, "cpu_fp32"), train_run(ctx, "device_fp32")
    out = {"runs": {"cpu": _result(cpu), "device": _result(dev)}}
    if cpu.status != "FINISHED" or dev.status != "FINISHED":
        return {"status": "failed", "reason": f"a run did not finish: cpu {cpu.status} {cpu.error or ''}, "
                                              f"device {dev.status} {dev.error or ''}", **out}
    cmp = compare(ctx.uri, cpu.run_id, dev.run_id, ctx.steps)
    out.update(comparison=cmp, s_per_step={"cpu": step_seconds(ctx, cpu.run_id), "device": step_seconds(ctx, dev.run_id)})
    return {"status": "passed" if cmp["passed"] else "failed", **out}


def _result(r) -> dict:
    return {"run_id": r.run_id, "status": r.status, "steps": r.steps_done, "error": r.error}


def train_and_resume(ctx: Context, name: str) -> dict:
    """Run `name` to --stop-at (stopped by the step callback: a final checkpoint), then resume it to
    the end; checked from the MLflow store and the run folder. A fp32 DeepSpeed run is also compared
    with the plain device run (same config, so the same numbers up to rounding); a bf16 one is
    reported beside it (bf16 moves the numbers: bench/RESULTS.md)."""
    import torch.distributed as dist

    from harness import keys, tracking
    from harness.train import load_checkpoint, train

    cfg = run_config(ctx, name)
    seen: list[int] = []
    first = train(cfg, on_step=lambda s, m: s >= ctx.stop_at)
    second = train(cfg, resume=True, on_step=lambda s, m: seen.append(s) and False)
    ctx.run_ids[name] = first.run_id
    out: dict[str, Any] = {"runs": {"first": _result(first), "resumed": _result(second)}}
    if first.status != "FINISHED" or second.status != "FINISHED":
        return {"status": "failed", "reason": f"first {first.status} {first.error or ''}; resumed {second.status} "
                                              f"{second.error or ''}", **out}
    h = history(ctx.uri, first.run_id)
    every = set(h.get(1, {}))
    logged = [s for s, _ in tracking.metric_history(ctx.uri, first.run_id, keys.RM_SCORE)]
    tags = tracking.client(ctx.uri).get_run(first.run_id).data.tags
    state = load_checkpoint(Path(second.run_dir))
    checks = {
        "stopped at --stop-at by the callback": first.steps_done == ctx.stop_at and tags.get(keys.TAG_STOPPED) == "callback",
        "resumed from the checkpoint (first step after it)": seen[:1] == [ctx.stop_at + 1],
        "resumed into the same MLflow run": second.run_id == first.run_id,
        "finished every step": second.steps_done == ctx.steps,
        "each step logged once": logged == list(range(1, ctx.steps + 1)),
        "every metric finite at every step": all(set(h.get(s, {})) >= every and all(map(math.isfinite, h[s].values()))
                                                 for s in range(1, ctx.steps + 1)),
        "final checkpoint at the last step": state is not None and int(state["step"]) == ctx.steps,
    }
    if cfg.distributed.deepspeed:
        from deepspeed.accelerator import get_accelerator

        want = "nccl" if ctx.device == "cuda" else "gloo"
        backend = dist.get_backend() if dist.is_initialized() else None
        out.update(backend=backend, deepspeed_accelerator=get_accelerator().device_name())
        checks[f"one-rank process group on {want}"] = backend == want and dist.get_world_size() == 1
    out["checks"] = checks
    out["last_step"] = {k: h[ctx.steps].get(k) for k in (keys.RM_SCORE, keys.KL, keys.GOLD_SCORE, keys.PG_LOSS, keys.VF_LOSS)}
    out["s_per_step"] = step_seconds(ctx, first.run_id)
    ref = ctx.run_ids.get("device_fp32")
    fp32 = cfg.model.autocast == "none" and cfg.distributed.precision == "fp32"
    passed = all(checks.values())
    if ref:
        cmp = compare(ctx.uri, ref, first.run_id, ctx.steps)
        out["vs_device_fp32"] = cmp
        passed = passed and (cmp["passed"] or not fp32)
    elif fp32:
        out["vs_device_fp32"] = "not compared: no device_fp32 run (add correctness to --parts)"
    if not passed:
        out["reason"] = "; ".join([k for k, ok in checks.items() if not ok] or ["differs from the plain device run"])
    return {"status": "passed" if passed else "failed", **out}


# ---------------------------------------------------------------------------------------------
# speed
# ---------------------------------------------------------------------------------------------
DATASHEET_BF16 = {"NVIDIA H200": 989.4e12, "NVIDIA H100 80GB HBM3": 989.4e12}
"""Dense bf16 tensor-core peaks of the SXM boards (NVIDIA's datasheets), FLOP/s; MFU is also given
against the matmul peak measured in the same run."""


def memory_estimate(size, batch: int, prompt_len: int, response_len: int, bf16: bool) -> dict[str, float]:
    """Bytes the speed part needs on the device, by estimate (N weights per model, T = batch x
    (prompt + response) tokens, L layers, width E, vocabulary V):

      weights      4 models x N x 4 (fp32 weights; autocast computes in bf16 on the fly)
      optimizer    2 trained models x N x (4 gradient + 8 AdamW moments)
      activations  2 models' autograd graphs (policy and critic: the first minibatch reuses the scoring
                   pass's) x T x L x 34·E bytes (Korthikanti et al. 2022, 16-bit activations) x 1.5 under
                   autocast (layer norms and the residual stream stay fp32), x 2 in fp32
      logits       3 x T x V x 4 (fp32 logits, their log-softmax and its gradient; TRL keeps prompt positions)
      kv_cache     2 x L x T x E x (2 in bf16, 4 in fp32)
    """
    from bench.common import n_params

    N, T, L, E = n_params(size), batch * (prompt_len + response_len), size.n_layer, size.n_embd
    return {"weights": 4 * N * 4, "optimizer": 2 * N * 12, "activations": 2 * T * L * 34 * E * (1.5 if bf16 else 2.0),
            "logits": 3 * T * size.vocab * 4, "kv_cache": 2 * L * T * E * (2 if bf16 else 4)}


@dataclass
class Workload:
    """The speed part's PPO step, the same on both sides (bench.common: 4 epochs, 1 minibatch,
    separate policy / reference / reward / critic GPT-2 models built from one config)."""

    size: Any
    """bench.common.Size of all four models."""
    batch: int
    """Prompts per step (one response each)."""
    prompt_len: int
    """Prompt tokens (word-level: the prompts of bench.common.build have this many words)."""
    response_len: int
    """Sampled tokens per response, no early stop."""
    bf16: bool
    """bf16 autocast (fp32 weights and optimizer) on both sides, else fp32."""
    steps: int
    """Timed steps after the warm-up."""
    warmup: int
    """Untimed first steps (CUDA start-up, kernel choice)."""
    threads: int
    """torch CPU threads of both processes."""

    def describe(self) -> dict:
        from bench.common import MINIBATCHES, PPO_EPOCHS, n_params

        return {"size": self.size.tag, "heads": self.size.n_head, "positions": self.size.n_positions,
                "params_per_model": n_params(self.size), "batch": self.batch, "prompt_len": self.prompt_len,
                "response_len": self.response_len, "epochs": PPO_EPOCHS, "minibatches": MINIBATCHES,
                "precision": "bf16 autocast, fp32 weights" if self.bf16 else "fp32", "stop_at_eos": False,
                "timed_steps": self.steps, "warmup_steps": self.warmup, "threads": self.threads,
                "harness_math": "ppo.reuse_rollout_logprobs=true (TRL's: old log-probs from sampling)"}


def harness_cmd(device: str, w: Workload, models: Path) -> list[str]:
    sets = [f"device={device}", f"threads={w.threads}", f"ppo.rollout_batch_size={w.batch}",
            f"generation.max_new_tokens={w.response_len}", f"data.max_prompt_tokens={w.prompt_len}",
            "ppo.reuse_rollout_logprobs=true", *(["model.autocast=bf16"] if w.bf16 else [])]
    return [sys.executable, "-m", "bench.harness_step", "--models", str(models), "--steps", str(w.steps),
            "--warmup", str(w.warmup), *(x for s in sets for x in ("--set", s))]


def trl_cmd(python: str, device: str, w: Workload, models: Path) -> list[str]:
    return [python, "-m", "bench.trl_step", "--models", str(models), "--steps", str(w.steps), "--warmup", str(w.warmup),
            "--threads", str(w.threads), "--device", device, "--batch", str(w.batch), "--response-len", str(w.response_len),
            *(["--bf16"] if w.bf16 else [])]


def trl_missing(python: str) -> str | None:
    """Why TRL cannot run in `python` (None when `import trl` works there)."""
    import subprocess

    if os.path.abspath(python) == os.path.abspath(sys.executable):  # not realpath: a venv's python links to its base
        import importlib.util

        return None if importlib.util.find_spec("trl") else f"trl is not importable in {python} (no module named 'trl')"
    p = subprocess.run([python, "-c", "import trl"], capture_output=True, text=True, timeout=300)
    return None if p.returncode == 0 else f"trl is not importable in {python}: {p.stderr.strip().splitlines()[-1:]}"


def summarize(r: dict, flops: float, peak: float, w: Workload, datasheet: float | None) -> dict:
    """One implementation's numbers: median step time, tokens/s, model FLOP/s and MFU, peak memory."""
    from harness import keys

    step = median(r["step_s"])
    out = {"step_s": step, "step_s_each": r["step_s"], "sampled_tokens_per_s": w.batch * w.response_len / step,
           "tokens_per_s": w.batch * (w.prompt_len + w.response_len) / step, "tflop_per_step": flops / 1e12,
           "tflops": flops / step / 1e12, "mfu": flops / step / peak,
           "peak_gpu_gib": r["peak_gpu_mb"] / 1024 if r.get("peak_gpu_mb") else None,
           "peak_rss_gib": r["peak_rss_mb"] / 1024, "process_s": r.get("process_s")}
    if datasheet:
        out["mfu_datasheet"] = flops / step / datasheet
    if "phases" in r:
        names = {keys.TIME_ROLLOUT: "rollout", keys.TIME_SCORE: "scoring", keys.TIME_ADVANTAGE: "advantage",
                 keys.TIME_UPDATE: "update", keys.STEP_S: "trainer_step"}
        out["phases_s"] = {names[k]: median(v) for k, v in r["phases"].items() if k in names}
        out["logging_s"] = median(r["logging_s"])
    return out


def speed(device: str, w: Workload, models_root: Path, trl_python: str, hw_name: str, time_left) -> dict:
    """Build the models (bench.common.build), measure the matmul peak in this run's precision, then
    time the harness step and TRL's (when importable) on the same models, each in a fresh process."""
    from bench.common import build, ppo_step_flops
    from bench.peak import measure
    from bench.run_all import run_json

    # a one-rank DeepSpeed part before this one left LOCAL_RANK set (harness.parallel.setup); a fresh
    # process inheriting it would take itself for a rank of a launched job (accelerate: a rendezvous)
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    models = build(w.size, models_root, prompt_len=w.prompt_len)
    dtype = "bfloat16" if w.bf16 else "float32"
    on_gpu = device == "cuda"
    peak = measure(n=8192 if on_gpu else 256, threads=w.threads, seconds=3.0 if on_gpu else 0.5, dtype=dtype, device=device)
    flops = ppo_step_flops(w.size, w.batch, w.prompt_len, w.response_len)
    datasheet = DATASHEET_BF16.get(hw_name) if w.bf16 and on_gpu else None
    out: dict[str, Any] = {"workload": w.describe(), "peak": peak, "model_tflop_per_step": {k: v / 1e12 for k, v in flops.items()},
                           "datasheet_bf16_tflops": datasheet / 1e12 if datasheet else None}
    pk = peak["peak_gflops"] * 1e9
    out["harness"] = summarize(run_json(harness_cmd(device, w, models), time_left()), flops["total"], pk, w, datasheet)
    missing = trl_missing(trl_python)
    if missing:
        out["trl"] = {"status": "skipped", "reason": missing}
    elif time_left() < 30:
        out["trl"] = {"status": "skipped", "reason": "time budget spent (--budget-s)"}
    else:
        try:
            out["trl"] = summarize(run_json(trl_cmd(trl_python, device, w, models), time_left()), flops["total"], pk, w, datasheet)
        except Exception as e:  # noqa: BLE001 - keep the harness's numbers
            out["trl"] = {"status": "error", "error": f"{type(e).__name__}: {e}"[-4000:]}
            return {"status": "failed", "reason": f"TRL's run failed: {str(e).splitlines()[-1][:300]}", **out}
        out["trl_over_harness"] = out["trl"]["step_s"] / out["harness"]["step_s"]
    return {"status": "passed", **out}
