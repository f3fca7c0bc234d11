"""Beyond one process: DeepSpeed ZeRO, data-parallel PPO, and rank-invariant rollouts.

What a multi-rank run computes is, up to float rounding, what a one-rank run computes on the same
global batch. The design that makes that hold:

- **Global batch, sharded.** `ppo.rollout_batch_size` is the *global* batch. Every rank draws the
  same prompt indices (the data generator is seeded identically everywhere) and generates, scores
  and evaluates only its contiguous slice `[rank*B/W, (rank+1)*B/W)`.
- **Keyed sampling.** Generation draws each row's noise from a counter-based hash of
  (seed, rollout number, position of the row in the *global* batch, token step, vocab id), with the
  Gumbel-max trick. A row samples the same tokens whichever rank holds it and whoever its batch
  neighbours are; prompts are left-padded to the global batch's longest prompt and every rank runs
  the decoding loop until *all* ranks' rows have ended, so shapes match the one-rank run too.
- **Gather once, compute the rest everywhere.** After the per-shard forward passes (policy,
  reference, critic, reward model, gold) the scored shard is all-gathered, so every rank holds the
  whole batch: reward running statistics, per-token rewards, GAE and the rollout metrics are the
  one-rank computation, run redundantly (they are cheap elementwise ops).
- **Global minibatches, token-weighted losses.** Each minibatch is drawn from the global batch with
  the same permutation as a one-rank run; advantages are whitened over the global minibatch; each
  rank then takes its slice of the minibatch (split further into `gradient_accumulation`
  micro-batches) and back-propagates `sum(local token losses) / (global token count)`. Summed over
  ranks and micro-batches that is exactly the one-rank minibatch gradient; DeepSpeed's averaging
  and its 1/accumulation scaling are undone explicitly. Logged losses are the global values
  (token sums all-reduced), so metrics are identical on every rank and rank 0 logs them.
- **One MLflow run.** Only rank 0 talks to MLflow and writes run files; other ranks run the same
  loop with tracking switched off (`run_worker`). Stop decisions (callbacks, stop files) are
  broadcast from rank 0 so every rank leaves the loop at the same step.
- **Consolidated checkpoints.** `state_dict()` gathers full fp32 weights and AdamW moments into the
  plain single-process format (`torch.optim.AdamW.state_dict()` layout), so a checkpoint written by
  any world size and ZeRO stage reloads into a one-rank run, and vice versa.

This path ("distributed mode") is taken when `distributed.deepspeed` is true, when the process was
started by a launcher (`WORLD_SIZE` is set), or when gradient checkpointing or accumulation is
asked for. Otherwise `PPOTrainer` runs unchanged (its sampler draws from one torch.Generator over
the whole batch, which is not rank-invariant; the two samplers draw from the same distribution but
different random streams).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import keys
from .algorithms import (
    POLICY_LOSSES, entropy_term, masked_mean, value_loss,
)
from .config import ConfigError, TrainConfig
from .rollout import Rollout, _cache_arg, critic_values, filter_logits, lm_loss, logprobs_and_entropy, position_ids
from .trainer import Batch, NonFiniteLoss, PPOTrainer, eval_summary

# ------------------------------------------------------------------------------------------------
# Environment
# ------------------------------------------------------------------------------------------------
STOP_FILE = "STOP"
"""Creating `{output_dir}/{run_name}/STOP` asks a running job to stop after its current step
(status FINISHED, tag harness.stopped_by=callback); `launch.launch_train` uses it for on_step."""


def launched_world_size() -> int | None:
    """WORLD_SIZE set by torchrun / the deepspeed launcher, else None."""
    w = os.environ.get("WORLD_SIZE")
    return int(w) if w else None


def is_distributed(cfg: TrainConfig) -> bool:
    """Whether a run takes the distributed trainer (see the module doc)."""
    d = cfg.distributed
    return bool(d.deepspeed or launched_world_size() is not None or d.gradient_checkpointing or d.gradient_accumulation > 1)


@dataclass
class DistEnv:
    """This process's place in the job; collectives are no-ops at world size 1."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    backend: str | None = None  # None = no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.backend is not None and self.world_size > 1

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if not self.active:
            return t
        import torch.distributed as dist

        out = t.detach().clone()
        dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate equally shaped tensors from all ranks along dim 0, in rank order."""
        if not self.active:
            return t
        import torch.distributed as dist

        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t)
        return torch.cat(parts, 0)

    def broadcast_object(self, obj: Any) -> Any:
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_true(self, flag: bool, device: torch.device) -> bool:
        if not self.active:
            return flag
        return bool(self.all_reduce(torch.tensor([1 if flag else 0], device=device, dtype=torch.int32), "min").item())

    def shard(self, n: int) -> tuple[int, int]:
        """Contiguous slice of n rows for this rank (n divisible by world size)."""
        per = n // self.world_size
        return self.rank * per, (self.rank + 1) * per


ENV = DistEnv()
"""The process's environment once `setup` ran (world size 1 until then)."""


def _resolve_device_type(cfg: TrainConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def local_device(device: torch.device) -> torch.device:
    """cuda -> cuda:LOCAL_RANK for a launched job; other devices unchanged."""
    if device.type == "cuda" and device.index is None and launched_world_size() is not None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


# ------------------------------------------------------------------------------------------------
# Validation: what the hardware and the launch can do, before any model is built
# ------------------------------------------------------------------------------------------------
def cpu_supports_bf16() -> bool:
    """Native bf16 arithmetic on this CPU (x86 avx512_bf16 / amx_bf16, Arm FEAT_BF16)."""
    try:
        if sys.platform == "darwin":
            import subprocess

            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True, timeout=5)
            return out.stdout.strip() == "1"
        text = Path("/proc/cpuinfo").read_text()
    except Exception:
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def gpu_supports_bf16() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def deepspeed_import_error() -> str | None:
    """None when `import deepspeed` works, else the reason."""
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything else
        return f"{type(e).__name__}: {e}"
    return None


def validate(cfg: TrainConfig, device_type: str | None = None, world_size: int | None = None) -> list[str]:
    """Problems with the `distributed` section (and bf16 autocast) on this hardware and launch.

    Each names the field, the value and what is allowed, like `harness.config` does.
    """
    d, p = cfg.distributed, cfg.ppo
    dev = device_type or _resolve_device_type(cfg)
    world = world_size if world_size is not None else (launched_world_size() or 1)
    out: list[str] = []
    if cfg.device == "cuda" and not torch.cuda.is_available():
        out.append("device: got 'cuda' but no CUDA device is visible; allowed here: cpu or auto")
        return out
    on = "a CPU" if dev == "cpu" else f"GPU {torch.cuda.get_device_name(0)!r}" if torch.cuda.is_available() else "this GPU"

    if not d.deepspeed:
        for name, value, default in (("zero_stage", d.zero_stage, 0), ("offload_optimizer", d.offload_optimizer, False),
                                     ("offload_params", d.offload_params, False), ("precision", d.precision, "fp32")):
            if value != default:
                out.append(f"distributed.{name}: got {value!r} with distributed.deepspeed=false; allowed: {default!r} "
                           f"(a DeepSpeed setting; set distributed.deepspeed=true, or use model.autocast=bf16 for mixed precision without it)")
    else:
        if dev == "cpu" and not os.environ.get("DS_ACCELERATOR"):
            os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is first imported
        if dev == "cuda" and os.environ.get("DS_ACCELERATOR", "cuda") != "cuda":
            out.append(f"distributed.deepspeed: DS_ACCELERATOR={os.environ['DS_ACCELERATOR']!r} but the run's device is cuda; allowed: unset DS_ACCELERATOR or set it to 'cuda'")
        err = deepspeed_import_error()
        if err:
            out.append(f"distributed.deepspeed: got true but deepspeed cannot be imported ({err}); allowed: false, or install it (`pip install deepspeed`)")
        if d.precision != "fp32" and d.zero_stage == 0:
            out.append(f"distributed.zero_stage: got 0 with distributed.precision={d.precision!r}; allowed: 1, 2 or 3 "
                       "(DeepSpeed's stage-0 mixed-precision wrapper takes an extra AdamW step at start-up; stage 1 costs nothing extra)")
        if d.offload_optimizer and d.zero_stage == 0:
            out.append("distributed.offload_optimizer: got true with zero_stage=0; allowed: only with zero_stage 1, 2 or 3")
        if dev == "cpu":
            for name in ("offload_optimizer", "offload_params"):
                if getattr(d, name):
                    out.append(f"distributed.{name}: got true on {on}; allowed: false (the model already lives in CPU memory)")
    for field, value in (("distributed.precision", d.precision), ("model.autocast", cfg.model.autocast)):
        if value == "fp16" and dev == "cpu":
            allowed = "'fp32' or 'bf16'" if cpu_supports_bf16() else "'fp32' (this CPU has no bf16 either)"
            out.append(f"{field}: got 'fp16' on a CPU; allowed here: {allowed}")
        if value == "bf16":
            if dev == "cpu" and not cpu_supports_bf16():
                allowed = "'fp32'" if field == "distributed.precision" else "'none'"
                out.append(f"{field}: got 'bf16' but this CPU has no native bf16 (no avx512_bf16/amx_bf16 flag); allowed here: {allowed}")
            if dev == "cuda" and torch.cuda.is_available() and not gpu_supports_bf16():
                cap = ".".join(map(str, torch.cuda.get_device_capability(0)))
                allowed = "'fp16' or 'fp32'" if field == "distributed.precision" else "'none'"
                out.append(f"{field}: got 'bf16' but {on} (compute capability {cap}) has no bf16; allowed here: {allowed}")
    if is_distributed(cfg) or world > 1:
        mb = p.rollout_batch_size // p.num_minibatches
        gas = d.gradient_accumulation
        if mb % world:
            out.append(
                f"ppo.rollout_batch_size: got {p.rollout_batch_size} with ppo.num_minibatches={p.num_minibatches} on {world} ranks; "
                f"allowed: a multiple of num_minibatches x ranks = {p.num_minibatches * world} (every rank takes an equal share of each minibatch)"
            )
        elif (mb // world) % gas:
            out.append(
                f"distributed.gradient_accumulation: got {gas}; allowed: a divisor of the {mb // world} rows each rank takes per minibatch "
                f"(ppo.rollout_batch_size / ppo.num_minibatches / ranks = {p.rollout_batch_size}/{p.num_minibatches}/{world})"
            )
        if p.ptx_coef > 0 and p.ptx_batch_size % (world * gas):
            out.append(f"ppo.ptx_batch_size: got {p.ptx_batch_size}; allowed: a multiple of ranks x distributed.gradient_accumulation = {world * gas}")
        if dev == "cuda" and launched_world_size() is not None and torch.cuda.is_available():
            lr = int(os.environ.get("LOCAL_RANK", "0"))
            if lr >= torch.cuda.device_count():
                out.append(f"LOCAL_RANK={lr}: only {torch.cuda.device_count()} GPU(s) visible on this machine; allowed: --nproc_per_node <= {torch.cuda.device_count()}")
    return out


def check(cfg: TrainConfig) -> None:
    problems = validate(cfg)
    if problems:
        raise ConfigError(problems)


# ------------------------------------------------------------------------------------------------
# Process group
# ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_deepspeed(backend: str, device_type: str) -> None:
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if os.environ.get("HARNESS_DS_SHM_COMM") != "1":
            # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (minutes on a small
            # machine) that only speeds up CPU-to-CPU collectives; gloo does the same job.
            import importlib

            mod = importlib.import_module("deepspeed.comm.torch")
            if hasattr(mod, "build_shm_op"):
                mod.build_shm_op = lambda: None
    import warnings

    import deepspeed

    # DeepSpeed calls torch collectives torch 2.13 renamed; one FutureWarning per call otherwise
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def setup(cfg: TrainConfig) -> DistEnv:
    """Validate (ConfigError before any model is built) and join the job's process group.

    A launched process (WORLD_SIZE set) joins via env:// (gloo on CPU, nccl on GPU); a one-process
    DeepSpeed run gets a private one-member group. Idempotent within a process.
    """
    global ENV
    check(cfg)
    launched = launched_world_size() is not None
    if not (launched or cfg.distributed.deepspeed):
        ENV = DistEnv()
        return ENV
    import torch.distributed as dist

    device_type = _resolve_device_type(cfg)
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        if launched:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    if cfg.distributed.deepspeed and not launched:
        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads it; WORLD_SIZE stays unset (it marks launched jobs)
    if cfg.distributed.deepspeed:
        _init_deepspeed(backend, device_type)
    ENV = DistEnv(dist.get_world_size(), dist.get_rank(), local_rank, dist.get_backend())
    return ENV


def teardown() -> None:
    """Leave the process group (end of `python -m harness.train`)."""
    global ENV
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    ENV = DistEnv()


# ------------------------------------------------------------------------------------------------
# Keyed (rank-invariant) sampling
# ------------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors (lowbias32 shape, odd multipliers < 2^31 so no
    product leaves int64). Same bits on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x046CA68B) & _M32
    x = x ^ (x >> 16)
    return x


def row_key(*parts: int) -> int:
    """A 32-bit key from integers (seed, stream, counter, global row index)."""
    h = 0x2545F491
    for v in parts:
        h = int(_mix32(torch.tensor([(h ^ (int(v) & _M32)) & _M32]))[0])
        h = (h * 0x0019660D + 0x3C6EF35F) & _M32
    return h


STREAM_ROLLOUT, STREAM_EVAL = 1, 2


def keyed_uniform(row_keys: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1): a pure function of (row key, step, vocab id)."""
    base = _mix32((_mix32(row_keys & _M32) ^ ((step * 0x27D4EB2F) & _M32)) & _M32)  # [B]
    v = torch.arange(vocab, device=row_keys.device, dtype=torch.int64)
    x = _mix32((base[:, None] + v[None, :] * 0x165667B1) & _M32)
    return ((x >> 8).float() + 0.5) / float(1 << 24)


def left_pad_to(token_lists: list[list[int]], P: int, pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad to a given width P (the global batch's longest prompt)."""
    ids = torch.full((len(token_lists), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), P), dtype=torch.long)
    for i, t in enumerate(token_lists):
        if t:
            ids[i, P - len(t):] = torch.tensor(t)
            mask[i, P - len(t):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def sample_keyed(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    row_keys: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_at_eos: bool = True,
    all_finished: Callable[[bool], bool] | None = None,
) -> Rollout:
    """`rollout.sample` with per-row keyed noise (Gumbel-max over the filtered logits).

    Same layout and sampling distribution as `rollout.sample`; the tokens depend only on each row's
    key, never on batch neighbours. `all_finished(local_done)` makes every rank keep decoding until
    all ranks' rows have ended (ZeRO-3 forwards are collective, and shapes must agree).
    """
    B = prompt_ids.shape[0]
    device = prompt_ids.device
    cache_arg = _cache_arg(type(model))
    pos = position_ids(prompt_mask)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos, use_cache=True)
    past, logits = getattr(out, cache_arg), out.logits[:, -1, :]
    next_pos = pos[:, -1] + 1
    attn = prompt_mask
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    tokens, logps = [], []
    keys_dev = row_keys.to(device=device, dtype=torch.int64)
    for t in range(max_new_tokens):
        scaled = logits.float() / temperature
        logp_all = torch.log_softmax(scaled, -1)
        u = keyed_uniform(keys_dev, t, scaled.shape[-1])
        tok = (filter_logits(scaled, top_k, top_p) - torch.log(-torch.log(u))).argmax(-1)
        tok = torch.where(finished, torch.full_like(tok, pad_id), tok)
        tokens.append(tok)
        logps.append(logp_all.gather(1, tok[:, None]).squeeze(1))
        if stop_at_eos:
            finished = finished | (tok == eos_id)
            done = bool(finished.all())
            if all_finished is not None:
                done = all_finished(done)
            if done:
                break
        if t == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype, device=device)], 1)
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None], use_cache=True, **{cache_arg: past})
        past, logits = getattr(out, cache_arg), out.logits[:, -1, :]
        next_pos = next_pos + 1
    response = torch.stack(tokens, 1)
    is_eos = (response == eos_id) if stop_at_eos else torch.zeros_like(response, dtype=torch.bool)
    eos_before = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    mask = (~eos_before).long()
    ended = is_eos.any(1)
    sample_logprobs = torch.stack(logps, 1) * mask
    response = torch.where(mask.bool(), response, torch.full_like(response, pad_id))
    return Rollout(prompt_ids, prompt_mask, response, mask, sample_logprobs, ended)


# ------------------------------------------------------------------------------------------------
# DeepSpeed configuration and the trained-model wrapper
# ------------------------------------------------------------------------------------------------
def precision_dtype(cfg: TrainConfig) -> torch.dtype:
    """dtype the models are loaded in: the DeepSpeed precision, fp32 without DeepSpeed."""
    if not cfg.distributed.deepspeed:
        return torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.distributed.precision, torch.float32)


def ds_config(cfg: TrainConfig, world_size: int, *, train: bool, on_gpu: bool) -> dict:
    """The DeepSpeed config dict a run's settings map to (micro-batch = one rank's share of a
    minibatch split into `gradient_accumulation` pieces)."""
    d, p = cfg.distributed, cfg.ppo
    mb = p.rollout_batch_size // p.num_minibatches
    gas = d.gradient_accumulation if train else 1
    micro = max(1, mb // (world_size * d.gradient_accumulation))
    zero: dict[str, Any] = {"stage": d.zero_stage if train or d.zero_stage == 3 else 0}
    if train and d.offload_optimizer and d.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if d.offload_params and d.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * world_size,
        "gradient_clipping": float(p.max_grad_norm) if train else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": d.precision == "bf16"},
        "fp16": {"enabled": d.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,  # our own torch AdamW: no DeepSpeed op to compile
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _no_dropout(module: torch.nn.Module) -> None:
    """Zero every dropout so train mode (needed by HF gradient checkpointing) equals eval mode."""
    for m in module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr in ("attention_dropout", "dropout", "attn_dropout_p"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)


def enable_gradient_checkpointing(module: torch.nn.Module) -> None:
    target = module.trunk if hasattr(module, "trunk") else module
    if not hasattr(target, "gradient_checkpointing_enable"):
        raise ConfigError([f"distributed.gradient_checkpointing: got true but {type(target).__name__} does not support it; allowed: false"])
    _no_dropout(module)
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class TrainedModel:
    """Policy or critic with its optimizer: DeepSpeed engine, or plain torch with gradients summed
    across ranks by hand. `backward` takes the globally normalized micro-batch loss."""

    def __init__(self, module: torch.nn.Module, opt: torch.optim.Optimizer, sched, cfg: TrainConfig, env: DistEnv, device: torch.device):
        self.module, self.opt, self.sched, self.cfg, self.env = module, opt, sched, cfg, env
        self.ds = cfg.distributed.deepspeed
        self.stage = cfg.distributed.zero_stage if self.ds else 0
        self.gas = cfg.distributed.gradient_accumulation
        self.ckpt = cfg.distributed.gradient_checkpointing
        self.engine = None
        if self.ckpt:
            enable_gradient_checkpointing(module)
        if self.ds:
            import deepspeed

            self.engine, self.ds_opt, _, _ = deepspeed.initialize(
                model=module, optimizer=opt, lr_scheduler=sched,
                config=ds_config(cfg, env.world_size, train=True, on_gpu=device.type == "cuda"),
            )
            self.engine.eval()
        self._micro = 0

    def forward(self, *args, logits_to_keep: int | None = None, **kwargs):
        """The engine's (or module's) forward; `logits_to_keep` passes through to HF causal LMs."""
        if logits_to_keep is not None:
            kwargs["logits_to_keep"] = logits_to_keep
        return (self.engine or self.module)(*args, **kwargs)

    __call__ = forward

    @contextlib.contextmanager
    def training(self):
        """Train mode only matters for gradient checkpointing (dropout is zeroed then)."""
        if not self.ckpt:
            yield
            return
        (self.engine or self.module).train()
        try:
            yield
        finally:
            (self.engine or self.module).eval()

    def backward(self, loss: torch.Tensor) -> float | None:
        """Accumulate one micro-batch; the last of `gas` steps the optimizer and returns the
        global gradient norm before clipping (None before that)."""
        self._micro += 1
        last = self._micro == self.gas
        if self.engine is not None:
            # DeepSpeed averages over ranks; our loss is already a share of the global mean.
            self.engine.backward(loss * self.env.world_size, scale_wrt_gas=False)
            norm = None
            if last and self.stage == 0:
                norm = self._grad_norm()
            self.engine.step()
            if not last:
                return None
            self._micro = 0
            if norm is None:
                g = self.engine.get_global_grad_norm()
                norm = float(g) if g is not None else float("nan")
            if not math.isfinite(norm) and self.cfg.distributed.precision != "fp16":
                raise NonFiniteLoss(f"gradient norm is {norm} (non-finite); try a lower learning rate or ppo.max_grad_norm > 0")
            return norm
        loss.backward()
        if not last:
            return None
        self._micro = 0
        params = [q for q in self.module.parameters() if q.grad is not None]
        if self.env.active:
            from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

            flat = self.env.all_reduce(_flatten_dense_tensors([q.grad for q in params]))
            for q, g in zip(params, _unflatten_dense_tensors(flat, [q.grad for q in params])):
                q.grad.copy_(g)
        max_norm = self.cfg.ppo.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if not torch.isfinite(norm):
            raise NonFiniteLoss(f"gradient norm is {norm.item()} (non-finite); try a lower learning rate or ppo.max_grad_norm > 0")
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return norm.item()

    def _grad_norm(self) -> float:
        grads = [q.grad.detach().float() for q in self.module.parameters() if q.grad is not None]
        if not grads:
            return 0.0
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()

    # ---------------------------------------------------------------- consolidated state
    def _partitioned(self) -> bool:
        return self.engine is not None and self.stage > 0

    def full_state(self) -> tuple[dict, dict]:
        """(module state_dict, torch AdamW state_dict) with full fp32 tensors on CPU.

        Collective under ZeRO (call on every rank); ranks other than 0 may drop the result.
        """
        if not self._partitioned():
            opt = self.ds_opt if self.engine is not None else self.opt
            return ({k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()},
                    _cpu(opt.state_dict()))
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        keep = self.env.is_main
        params = list(self.module.parameters())
        full: dict[int, torch.Tensor] = {}
        for q in params:
            v = safe_get_full_fp32_param(q)
            full[id(q)] = v.detach().float().cpu().reshape(_shape(q)) if keep else torch.empty(0)
        weights = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            weights[name] = full[id(t)] if id(t) in full else t.detach().cpu().clone()
        inner = self.ds_opt.optimizer
        step = next((st["step"] for st in inner.state.values() if "step" in st), None)
        state: dict[int, dict] = {}
        if step is not None:
            for i, q in enumerate(params):
                ent = {"step": torch.as_tensor(step, dtype=torch.float32).detach().cpu().clone()}
                for k in ("exp_avg", "exp_avg_sq"):
                    v = safe_get_full_optimizer_state(q, k)
                    ent[k] = v.detach().float().cpu().reshape(_shape(q)) if keep else torch.empty(0)
                state[i] = ent
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(params)))} for g in inner.param_groups[:1]]
        return weights, {"state": state, "param_groups": groups}

    def load_full_state(self, weights: dict, opt_state: dict | None) -> None:
        """Inverse of `full_state`, from any world size or stage (or a single-process checkpoint)."""
        if not self._partitioned():
            self.module.load_state_dict(weights)
            if opt_state is not None:
                (self.ds_opt if self.engine is not None else self.opt).load_state_dict(opt_state)
            return
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        named = dict(self.module.named_parameters())
        params = list(self.module.parameters())
        missing = [k for k in named if k not in weights]
        if missing:
            raise KeyError(f"checkpoint lacks weights for {missing[:5]}")
        if self.stage == 3:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                if self.env.is_main:
                    for k, q in named.items():
                        q.data.copy_(weights[k].to(q.dtype))
        else:
            for k, q in named.items():
                q.data.copy_(weights[k].to(device=q.device, dtype=q.dtype))
        for k, q in named.items():
            safe_set_full_fp32_param(q, weights[k].to(q.device if q.numel() else _dev(self)).float())
        for name, buf in self.module.named_buffers():
            if name in weights:
                buf.copy_(weights[name].to(buf.dtype))
        if opt_state is None or not opt_state.get("state"):
            return
        inner = self.ds_opt.optimizer
        # AdamW creates its state at the first step; make it now for the flat fp32 partitions
        # (ZeRO-3 only lists them in param_groups during step)
        flat = (getattr(self.ds_opt, "fp32_partitioned_groups_flat", None) or getattr(self.ds_opt, "single_partition_of_fp32_groups", None)
                or [fp for g in inner.param_groups for fp in g["params"]])
        on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)  # step tensor beside the params
        for fp in flat:
            if fp not in inner.state or "exp_avg" not in inner.state[fp]:
                step0 = torch.tensor(0.0, dtype=torch.float32, device=fp.device if on_device else "cpu")
                inner.state[fp] = {"step": step0, "exp_avg": torch.zeros_like(fp), "exp_avg_sq": torch.zeros_like(fp)}
        if hasattr(self.ds_opt, "_hp_optimizer_states_linked"):
            self.ds_opt._hp_optimizer_states_linked = False
            self.ds_opt._lazy_init_hp_params_optimizer_state()
        step = None
        for i, q in enumerate(params):
            ent = opt_state["state"].get(i) or opt_state["state"].get(str(i))
            if ent is None:
                continue
            step = ent["step"]
            for k in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(q, ent[k].to(_dev(self)).float(), k)
        if step is not None:
            for st in inner.state.values():
                st["step"] = torch.as_tensor(step, dtype=torch.float32).clone().to(st["step"].device)
        saved = opt_state["param_groups"][0]
        for g in inner.param_groups:
            for k, v in saved.items():
                if k != "params" and k in g:
                    g[k] = v


def _shape(q: torch.Tensor) -> torch.Size:
    return getattr(q, "ds_shape", q.shape)


def _dev(tm: TrainedModel) -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _cpu(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu(v) for v in obj]
    return obj


def prepare_frozen(module: torch.nn.Module, cfg: TrainConfig, env: DistEnv, device: torch.device) -> torch.nn.Module:
    """Reference / reward model: a ZeRO-3 inference engine (sharded) at stage 3, else the module
    itself in the run's precision. Returns what forward calls go to."""
    d = cfg.distributed
    if d.deepspeed and d.zero_stage == 3:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=module, config=ds_config(cfg, env.world_size, train=False, on_gpu=device.type == "cuda"))
        engine.eval()
        return engine.module
    return module.to(precision_dtype(cfg)) if d.deepspeed else module


# ------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------
def make_trainer(cfg: TrainConfig, models, source, device: torch.device):
    """PPOTrainer for a plain single-process run; DistributedPPOTrainer otherwise."""
    if not is_distributed(cfg):
        return PPOTrainer(cfg, models, source, device)
    return DistributedPPOTrainer(cfg, models, source, device, ENV)


class DistributedPPOTrainer(PPOTrainer):
    """PPOTrainer whose rollouts, statistics and updates are rank-invariant (module doc)."""

    def __init__(self, cfg, models, source, device, env: DistEnv):
        super().__init__(cfg, models, source, device)
        self.env = env
        self.rollout_counter = 0
        self.policy_w = TrainedModel(models.policy, self.policy_opt, self.policy_sched, cfg, env, device)
        self.critic_w = TrainedModel(models.critic, self.critic_opt, self.critic_sched, cfg, env, device)
        self.reference = prepare_frozen(models.reference, cfg, env, device)
        self.reward = prepare_frozen(models.reward, cfg, env, device)

    # -------------------------------------------------------------- generation
    def _all_finished(self, done: bool) -> bool:
        return self.env.all_true(done, self.device)

    def generate_keyed(self, model, token_lists: list[list[int]], row_keys: list[int], P: int) -> Rollout:
        g = self.cfg.generation
        ids, mask = left_pad_to(token_lists, P, self.pad_id, self.device)
        with self.autocast:
            return sample_keyed(
                model, ids, mask, torch.tensor(row_keys, dtype=torch.int64), max_new_tokens=g.max_new_tokens,
                eos_id=self.eos_id, pad_id=self.pad_id, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                stop_at_eos=g.stop_at_eos, all_finished=self._all_finished if self.env.active else None,
            )

    def _gather_rollout(self, ro: Rollout) -> Rollout:
        gt = self.env.all_gather
        return Rollout(gt(ro.prompt_ids), gt(ro.prompt_mask), gt(ro.response_ids), gt(ro.response_mask),
                       gt(ro.sample_logprobs), gt(ro.ended))

    @torch.no_grad()
    def _score_local(self, ro: Rollout) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn = ro.attention_mask
        with self.autocast:
            scores = self.reward.score_last(ro.sequences, attn, position_ids(attn)).float()
        gold = None
        if self.source.gold is not None:
            prompts, responses = self.decode(ro)
            gold = torch.tensor(self.source.gold(prompts, responses, ro.ended.tolist()), dtype=torch.float32, device=self.device)
        return scores, gold

    @torch.no_grad()
    def make_batch(self, timers: dict[str, float]) -> Batch:
        cfg, p = self.cfg, self.cfg.ppo
        t0 = time.perf_counter()
        idx = self.next_prompts(p.rollout_batch_size)
        counter = self.rollout_counter
        self.rollout_counter += 1
        lo, hi = self.env.shard(len(idx))
        token_lists = [self.prompt_tokens[i] for i in idx]
        P = max(len(t) for t in token_lists)
        keys_ = [row_key(cfg.seed, STREAM_ROLLOUT, counter, j) for j in range(lo, hi)]
        ro = self.generate_keyed(self.m.policy, token_lists[lo:hi], keys_, P)
        t1 = time.perf_counter()
        seq, attn, mask = ro.sequences, ro.attention_mask, ro.response_mask.float()
        with self.autocast:
            logprobs, entropy = logprobs_and_entropy(self.policy_w, seq, attn, P, ro.response_ids, cfg.generation.temperature)
            ref_logprobs, _ = logprobs_and_entropy(self.reference, seq, attn, P, ro.response_ids, cfg.generation.temperature)
            values = critic_values(self.critic_w, seq, attn, P).float()
        if p.reuse_rollout_logprobs:
            logprobs = ro.sample_logprobs
        logprobs, ref_logprobs = logprobs.float() * mask, ref_logprobs.float() * mask
        values = values * mask
        scores, gold = self._score_local(ro)
        gt = self.env.all_gather
        ro = self._gather_rollout(ro)
        logprobs, ref_logprobs, values, entropy, scores = gt(logprobs), gt(ref_logprobs), gt(values), gt(entropy.float()), gt(scores)
        gold = gt(gold).cpu() if gold is not None else None
        prompts, responses = self.decode(ro)
        mask = ro.response_mask.float()
        t2 = time.perf_counter()
        processed, kl, rewards, non_score, advantages, returns = self.advantages(scores, logprobs, ref_logprobs, values, mask)
        t3 = time.perf_counter()
        timers[keys.TIME_ROLLOUT] = t1 - t0
        timers[keys.TIME_SCORE] = t2 - t1
        timers[keys.TIME_ADVANTAGE] = t3 - t2
        return Batch(ro, logprobs, ref_logprobs, values, entropy, scores, processed, gold,
                     rewards, non_score, kl, advantages, returns, prompts, responses)

    # -------------------------------------------------------------- update
    def update(self, b: Batch, train_policy: bool = True) -> dict[str, float]:
        cfg, p, env = self.cfg, self.cfg.ppo, self.env
        ro = b.rollout
        B, P = ro.response_ids.shape[0], ro.prompt_ids.shape[1]
        mb_size = B // p.num_minibatches
        gas = cfg.distributed.gradient_accumulation
        per = mb_size // env.world_size
        micro = per // gas
        seq, attn, mask = ro.sequences, ro.attention_mask, ro.response_mask.float()
        acc: dict[str, list[float]] = {}
        f64 = dict(dtype=torch.float64, device=self.device)

        def add(k: str, v: float) -> None:
            acc.setdefault(k, []).append(float(v))

        loss_fn = POLICY_LOSSES[p.policy_loss]
        for _ in range(p.ppo_epochs):
            perm = torch.randperm(B, generator=self.data_gen)
            for s in range(0, B, mb_size):
                i = perm[s : s + mb_size].to(self.device)
                m = mask[i]
                R = int(m.sum(1).max().item())
                m = m[:, :R]
                mseq, mattn, mresp = seq[i][:, : P + R], attn[i][:, : P + R], ro.response_ids[i][:, :R]
                adv = self.minibatch_advantages(b.advantages[i][:, :R], m, add)
                N = m.sum().clamp(min=1)
                old, ref = b.old_logprobs[i][:, :R], b.ref_logprobs[i][:, :R]
                mine = env.rank * per

                if train_policy:
                    ptx_ids = ptx_mask = None
                    if p.ptx_coef > 0:
                        ptx_ids, ptx_mask = self._ptx_batch()
                        n_ptx = ptx_mask[:, 1:].sum().clamp(min=1)
                        ptx_per = ptx_ids.shape[0] // env.world_size // gas
                    tot = torch.zeros(7, **f64)  # pg, entropy, clipfrac, approx_kl, ratio, ptx, tokens
                    ratios, norm = [], None
                    for u in range(gas):
                        rows = slice(mine + u * micro, mine + (u + 1) * micro)
                        mu = m[rows]
                        n_u = mu.sum()
                        with self.policy_w.training(), self.autocast:
                            logprobs, entropy = logprobs_and_entropy(self.policy_w, mseq[rows], mattn[rows], P, mresp[rows], cfg.generation.temperature)
                        logprobs = logprobs.float()
                        pg_mean, st = loss_fn(
                            logprobs, old[rows], adv[rows], mu, clip_eps=p.clip_eps, importance_sampling=p.importance_sampling,
                            ref_logprobs=ref[rows], apa_lambda=p.apa_lambda, awr_beta=p.awr_beta, awr_max_weight=p.awr_max_weight,
                        )
                        ent_sum = (entropy.float() * mu).sum()
                        ptx_sum = torch.zeros((), device=self.device)
                        if ptx_ids is not None:
                            k0 = (env.rank * gas + u) * ptx_per
                            pid, pm = ptx_ids[k0 : k0 + ptx_per], ptx_mask[k0 : k0 + ptx_per]
                            with self.policy_w.training(), self.autocast:
                                ptx_sum = lm_loss(self.policy_w, pid, pm) * pm[:, 1:].sum()
                        ratio, log_ratio = st["ratio"], st["log_ratio"]
                        ratios.append((ratio, mu))
                        local = torch.stack([
                            (pg_mean * n_u).detach(), ent_sum.detach(), st["clipfrac"].to(self.device) * n_u,
                            0.5 * (log_ratio**2 * mu).sum(), (ratio * mu).sum(), ptx_sum.detach(), n_u,
                        ]).to(torch.float64)
                        glob = env.all_reduce(local)
                        tot += glob
                        if not torch.isfinite(glob[[0, 1, 5]]).all():
                            raise NonFiniteLoss(f"policy loss is non-finite (pg_loss sum {glob[0].item()}, ptx sum {glob[5].item()}); the run diverged")
                        loss = pg_mean * n_u / N
                        if p.entropy_coef > 0:
                            if p.entropy_target is None:
                                loss = loss - p.entropy_coef * ent_sum / N
                            else:
                                # |H - target| with H the minibatch mean: the sign comes from the
                                # global mean over this micro-batch slot (exact when gas == 1).
                                h = glob[1] / glob[6].clamp(min=1)
                                loss = loss + p.entropy_coef * torch.sign(h - p.entropy_target).float() * ent_sum / N
                        if ptx_ids is not None:
                            loss = loss + p.ptx_coef * ptx_sum / n_ptx
                        norm = self.policy_w.backward(loss)
                    n_tot = tot[6].clamp(min=1)
                    r_mean = tot[4] / n_tot
                    r_var = env.all_reduce(sum(((r.double() - r_mean) ** 2 * mu).sum() for r, mu in ratios))
                    r_max = env.all_reduce(torch.stack([(r * mu).max() for r, mu in ratios]).max(), "max")
                    add(keys.GRAD_NORM_POLICY, norm)
                    add(keys.PG_LOSS, (tot[0] / n_tot).item())
                    h_mean = (tot[1] / n_tot).float()
                    ent_loss = entropy_term(h_mean, p.entropy_coef, p.entropy_target) if p.entropy_coef > 0 else torch.zeros(())
                    add(keys.ENTROPY_LOSS, ent_loss.item())
                    if ptx_ids is not None:
                        add(keys.PTX_LOSS, (tot[5] / n_ptx).item())
                    add(keys.POLICY_CLIPFRAC, (tot[2] / n_tot).item())
                    add(keys.APPROX_KL, (tot[3] / n_tot).item())
                    add(keys.RATIO_MEAN, r_mean.item())
                    add(keys.RATIO_STD, (r_var / n_tot).sqrt().item())
                    add(keys.RATIO_MAX, r_max.item())

                vt = torch.zeros(2, **f64)
                norm = None
                for u in range(gas):
                    rows = slice(mine + u * micro, mine + (u + 1) * micro)
                    mu = m[rows]
                    n_u = mu.sum()
                    with self.critic_w.training(), self.autocast:
                        v = critic_values(self.critic_w, mseq[rows], mattn[rows], P).float()
                    vf_mean, vf_clipfrac = value_loss(v, b.old_values[i][:, :R][rows], b.returns[i][:, :R][rows], mu, p.value_clip)
                    glob = env.all_reduce(torch.stack([(vf_mean * n_u).detach(), vf_clipfrac.to(self.device) * n_u]).to(torch.float64))
                    vt += glob
                    if not torch.isfinite(glob[0]):
                        raise NonFiniteLoss(f"value loss is {glob[0].item()}; the run diverged")
                    norm = self.critic_w.backward(vf_mean * n_u / N)
                add(keys.GRAD_NORM_CRITIC, norm)
                add(keys.VF_LOSS, (vt[0] / N).item())
                add(keys.VF_CLIPFRAC, (vt[1] / N).item())
        return {k: sum(v) / len(v) for k, v in acc.items()}

    def step(self):
        metrics, b = super().step()
        if self.env.active:  # identical metrics on every rank: the slowest rank's timings
            perf = [k for k in sorted(metrics) if k.startswith("perf/") and k != keys.TOKENS_PER_S]
            vals = self.env.all_reduce(torch.tensor([metrics[k] for k in perf], dtype=torch.float64, device=self.device), "max")
            metrics.update({k: v for k, v in zip(perf, vals.tolist())})
            metrics[keys.TOKENS_PER_S] = b.rollout.response_mask.sum().item() / max(metrics[keys.STEP_S], 1e-9)
        return metrics, b

    # -------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self) -> tuple[dict[str, float], dict]:
        if not self.eval_tokens:
            return {}, {}
        bs = self.cfg.ppo.rollout_batch_size
        eval_seed = self.cfg.seed + 10_007
        W = self.env.world_size

        def run(model) -> dict:
            rm, gold, lengths, texts = [], [], [], []
            for s in range(0, len(self.eval_tokens), bs):
                chunk = list(range(s, min(s + bs, len(self.eval_tokens))))
                n = len(chunk)
                padded = chunk + [chunk[0]] * (-n % W)  # equal shards; padding rows are dropped
                per = len(padded) // W
                mine = padded[self.env.rank * per : (self.env.rank + 1) * per]
                P = max(len(self.eval_tokens[j]) for j in chunk)
                ro = self.generate_keyed(model, [self.eval_tokens[j] for j in mine], [row_key(eval_seed, STREAM_EVAL, j) for j in mine], P)
                sc, g = self._score_local(ro)
                lens = ro.lengths.float()
                # responses differ in length per rank: gather token ids padded to the longest
                Rmax = int(self.env.all_reduce(torch.tensor([ro.response_ids.shape[1]], device=self.device), "max").item())
                rid = torch.nn.functional.pad(ro.response_ids, (0, Rmax - ro.response_ids.shape[1]), value=self.pad_id)
                rmask = torch.nn.functional.pad(ro.response_mask, (0, Rmax - ro.response_mask.shape[1]), value=0)
                gt = self.env.all_gather
                sc, lens, rid, rmask = gt(sc)[:n], gt(lens)[:n], gt(rid)[:n], gt(rmask)[:n]
                if g is not None:
                    gold += gt(g)[:n].tolist()
                rm += sc.tolist()
                lengths += lens.tolist()
                texts += [
                    self.tok.decode([t for t in ids[mm.bool()].tolist() if t != self.eos_id], skip_special_tokens=True)
                    for ids, mm in zip(rid, rmask)
                ]
            return {"rm": rm, "gold": gold, "length": lengths, "responses": texts}

        if self.sft_eval is None:
            self.sft_eval = run(self.reference)
        return eval_summary(run(self.m.policy), self.sft_eval)

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Single-process checkpoint format, gathered from every rank (call on all ranks)."""
        pw, po = self.policy_w.full_state()
        cw, co = self.critic_w.full_state()
        return {
            "policy": pw, "critic": cw, "policy_opt": po, "critic_opt": co,
            "policy_sched": self.policy_sched.state_dict(), "critic_sched": self.critic_sched.state_dict(),
            "reward_stats": self.reward_stats.state_dict(), "kl_coef": self.kl_ctl.value,
            "sample_gen": self.sample_gen.get_state(), "data_gen": self.data_gen.get_state(),
            "prompt_order": torch.tensor(self.prompt_order, dtype=torch.long), "torch_rng": torch.get_rng_state(),
            "rollout_counter": self.rollout_counter, "world_size": self.env.world_size,
        }

    def load_state_dict(self, s: dict) -> None:
        self.policy_w.load_full_state(s["policy"], s.get("policy_opt"))
        self.critic_w.load_full_state(s["critic"], s.get("critic_opt"))
        self.policy_sched.load_state_dict(s["policy_sched"])
        self.critic_sched.load_state_dict(s["critic_sched"])
        self.reward_stats.load_state_dict(s["reward_stats"])
        self.kl_ctl.value = float(s["kl_coef"])
        self.sample_gen.set_state(s["sample_gen"])
        self.data_gen.set_state(s["data_gen"])
        self.prompt_order = s["prompt_order"].tolist()
        torch.set_rng_state(s["torch_rng"])
        # a single-process checkpoint has no counter: continue at its step count
        self.rollout_counter = int(s.get("rollout_counter", s.get("step", 0)))


# ------------------------------------------------------------------------------------------------
# Glue for harness.train: one MLflow run, workers without tracking, agreed stops
# ------------------------------------------------------------------------------------------------
def share_run(env: DistEnv, run_id: str, resumed: bool) -> None:
    """Rank 0 tells the workers which run they serve and whether it resumes a checkpoint."""
    if env.active:
        env.broadcast_object({"run_id": run_id, "resumed": resumed})


def agree_stop(stop: bool, run_dir: Path) -> bool:
    """Rank 0's stop decision (callback or a STOP file in the run folder), the same on every rank."""
    env = ENV
    if env.is_main:
        f = Path(run_dir) / STOP_FILE
        if f.exists():
            f.unlink(missing_ok=True)  # honoured once: a later --resume runs on
            stop = True
    return bool(env.broadcast_object(stop)) if env.active else bool(stop)


class _NullLogger:
    def __init__(self, *a, **k):
        self.dropped = 0

    def log(self, *a, **k) -> None:
        pass


class _NullTracking:
    """Stands in for harness.tracking on ranks other than 0: every call is a no-op."""

    MetricLogger = _NullLogger

    def __getattr__(self, name: str):
        return lambda *a, **k: None


def run_worker(cfg: TrainConfig, env: DistEnv, *, resume: bool):
    """The training loop of a rank other than 0: same steps and collectives, no MLflow, no files."""
    from . import train as train_mod

    info = env.broadcast_object(None)
    run_name = cfg.logging.run_name or train_mod.default_run_name(cfg)
    run_dir = Path(cfg.logging.output_dir) / run_name
    wcfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, progress=False))
    state = train_mod.load_checkpoint(run_dir) if info["resumed"] else None
    if info["resumed"] and state is None:
        raise FileNotFoundError(f"rank {env.rank}: rank 0 resumes {run_dir}/ckpt/state.pt but this rank cannot read it (logging.output_dir must be on a shared filesystem)")
    result = train_mod.RunResult(run_id=info["run_id"], status="RUNNING", steps_done=0, run_dir=str(run_dir))
    saved = {k: getattr(train_mod, k) for k in ("tracking", "save_checkpoint", "_write_json_atomic")}
    train_mod.tracking = _NullTracking()
    train_mod.save_checkpoint = lambda *a, **k: None
    train_mod._write_json_atomic = lambda *a, **k: None
    try:
        train_mod._train_loop(wcfg, info["run_id"], run_dir, state, None, result, {})
        result.status = "FINISHED"
    except Exception as e:  # noqa: BLE001 - rank 0 records the failure; keep the worker's own reason
        result.status, result.error = "FAILED", f"{type(e).__name__}: {e}"
        print(f"[harness] rank {env.rank} FAILED: {result.error}", file=sys.stderr)
    finally:
        for k, v in saved.items():
            setattr(train_mod, k, v)
    return result
