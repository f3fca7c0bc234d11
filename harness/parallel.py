"""Processes and engines: what one training run needs to span several ranks (or just one):
the `distributed` section checked against hardware and launch, the process group, and `Engine`
(plain torch or DeepSpeed ZeRO, with the single-process checkpoint format on both sides)."""
from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import keys
from .config import ConfigError, TrainConfig


class NonFiniteLoss(RuntimeError):
    """A loss or gradient went NaN/inf; the run ends FAILED with this message."""


"""Creating `{output_dir}/{run_name}/STOP` asks a running job to stop after its current step
(status FINISHED, tag harness.stopped_by=callback); `launch.launch_train` uses it for on_step."""


def launched_world_size() -> int | None:
    """WORLD_SIZE set by torchrun / the deepspeed launcher, else None."""
    w = os.environ.get("WORLD_SIZE")
    return int(w) if w else None


@dataclass(frozen=True)
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
        out = t.detach().clone()
        dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return out

    def all_reduce_sums(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each named scalar summed over ranks, in one all-reduce of their float64 stack; the same
        names back, detached (sums are read, never back-propagated)."""
        total = self.all_reduce(torch.stack(list(sums.values())).detach().to(torch.float64))
        return dict(zip(sums, total.unbind()))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate equally shaped tensors from all ranks along dim 0, in rank order."""
        if not self.active:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, 0)

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        if self.active:
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


def _resolve_device_type(cfg: TrainConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def device_of(cfg: TrainConfig) -> torch.device:
    """The run's device: `auto` resolved; cuda is cuda:LOCAL_RANK in a launched job."""
    kind = _resolve_device_type(cfg)
    if kind == "cuda" and launched_world_size() is not None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(kind)


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
    flag_lines = [line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith(("flags", "Features"))]
    return any({"avx512_bf16", "amx_bf16", "bf16"} & set(flags) for flags in flag_lines)


def deepspeed_import_error() -> str | None:
    """None when `import deepspeed` works, else the reason."""
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything else
        return f"{type(e).__name__}: {e}"
    return None


def validate(cfg: TrainConfig, device_type: str | None = None, world_size: int | None = None) -> list[str]:
    """Problems of `cfg` on this hardware and launch: CUDA visible, bf16/fp16 supported, DeepSpeed
    installed, offload where it means something, every rank an equal share of each minibatch. The
    rules between fields alone are harness.config.cross_checks'."""
    d, p = cfg.distributed, cfg.ppo
    dev = device_type or _resolve_device_type(cfg)
    world = world_size if world_size is not None else (launched_world_size() or 1)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        return ["device: got 'cuda' but no CUDA device is visible; allowed here: cpu or auto"]
    out: list[str] = []
    on = "a CPU" if dev == "cpu" else f"GPU {torch.cuda.get_device_name(0)!r}" if torch.cuda.is_available() else "this GPU"

    if d.deepspeed:
        if dev == "cpu" and not os.environ.get("DS_ACCELERATOR"):
            os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is first imported
        if dev == "cuda" and os.environ.get("DS_ACCELERATOR", "cuda") != "cuda":
            out.append(f"distributed.deepspeed: DS_ACCELERATOR={os.environ['DS_ACCELERATOR']!r} but the run's device is cuda; allowed: unset DS_ACCELERATOR or set it to 'cuda'")
        err = deepspeed_import_error()
        if err:
            out.append(f"distributed.deepspeed: got true but deepspeed cannot be imported ({err}); allowed: false, or install it (`pip install deepspeed`)")
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
            if dev == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
                cap = ".".join(map(str, torch.cuda.get_device_capability(0)))
                allowed = "'fp16' or 'fp32'" if field == "distributed.precision" else "'none'"
                out.append(f"{field}: got 'bf16' but {on} (compute capability {cap}) has no bf16; allowed here: {allowed}")
    mb = p.rollout_batch_size // p.num_minibatches
    gas = d.gradient_accumulation
    if mb % world:
        out.append(f"ppo.rollout_batch_size: got {p.rollout_batch_size} with ppo.num_minibatches={p.num_minibatches} "
                   f"on {world} ranks; allowed: a multiple of num_minibatches x ranks = {p.num_minibatches * world} "
                   "(every rank takes an equal share of each minibatch)")
    elif (mb // world) % gas:
        out.append(f"distributed.gradient_accumulation: got {gas}; allowed: a divisor of the {mb // world} rows each "
                   f"rank takes per minibatch (ppo.rollout_batch_size / ppo.num_minibatches / ranks = "
                   f"{p.rollout_batch_size}/{p.num_minibatches}/{world})")
    if p.ptx_coef > 0 and p.ptx_batch_size % (world * gas):
        out.append(f"ppo.ptx_batch_size: got {p.ptx_batch_size}; allowed: a multiple of ranks x distributed.gradient_accumulation = {world * gas}")
    if dev == "cuda" and launched_world_size() is not None and torch.cuda.is_available():
        lr = int(os.environ.get("LOCAL_RANK", "0"))
        if lr >= torch.cuda.device_count():
            out.append(f"LOCAL_RANK={lr}: only {torch.cuda.device_count()} GPU(s) visible on this machine; allowed: --nproc_per_node <= {torch.cuda.device_count()}")
    return out


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
            import deepspeed.comm.torch  # `import ... as` would bind deepspeed.comm's attribute `torch`: torch itself
            ds_comm = sys.modules["deepspeed.comm.torch"]

            if hasattr(ds_comm, "build_shm_op"):
                ds_comm.build_shm_op = lambda: None
    import deepspeed

    # DeepSpeed calls torch collectives torch 2.13 renamed; one FutureWarning per call otherwise
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def setup(cfg: TrainConfig) -> DistEnv:
    """Validate (ConfigError before any model is built) and join the job's process group.

    A launched process (WORLD_SIZE set) joins via env:// (gloo on CPU, nccl on GPU); a one-process
    DeepSpeed run gets a private one-member group. Idempotent within a process.
    """
    problems = validate(cfg)
    if problems:
        raise ConfigError(problems)
    launched = launched_world_size() is not None
    if not (launched or cfg.distributed.deepspeed):
        return DistEnv()
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
    return DistEnv(dist.get_world_size(), dist.get_rank(), local_rank, dist.get_backend())


def teardown() -> None:
    """Leave the process group (end of `python -m harness.train`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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
    # transformers 5.2x renamed it activation_checkpointing_enable (the old name warns FutureWarning)
    if hasattr(target, "activation_checkpointing_enable"):
        target.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class Engine:
    """Policy or critic with its AdamW and learning-rate schedule: a DeepSpeed engine, or plain
    torch with gradients summed across ranks by hand. `backward` takes the globally normalized
    micro-batch loss; every `gradient_accumulation`-th call steps the optimizer. Calling it calls
    the engine (or module)."""

    def __init__(self, module: torch.nn.Module, lr: float, schedule: Callable[[int], float], cfg: TrainConfig,
                 env: DistEnv, device: torch.device):
        self.module, self.cfg, self.env = module, cfg, env
        # fused AdamW: one kernel per parameter instead of ~10 elementwise ops (same update, ~3x cheaper on CPU)
        # `optimizer` is what checkpoints hold: DeepSpeed's wrapper of `opt` under DeepSpeed, else `opt` itself
        self.opt = self.optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=cfg.ppo.weight_decay,
                                                      fused=device.type in ("cpu", "cuda"))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        d = cfg.distributed
        self.stage = d.zero_stage if d.deepspeed else 0
        self.gas, self.ckpt = d.gradient_accumulation, d.gradient_checkpointing
        self.engine = None
        if self.ckpt:
            enable_gradient_checkpointing(module)
        if d.deepspeed:
            import deepspeed

            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=module, optimizer=self.opt, lr_scheduler=self.sched,
                config=ds_config(cfg, env.world_size, train=True, on_gpu=device.type == "cuda"),
            )
            self.engine.eval()
        self._micro = 0

    @property
    def keeps_graphs(self) -> bool:
        """Whether a forward made outside `training()` may be back-propagated later (plain torch,
        one micro-batch per step, no activation recomputation)."""
        return self.engine is None and self.gas == 1 and not self.ckpt

    @property
    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    def __call__(self, *args, **kwargs):
        return (self.engine or self.module)(*args, **kwargs)

    @contextlib.contextmanager
    def training(self):
        """Train mode only matters for gradient checkpointing (dropout is zeroed then)."""
        target = self.engine or self.module
        if self.ckpt:
            target.train()
        try:
            yield
        finally:
            if self.ckpt:
                target.eval()

    def backward(self, loss: torch.Tensor) -> float | None:
        """Accumulate one micro-batch; the last of `gas` steps the optimizer and returns the
        global gradient norm before clipping (None before that)."""
        self._micro += 1
        last = self._micro == self.gas
        if self.engine is not None:
            # DeepSpeed averages over ranks; our loss is already a share of the global mean.
            self.engine.backward(loss * self.env.world_size, scale_wrt_gas=False)
            norm = self._grad_norm() if last and self.stage == 0 else None
            self.engine.step()
        else:
            loss.backward()
        if not last:
            return None
        self._micro = 0
        if self.engine is None:
            norm = self._step()
        elif norm is None:
            g = self.engine.get_global_grad_norm()
            norm = float(g) if g is not None else float("nan")
        # fp16 under DeepSpeed: the loss scaler skips overflowing steps itself
        if not math.isfinite(norm) and not (self.engine is not None and self.cfg.distributed.precision == "fp16"):
            raise NonFiniteLoss(f"gradient norm is {norm} (non-finite); "
                                "try a lower learning rate or ppo.max_grad_norm > 0")
        return norm

    def _step(self) -> float:
        """Plain torch: sum gradients over ranks (one flat all-reduce), clip, step; the norm before clipping."""
        params = [q for q in self.module.parameters() if q.grad is not None]
        if self.env.active:
            flat = self.env.all_reduce(torch.cat([q.grad.reshape(-1) for q in params]))
            for q, g in zip(params, flat.split([q.numel() for q in params])):
                q.grad.copy_(g.view_as(q.grad))
        max_norm = self.cfg.ppo.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")).item()
        if math.isfinite(norm):  # a non-finite step would only poison the weights before the run fails
            self.opt.step()
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return norm

    def _grad_norm(self) -> float:
        grads = [q.grad.detach().float() for q in self.module.parameters() if q.grad is not None]
        if not grads:
            return 0.0
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()

    # ---------------------------------------------------------------- consolidated state
    def full_state(self) -> tuple[dict, dict]:
        """(module state_dict, torch AdamW state_dict) with full fp32 tensors on CPU.

        Collective under ZeRO (call on every rank); ranks other than 0 may drop the result.
        """
        if not self.stage:
            return _cpu(self.module.state_dict()), _cpu(self.optimizer.state_dict())
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        def full(q: torch.Tensor, key: str | None = None) -> torch.Tensor:
            v = safe_get_full_fp32_param(q) if key is None else safe_get_full_optimizer_state(q, key)  # collective
            if not self.env.is_main:
                return torch.empty(0)
            return v.detach().float().cpu().reshape(getattr(q, "ds_shape", q.shape))

        params = list(self.module.parameters())
        by_id = {id(q): full(q) for q in params}
        weights = {k: by_id.get(id(t), t.detach().cpu()) for k, t in self.module.state_dict(keep_vars=True).items()}
        inner = self.optimizer.optimizer  # AdamW over ZeRO's flat fp32 partitions
        step = next((st["step"] for st in inner.state.values() if "step" in st), None)
        state = {} if step is None else {
            i: {"step": torch.as_tensor(step, dtype=torch.float32).cpu().clone(),
                "exp_avg": full(q, "exp_avg"), "exp_avg_sq": full(q, "exp_avg_sq")}
            for i, q in enumerate(params)
        }
        group = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
        return weights, {"state": state, "param_groups": [{**group, "params": list(range(len(params)))}]}

    def load_full_state(self, weights: dict, opt_state: dict | None) -> None:
        """Inverse of `full_state`, from any world size or stage (or a single-process checkpoint)."""
        if not self.stage:
            self.module.load_state_dict(weights)
            if opt_state is not None:
                self.optimizer.load_state_dict(opt_state)
            return
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        named = dict(self.module.named_parameters())
        missing = [k for k in named if k not in weights]
        if missing:
            raise KeyError(f"checkpoint lacks weights for {missing[:5]}")
        if opt_state and opt_state.get("state"):
            self._create_optimizer_state()
        # ZeRO-3 holds no whole parameter outside a gather: rank 0 writes it there, ZeRO re-partitions
        with deepspeed.zero.GatheredParameters(list(named.values()), modifier_rank=0, enabled=self.stage == 3):
            if self.env.is_main or self.stage < 3:
                for k, q in named.items():
                    q.data.copy_(weights[k].to(device=q.device, dtype=q.dtype))
        for k, q in named.items():
            safe_set_full_fp32_param(q, weights[k].to(q.device if q.numel() else _ds_device()).float())
        for name, buf in self.module.named_buffers():
            if name in weights:
                buf.copy_(weights[name].to(buf.dtype))
        if not (opt_state and opt_state.get("state")):
            return
        step = None
        for i, q in enumerate(named.values()):
            ent = opt_state["state"].get(i) or opt_state["state"].get(str(i))
            if ent is not None:
                step = ent["step"]
                for k in ("exp_avg", "exp_avg_sq"):
                    safe_set_full_optimizer_state(q, ent[k].to(_ds_device()).float(), k)
        inner = self.optimizer.optimizer
        for st in inner.state.values():
            if step is not None:
                st["step"] = torch.as_tensor(step, dtype=torch.float32).clone().to(st["step"].device)
        for g in inner.param_groups:
            g.update({k: v for k, v in opt_state["param_groups"][0].items() if k != "params" and k in g})

    def _create_optimizer_state(self) -> None:
        """AdamW creates its state at its first step, and ZeRO links each parameter to its slice of
        that state only then: take one real step of zero gradients at learning rate 0, which moves
        no weight and leaves zero moments (then overwritten; the schedule and learning rate are
        restored from the checkpoint afterwards)."""
        for g in self.optimizer.optimizer.param_groups:
            g["lr"] = 0.0
        ids = torch.zeros(1, 2, dtype=torch.long, device=_ds_device())
        ones = torch.ones_like(ids)
        for _ in range(self.gas):
            out = self.engine(input_ids=ids, attention_mask=ones, position_ids=ones.cumsum(1) - 1)
            self.backward(0.0 * getattr(out, "logits", out).float().sum())


def _ds_device() -> torch.device:
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


def frozen(module: torch.nn.Module, cfg: TrainConfig, env: DistEnv, device: torch.device) -> torch.nn.Module:
    """Reference / reward model: sharded by a ZeRO-3 inference engine at stage 3, else the module
    itself (`Models` loaded it in the run's precision). Returns what forward calls go to."""
    d = cfg.distributed
    if d.deepspeed and d.zero_stage == 3:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=module, config=ds_config(cfg, env.world_size, train=False, on_gpu=device.type == "cuda"))
        engine.eval()
        return engine.module
    return module


def agree_stop(env: DistEnv, stop: bool, run_dir: Path) -> bool:
    """Rank 0's stop decision (callback or a STOP file in the run folder), the same on every rank."""
    if env.is_main:
        f = Path(run_dir) / keys.STOP_FILE
        if f.exists():
            f.unlink(missing_ok=True)  # honoured once: a later --resume runs on
            stop = True
    return bool(env.broadcast_object(stop))
