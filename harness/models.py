"""Building the four models of a run: policy, frozen reference, frozen reward model, critic (each a
Hugging Face name, a local directory, or `world:NAME` inside the embedded world's directory)."""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from .algorithms.estimators import NEEDS_CRITIC
from .config import TrainConfig
from .world.load import WORLD_FILE


class ModelPathError(ValueError):
    pass


def resolve_path(path: str, cfg: TrainConfig, field: str) -> str:
    """`world:sft` -> the world's sft dir; local dirs must exist; other strings are HF names."""
    if path.startswith("world:"):
        from .world import WorldError, load_world  # the world package is only needed for world: paths

        name = path.split(":", 1)[1]
        world_dir = Path(cfg.data.world_dir)
        if not world_dir.exists():
            raise ModelPathError(
                f"{field}: {path!r} needs the embedded world in data.world_dir={str(world_dir)!r}, which does not "
                f"exist; build it with `python -m harness.world build --out {world_dir}`"
            )
        try:
            world = load_world(world_dir)
        except WorldError as e:  # a world.json that cannot be read: the problem, not a traceback
            raise ModelPathError(f"{field}: {path!r}: {e}") from None
        attr = f"{name}_dir"
        if not hasattr(world, attr):
            raise ModelPathError(f"{field}: got {path!r}; allowed: world:sft, world:pretrained, world:reward, world:tokenizer")
        return str(getattr(world, attr))
    p = Path(path)
    if (path.startswith((".", "/", "~")) or p.exists()) and not p.is_dir():
        raise ModelPathError(f"{field}: {path!r} is not a directory with a saved model")
    return path


def audit_paths(cfg: TrainConfig) -> list[str]:
    """model.audit_reward_paths resolved: `auto` = the world's audit RMs where built, `world` = those,
    built now if missing (harness.world.audit), `none` = [], else each path as resolve_path resolves it."""
    spec = cfg.model.audit_reward_paths
    if spec == "none":
        return []
    if spec in ("auto", "world"):
        if cfg.data.source != "world" or not (Path(cfg.data.world_dir) / WORLD_FILE).is_file():
            return []
        from .world.audit import ensure_audit, member_dirs

        dirs = ensure_audit(cfg.data.world_dir, progress=False) if spec == "world" else member_dirs(cfg.data.world_dir)
        return [str(d) for d in dirs]
    return [resolve_path(p, cfg, f"model.audit_reward_paths[{i}]") for i, p in enumerate(spec)]


def _local_config(path: str, field: str) -> tuple[object | None, str | None]:
    """(model config, None) when `path` is a local directory or already in the Hugging Face cache,
    else (None, the problem). Never touches the network: runs do not download weights."""
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True), None
    except (OSError, ValueError) as e:
        where = "a directory without a readable config.json" if Path(path).is_dir() else (
            "neither a local directory nor a model in the Hugging Face cache; download it first "
            f"(`huggingface-cli download {path}`) or give a local directory")
        return None, f"{field}: got {path!r}; it is {where} ({type(e).__name__})"


def context_of(model_config: object) -> int:
    """The most positions (prompt + response tokens) a model takes, from its config (10**9 when it
    names no limit)."""
    return (getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
            or 10**9)


def preflight(cfg: TrainConfig) -> list[str]:
    """Every problem that would fail the run after it starts, found in seconds before it exists:
    data files and world, each model path resolved (locally only), the response cap
    (generation.max_new_tokens) inside the policy's context, and the vocabularies of the
    tokenizer, policy, reference, reward model and critic agreeing (the RM scores the policy's
    token ids, so one tokenizer must serve all four)."""
    problems: list[str] = []
    d = cfg.data
    if d.source == "world" and not (Path(d.world_dir) / WORLD_FILE).is_file():
        problems.append(f"data.world_dir: got {d.world_dir!r}; it holds no built world. Build it with "
                        f"`python -m harness.world build --out {d.world_dir}`")
        return problems
    if d.source == "hh_rlhf" and not Path(d.hh_path).is_file():
        problems.append(f"data.hh_path: got {d.hh_path!r}; allowed: an existing HH-RLHF .jsonl or .jsonl.gz file")
    m = cfg.model
    fields = {"model.sft_path": m.sft_path, "model.reward_path": m.reward_path}
    if m.policy_init == "pretrained":
        fields["model.pretrained_path"] = m.pretrained_path
    if m.critic_path and cfg.ppo.adv_estimator in NEEDS_CRITIC:
        fields["model.critic_path"] = m.critic_path
    if isinstance(m.audit_reward_paths, list):
        fields |= {f"model.audit_reward_paths[{i}]": p for i, p in enumerate(m.audit_reward_paths)}
    vocab: dict[str, int] = {}
    policy = "model.sft_path" if m.policy_init == "sft" else "model.pretrained_path"
    for field, raw in fields.items():
        try:
            path = resolve_path(raw, cfg, field)
        except ModelPathError as e:
            problems.append(str(e))
            continue
        conf, problem = _local_config(path, field)
        if problem:
            problems.append(problem)
            continue
        if getattr(conf, "vocab_size", None):
            vocab[field] = int(conf.vocab_size)
        if field.startswith("model.audit_reward_paths") and getattr(conf, "num_labels", 1) != 1:
            problems.append(f"{field}: {raw!r} has {conf.num_labels} labels; allowed: a reward model with exactly 1")
        if field == policy and cfg.generation.max_new_tokens >= context_of(conf):
            problems.append(f"generation.max_new_tokens: got {cfg.generation.max_new_tokens}; allowed: less than the "
                            f"policy's context of {context_of(conf)} tokens ({policy} {raw!r}), leaving room for the prompt")
    if len(set(vocab.values())) > 1:
        problems.append("the models' vocabularies differ (" + ", ".join(f"{k}: {v}" for k, v in vocab.items())
                        + "); the reward model and critic score the policy's token ids, so all must share one tokenizer")
    if not problems and cfg.collapse.enabled and cfg.collapse.detector not in ("default", "off"):
        from .detector import load_params, needs_audit

        has_audit = cfg.model.audit_reward_paths == "world" and cfg.data.source == "world" or audit_paths(cfg)
        if needs_audit(load_params(cfg.collapse.detector)) and not has_audit:
            problems.append(f"collapse.detector: {cfg.collapse.detector!r} reads the audit reward models' signals "
                            f"(audit/*), which this run does not log (model.audit_reward_paths="
                            f"{cfg.model.audit_reward_paths!r} gives none); allowed: a detector fit without them "
                            "(`python -m analysis.detector fit --families base,diversity`), default, or off, "
                            "or audit reward models (`python -m harness.world build` makes the world's)")
    if not problems:
        try:
            tok = load_tokenizer(cfg)
        except (OSError, ValueError) as e:
            return [f"model.tokenizer_path: the tokenizer of {m.tokenizer_path or m.sft_path!r} cannot be loaded "
                    f"locally ({type(e).__name__}: {e})"]
        n_tok = len(tok)
        if cfg.data.chat_template == "on" and not tok.chat_template:
            problems.append(f"data.chat_template: got 'on' but the tokenizer of {m.tokenizer_path or m.sft_path!r} has no "
                            "chat template; allowed: auto (the template where there is one) or off")
        small = {k: v for k, v in vocab.items() if v < n_tok}
        if small:
            problems.append(f"model.tokenizer_path: the tokenizer has {n_tok} tokens, more than the vocabulary of "
                            + ", ".join(f"{k} ({v})" for k, v in small.items()))
    return problems


def base_of(model: nn.Module) -> nn.Module:
    """The transformer trunk of an HF model with a head (GPT-2: .transformer, Llama: .model)."""
    return getattr(model, model.base_model_prefix)


class ScalarHeadModel(nn.Module):
    """A trunk and a linear head giving one scalar per position: the reward model (read at the last
    real token) and the critic (read at every response position). We run the trunk and pick the
    positions ourselves, so padded rows are scored at exactly the tokens we mean (no pad-token search)."""

    def __init__(self, trunk: nn.Module, head: nn.Linear):
        super().__init__()
        self.trunk = trunk
        self.head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def load_tokenizer(cfg: TrainConfig):
    path = resolve_path(cfg.model.tokenizer_path or cfg.model.sft_path, cfg, "model.tokenizer_path")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.eos_token_id is None:
        raise ModelPathError(f"model.tokenizer_path: the tokenizer at {path!r} has no eos token; responses could never end")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def uses_chat_template(tok, cfg: TrainConfig) -> bool:
    """Whether prompts go through the tokenizer's chat template (data.chat_template)."""
    return cfg.data.chat_template == "on" or (cfg.data.chat_template == "auto" and bool(tok.chat_template))


def encode_prompt(tok, text: str, cfg: TrainConfig) -> list[int]:
    """A prompt's token ids as the model met prompts in its training: through the tokenizer's chat
    template as a dialogue ending in the assistant's turn (data.chat_template), else the text with
    the special tokens the tokenizer adds (data.add_special_tokens: a Llama or Mistral BOS). The
    response follows these ids, so the reward model and critic score the same encoding."""
    if uses_chat_template(tok, cfg):
        from .data.hh_rlhf import dialogue_messages

        ids = list(tok.apply_chat_template(dialogue_messages(text), add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
        bos = tok.bos_token_id
        return ids[1:] if not cfg.data.add_special_tokens and bos is not None and ids[:1] == [bos] else ids
    return tok(text, add_special_tokens=cfg.data.add_special_tokens)["input_ids"]


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def load_reward_model(path: str, dtype: torch.dtype = torch.float32, field: str = "model.reward_path") -> ScalarHeadModel:
    rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
    head = rm.score if hasattr(rm, "score") else rm.classifier
    if head.out_features != 1:
        raise ModelPathError(f"{field}: {path!r} has {head.out_features} labels; a reward model needs exactly 1")
    return ScalarHeadModel(base_of(rm), head)


def build_critic(cfg: TrainConfig, sft_path: str, reward_path: str, dtype: torch.dtype = torch.float32) -> ScalarHeadModel:
    """Critic initialization (trick 8): from the reward model, the SFT trunk, or random."""
    mode = cfg.model.critic_init
    if mode == "reward":
        rm = load_reward_model(reward_path, dtype)
        return ScalarHeadModel(copy.deepcopy(rm.trunk), copy.deepcopy(rm.head))
    if mode == "sft":
        trunk = base_of(load_causal_lm(sft_path, dtype))
    else:  # random: same architecture, fresh weights
        trunk = AutoModel.from_config(AutoConfig.from_pretrained(sft_path))
    hidden = trunk.config.hidden_size
    head = nn.Linear(hidden, 1, bias=True)
    nn.init.normal_(head.weight, std=1.0 / (hidden + 1) ** 0.5)
    nn.init.zeros_(head.bias)
    return ScalarHeadModel(trunk, head)


class Models:
    """The four models of a run (three for a critic-free estimator), on one device, reference and reward frozen."""

    def __init__(self, cfg: TrainConfig, device: torch.device):
        sft = resolve_path(cfg.model.sft_path, cfg, "model.sft_path")
        reward = resolve_path(cfg.model.reward_path, cfg, "model.reward_path")
        policy_src = sft if cfg.model.policy_init == "sft" else resolve_path(cfg.model.pretrained_path, cfg, "model.pretrained_path")
        self.tokenizer = load_tokenizer(cfg)
        # DeepSpeed bf16/fp16 runs load weights in that precision (a 7B model in fp32 would not fit)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.distributed.precision, torch.float32) if cfg.distributed.deepspeed else torch.float32
        self.policy = load_causal_lm(policy_src, dtype).to(device).eval()  # dropout off: first-minibatch ratios are 1
        self.reference = load_causal_lm(sft, dtype).to(device).eval().requires_grad_(False)
        self.reward = load_reward_model(reward, dtype).to(device).eval().requires_grad_(False)
        # audit RMs: scored on every training sample, never trained on (harness.signals)
        self.audit = [load_reward_model(a, dtype, "model.audit_reward_paths").to(device).eval().requires_grad_(False)
                      for a in audit_paths(cfg)]
        self.critic: ScalarHeadModel | None = None  # critic-free advantage estimators build none
        if cfg.ppo.adv_estimator in NEEDS_CRITIC:
            torch.manual_seed(cfg.seed + 1)  # the critic's fresh head/weights depend on the seed only
            src = resolve_path(cfg.model.critic_path, cfg, "model.critic_path") if cfg.model.critic_path else None
            self.critic = build_critic(cfg, src or sft, src or reward, dtype).to(device).eval()
