"""The one typed config of a harness run.

Every knob is a typed field with a default and its doc string right under it (CleanRL style).
Configs come from YAML (safe loader only) plus dotted overrides (`--set ppo.kl_coef=0.1`), and are
validated completely before any model is built: an unknown key names the closest valid keys, a bad
type or out-of-range value names the field, the value and what is allowed.

Paper references ("Secrets of RLHF I", "APA") point to `../shared/docs/paper-notes.md`.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import inspect
import json
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml


@dataclass(frozen=True)
class Range:
    """Allowed numeric interval for a field; None = unbounded; `*_open` excludes the end."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def ok(self, v: float) -> bool:
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        if self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)):
            return False
        return True

    def describe(self) -> str:
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo:g}")
        if self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {self.hi:g}")
        return " and ".join(parts) or "any number"


Pos = Range(0, None, lo_open=True)  # > 0
NonNeg = Range(0, None)  # >= 0
Unit = Range(0, 1)  # [0, 1]
PosInt = Range(1, None)  # >= 1


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    sft_path: str = "world:sft"
    """SFT causal LM: a Hugging Face name, a local directory, or `world:sft` (inside data.world_dir). It is also the frozen reference model."""
    pretrained_path: str = "world:pretrained"
    """Pretrained (non-SFT) causal LM, used when policy_init=pretrained (paper Fig. 8)."""
    reward_path: str = "world:reward"
    """Reward model: a sequence-classification model with one scalar head, scored at the last token."""
    critic_path: str | None = None
    """Where the critic's weights come from: null = model.reward_path when critic_init=reward, else model.sft_path (any HF name or local dir)."""
    tokenizer_path: str | None = None
    """Tokenizer directory or name; null = the one saved with sft_path."""
    policy_init: Literal["sft", "pretrained"] = "sft"
    """Where the policy starts: the SFT model, or the pretrained model without SFT (trick 9). The reference stays the SFT model either way."""
    critic_init: Literal["reward", "sft", "random"] = "reward"
    """Critic start (trick 8): `reward` = reward-model trunk and head applied per token (PPO-max); `sft` = SFT trunk with a fresh random head; `random` = SFT architecture with random weights."""
    autocast: Literal["none", "bf16"] = "none"
    """Mixed precision for forward passes: `bf16` autocast (CPUs with avx512_bf16, GPUs); losses and optimizer state stay fp32."""


@dataclass
class DataConfig:
    source: Literal["world", "hh_rlhf"] = "world"
    """Prompt source: the embedded world (`python -m harness.world build`) or an Anthropic HH-RLHF jsonl(.gz) file."""
    world_dir: str = ".harness/world"
    """Directory of the built embedded world; `world:` model paths resolve inside it."""
    hh_path: str = ""
    """HH-RLHF jsonl or jsonl.gz file (`chosen`/`rejected` dialogues), used when source=hh_rlhf."""
    max_prompt_tokens: Annotated[int, PosInt] = 64
    """Prompts longer than this keep their last tokens (the end of a dialogue matters most); they are cut further if prompt + generation.max_new_tokens would not fit the policy's context."""
    eval_prompts: Annotated[int, NonNeg] = 64
    """Held-out prompts scored at eval steps (gold reward, win rate vs SFT, RM score histogram)."""


@dataclass
class GenerationConfig:
    max_new_tokens: Annotated[int, PosInt] = 24
    """Response length cap in tokens; `response/frac_at_cap` measures how many runs into it."""
    temperature: Annotated[float, Pos] = 1.0
    """Sampling temperature; log-probs for the losses use the same temperature."""
    top_k: Annotated[int, NonNeg] = 0
    """Keep only the k most likely tokens when sampling (0 = off)."""
    top_p: Annotated[float, Range(0, 1, lo_open=True)] = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    stop_at_eos: bool = True
    """End a response at the EOS token (it counts as the last response token); false = always run to the cap."""


@dataclass
class PPOConfig:
    steps: Annotated[int, NonNeg] = 200
    """PPO steps (one rollout batch, then ppo_epochs over it, per step)."""
    rollout_batch_size: Annotated[int, PosInt] = 32
    """Prompts sampled per step (one response each)."""
    ppo_epochs: Annotated[int, PosInt] = 2
    """Passes over each rollout batch."""
    num_minibatches: Annotated[int, PosInt] = 2
    """Minibatches per epoch; rollout_batch_size must divide evenly."""
    policy_lr: Annotated[float, Pos] = 5e-5
    """Policy AdamW learning rate."""
    critic_lr: Annotated[float, Pos] = 1e-4
    """Critic AdamW learning rate."""
    warmup_steps: Annotated[int, NonNeg] = 0
    """Linear learning-rate warmup, in optimizer updates, for both policy and critic."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate shape after warmup, decaying to zero at the last update (`constant` = none)."""
    weight_decay: Annotated[float, NonNeg] = 0.0
    """AdamW weight decay."""
    gamma: Annotated[float, Unit] = 1.0
    """GAE discount; the reference code uses 1."""
    gae_lambda: Annotated[float, Unit] = 0.95
    """GAE lambda (trick 10): 0 = one-step TD, 1 = Monte-Carlo returns. Paper figures use 0.9 unless varied (Fig. 19)."""
    clip_eps: Annotated[float | None, Pos] = 0.2
    """Clipped surrogate epsilon (trick 11); null = unclipped ratio * advantage."""
    value_clip: Annotated[float | None, Pos] = 0.2
    """Value-loss clipping delta_vf (trick 7): 0.5*max((V-R)^2, (clip(V, V_old+-delta_vf)-R)^2); null = plain 0.5*(V-R)^2."""
    max_grad_norm: Annotated[float, NonNeg] = 1.0
    """Global gradient clipping (trick 12), per model; 0 = off. The norm before clipping is logged either way."""
    policy_loss: Literal["ppo", "apa", "awr"] = "ppo"
    """Policy objective: `ppo` clipped surrogate; `apa` squared error to pi_init*exp(A/apa_lambda); `awr` advantage-weighted regression."""
    importance_sampling: bool = True
    """For policy_loss=ppo (trick 2, Fig. 7). On: the surrogate uses ratio = pi_theta/pi_rollout, so reusing the buffer for several epochs/minibatches is corrected (and clipped if clip_eps). Off: plain on-policy policy gradient -A*log pi_theta, treating every epoch's data as if freshly sampled (no ratio, no clipping)."""
    apa_lambda: Annotated[float, Pos] = 0.1
    """APA lambda: loss = mean((log pi - A/lambda - log pi_init)^2); larger stays closer to pi_init (= the reference)."""
    awr_beta: Annotated[float, Pos] = 2.0
    """AWR temperature: loss = -mean(log pi * exp(A/beta))."""
    awr_max_weight: Annotated[float | None, Pos] = None
    """Clip AWR weights exp(A/beta) to at most this (null = unclipped, as the reference code)."""
    adv_normalize: bool = True
    """Advantage normalization (trick 6): masked whitening per minibatch."""
    adv_clip: Annotated[float | None, Pos] = None
    """Advantage clipping delta_a: clamp to +-delta_a after normalization (null = off)."""
    kl_coef: Annotated[float, NonNeg] = 0.05
    """Token-level KL penalty eta (trick 1): r_t = -eta * KL_t at every response token; 0 = off."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL estimator for the penalty: k1 = log(pi/ref); k2 = 0.5*log(pi/ref)^2; k3 = ref/pi - 1 - log(ref/pi)."""
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    """`fixed` eta, or the adaptive controller of Ziegler et al.: eta *= 1 + clip(kl/kl_target - 1, +-0.2) * batch/kl_horizon."""
    kl_target: Annotated[float, Pos] = 0.1
    """Adaptive controller target, in the units of objective/kl (mean per-token k1, nats)."""
    kl_horizon: Annotated[int, PosInt] = 10000
    """Adaptive controller horizon in samples."""
    entropy_coef: Annotated[float, NonNeg] = 0.0
    """Entropy bonus weight (trick 3); 0 = off. Without entropy_target the loss adds -coef * entropy."""
    entropy_target: Annotated[float | None, NonNeg] = None
    """The paper's entropy clip: loss adds coef * |entropy - target| instead (mean per-token entropy, nats; the paper's 30 was in its own units)."""
    ptx_coef: Annotated[float, NonNeg] = 0.0
    """PPO-ptx: weight of the LM loss on SFT data added to the policy loss; 0 = off."""
    ptx_batch_size: Annotated[int, PosInt] = 16
    """SFT sequences per PPO-ptx minibatch."""
    critic_pretrain_steps: Annotated[int, NonNeg] = 0
    """Critic pretraining (trick 8): this many rollout steps updating only the critic, policy frozen, before PPO starts."""
    reuse_rollout_logprobs: bool = False
    """Take old log-probs from the sampling pass instead of a separate forward (faster; ratios then differ from 1 by the KV-cache round-off)."""


@dataclass
class RewardConfig:
    scale: bool = False
    """Reward scaling (trick 4): divide the RM score by its running std. Ignored when normalize is on."""
    normalize: bool = True
    """Reward normalization (trick 5): (r - running mean) / running std. Independent of `scale` (the reference code's quirk that normalization needs scaling is not copied)."""
    clip: Annotated[float | None, Pos] = 0.8
    """Reward clipping delta_r: clamp the processed score to +-delta (null = off; 0 is refused, since it would zero every reward)."""
    running_stats_init: Annotated[int, NonNeg] = 0
    """Rollout batches scored before PPO starts only to seed the running statistics (0 = stats start empty)."""


@dataclass
class LoggingConfig:
    tracking_uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI (sqlite file, directory or server URL)."""
    experiment: str = "harness"
    """MLflow experiment name."""
    run_name: str | None = None
    """MLflow run name and checkpoint folder name (null = generated from experiment, policy loss and seed)."""
    parent_run_id: str | None = None
    """Log as a child of this MLflow run (set by the ablation runner and sweeps)."""
    tags: dict[str, str] = field(default_factory=dict)
    """Extra MLflow tags for the run."""
    output_dir: str = "runs"
    """Checkpoints and run files go under output_dir/run_name."""
    sample_every: Annotated[int, NonNeg] = 50
    """Log a table of sample prompts/responses/rewards every N steps (0 = only at the end)."""
    num_samples: Annotated[int, NonNeg] = 8
    """Rows in each sample table."""
    eval_every: Annotated[int, NonNeg] = 50
    """Score held-out prompts every N steps: gold reward, win rate vs SFT, RM score histogram (0 = off)."""
    checkpoint_every: Annotated[int, NonNeg] = 50
    """Save policy, critic, optimizers and running stats every N steps (0 = only at the end)."""
    progress: bool = True
    """Show a progress bar."""


@dataclass
class CollapseConfig:
    enabled: bool = True
    """Run the collapse rule: a step is collapsing when gold reward (world only) has fallen more than gold_drop below its best, or when at least two of {kl > kl_max, ppl < ppl_min, frac_at_cap > cap_frac_max} hold; `patience` collapsing steps in a row mark the run collapsed at the first of them."""
    kl_max: Annotated[float, Pos] = 2.0
    """Bound on objective/kl (mean per-token k1, nats)."""
    ppl_min: Annotated[float, Range(1, None)] = 1.3
    """Policy perplexity of its own samples below this counts as degenerate."""
    cap_frac_max: Annotated[float, Unit] = 0.9
    """Fraction of responses at the length cap above this counts as running on."""
    gold_drop: Annotated[float, Pos] = 0.5
    """Fall of the smoothed gold reward below its peak that counts as collapse."""
    smoothing: Annotated[float, Range(0, 1, hi_open=True)] = 0.8
    """EMA factor for the gold-reward and indicator smoothing inside the rule."""
    patience: Annotated[int, PosInt] = 10
    """Consecutive collapsing steps before the run is marked collapsed."""
    stop_on_collapse: bool = False
    """End training once collapse is detected (status FINISHED, tag harness.collapsed=true)."""


@dataclass
class DistributedConfig:
    deepspeed: bool = False
    """Wrap policy and critic with deepspeed.initialize (launch with `deepspeed` or `torchrun`)."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage; 3 also shards the frozen reference and reward models."""
    offload_optimizer: bool = False
    """ZeRO CPU offload of optimizer state."""
    offload_params: bool = False
    """ZeRO-3 CPU offload of parameters."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """DeepSpeed training precision."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    gradient_accumulation: Annotated[int, PosInt] = 1
    """Micro-batches accumulated per optimizer step."""


@dataclass
class TrainConfig:
    seed: int = 0
    """Seed for torch, sampling and data order; two runs with one seed and config are identical."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` = CUDA when available, else CPU."""
    threads: Annotated[int, NonNeg] = 0
    """torch intra-op threads (0 = torch's default)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy, reference, reward and critic models and their initialization."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt source."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """The PPO/APA/AWR update and its tricks."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward-model score processing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """MLflow, samples, eval and checkpoints."""
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    """Collapse detection."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """DeepSpeed ZeRO (multi-process)."""


# --------------------------------------------------------------------------------------------
# Errors, docs, introspection
# --------------------------------------------------------------------------------------------
class ConfigError(ValueError):
    """Bad config input; the message lists every problem found, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n  - " + "\n  - ".join(problems))


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The doc string written under each field of a config dataclass."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = str(nxt.value.value)
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _unwrap(tp: Any) -> tuple[Any, Range | None]:
    if get_origin(tp) is Annotated:
        base, *meta = get_args(tp)
        rng = next((m for m in meta if isinstance(m, Range)), None)
        return base, rng
    return tp, None


def _is_optional(tp: Any) -> tuple[bool, Any]:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) < len(get_args(tp)):
            return True, args[0] if len(args) == 1 else Union[tuple(args)]
    return False, tp


def describe_type(tp: Any) -> str:
    base, rng = _unwrap(tp)
    opt, inner = _is_optional(base)
    if get_origin(inner) is Literal:
        s = "one of " + ", ".join(repr(a) for a in get_args(inner))
    elif inner is bool:
        s = "true or false"
    elif inner in (int, float):
        s = ("an integer" if inner is int else "a number") + (f" {rng.describe()}" if rng else "")
    elif inner is str:
        s = "a string"
    elif get_origin(inner) is dict:
        s = "a mapping of strings"
    elif dataclasses.is_dataclass(inner):
        s = "a section"
    else:
        s = str(inner)
    return s + (" or null" if opt else "")


def _coerce(path: str, value: Any, tp: Any, problems: list[str]) -> Any:
    """Check one leaf value against its annotation; return the (possibly int->float) value."""
    base, rng = _unwrap(tp)
    opt, inner = _is_optional(base)
    allowed = describe_type(tp)
    bad = f"{path}: got {value!r}; allowed: {allowed}"
    if value is None:
        if opt:
            return None
        problems.append(bad)
        return value
    if get_origin(inner) is Literal:
        choices = get_args(inner)
        if value in choices and type(value) is type(choices[choices.index(value)]):
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        problems.append(bad + (f" (did you mean {close[0]!r}?)" if close else ""))
        return value
    if inner is bool:
        if isinstance(value, bool):
            return value
        problems.append(bad)
        return value
    if inner in (int, float):
        if isinstance(value, str):
            # YAML 1.1 reads `1e-5` (no dot) as a string; accept what any researcher means by it
            try:
                value = float(value) if inner is float else int(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(bad)
            return value
        if inner is int and not isinstance(value, int):
            if float(value).is_integer():
                value = int(value)
            else:
                problems.append(bad)
                return value
        if inner is float:
            value = float(value)
            if value != value or value in (float("inf"), float("-inf")):
                problems.append(bad)
                return value
        if rng is not None and not rng.ok(value):
            problems.append(bad)
        return value
    if inner is str:
        if isinstance(value, str):
            return value
        problems.append(bad)
        return value
    if get_origin(inner) is dict:
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        problems.append(bad)
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {path}")


def _build(cls: type, data: Any, prefix: str, problems: list[str]) -> Any:
    if not isinstance(data, dict):
        problems.append(f"{prefix or 'config'}: got {data!r}; allowed: a mapping of keys from {sorted(f.name for f in dataclasses.fields(cls))}")
        return cls()
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in hints:
            close = difflib.get_close_matches(str(key), names, n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(prefix + c for c in close)}?" if close else f"valid keys here: {', '.join(names)}"
            problems.append(f"{path}: unknown key; {hint}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, f"{path}.", problems)
        else:
            kwargs[key] = _coerce(path, value, tp, problems)
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def from_dict(data: dict[str, Any] | None, cls: type = TrainConfig) -> Any:
    """Build and validate a config from a nested dict; raises ConfigError listing every problem."""
    problems: list[str] = []
    cfg = _build(cls, data or {}, "", problems)
    if not problems and isinstance(cfg, TrainConfig):
        problems += cross_checks(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def cross_checks(cfg: TrainConfig) -> list[str]:
    """Rules that span fields."""
    p: list[str] = []
    if cfg.ppo.rollout_batch_size % cfg.ppo.num_minibatches:
        p.append(
            f"ppo.num_minibatches: got {cfg.ppo.num_minibatches}; allowed: a divisor of "
            f"ppo.rollout_batch_size={cfg.ppo.rollout_batch_size}"
        )
    if cfg.data.source == "hh_rlhf" and not cfg.data.hh_path:
        p.append("data.hh_path: got ''; allowed: a path to an HH-RLHF .jsonl or .jsonl.gz file when data.source=hh_rlhf")
    if cfg.distributed.offload_params and cfg.distributed.zero_stage != 3:
        p.append(f"distributed.offload_params: got true with zero_stage={cfg.distributed.zero_stage}; allowed: only with zero_stage 3")
    return p


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def parse_value(text: str) -> Any:
    """Parse an override's value the way YAML would (`0.1`, `true`, `null`, `[a, b]`)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """['ppo.kl_coef=0.1', ...] -> {'ppo.kl_coef': 0.1}."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError([f"--set {item!r}: expected KEY=VALUE, e.g. ppo.kl_coef=0.1"])
        k, v = item.split("=", 1)
        out[k.strip()] = parse_value(v.strip())
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `over` into a copy of `base`; dotted keys in `over` address nested fields."""
    out = json.loads(json.dumps(base))
    for k, v in over.items():
        if "." in k:
            set_dotted(out, k, v)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config file {str(p)!r}: not found"])
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError([f"config file {str(p)!r}: not valid YAML: {e}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"config file {str(p)!r}: top level must be a mapping, got {type(data).__name__}"])
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> TrainConfig:
    """YAML file (optional) + overrides -> validated TrainConfig."""
    data = read_yaml(path) if path else {}
    over = parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {})
    return from_dict(merge(data, over))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and all(isinstance(x, (dict, int, float, str, bool, type(None))) for x in v.values()) and k != "tags":
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# Fields that name where a run is logged or stored rather than what it computes.
BOOKKEEPING = ("logging.", "device", "threads")


def config_hash(cfg: TrainConfig) -> str:
    """Hash of everything that changes what a run computes (not where it logs)."""
    flat = {k: v for k, v in flatten(to_dict(cfg)).items() if not k.startswith(BOOKKEEPING)}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def iter_fields(cls: type = TrainConfig, prefix: str = ""):
    """Yield (dotted key, type, default, doc) for every leaf field, for --help and docs."""
    hints = _hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            yield f"{prefix}{f.name}", tp, default, docs.get(f.name, "")


def help_text() -> str:
    lines = []
    section = None
    for key, tp, default, doc in iter_fields():
        sec = key.split(".")[0] if "." in key else ""
        if sec != section:
            section = sec
            lines.append(f"\n[{sec or 'top level'}]")
        lines.append(f"  {key} = {json.dumps(default)}   ({describe_type(tp)})")
        if doc:
            lines.append(f"      {doc}")
    return "\n".join(lines)
