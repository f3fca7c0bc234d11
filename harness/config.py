"""The one typed config of a harness run: typed fields, each with its default and docstring.

Configs come from YAML plus dotted overrides (`--set ppo.kl_coef=0.1`), validated completely by
`harness.schema` before any model is built; rules that span fields are `cross_checks`. Paper
references ("Secrets of RLHF I", "APA") are explained in docs/PAPER.md.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import AfterValidator, Field

from . import schema
from .algorithms import names
from .schema import (  # noqa: F401 - the code imports them from here
    Batch,
    Bool,
    ConfigError,
    Count,
    Float,
    Int,
    NonNeg,
    Pos,
    PosCount,
    Seed,
    Str,
    Unit,
    iter_fields,
    merge,
    parse_overrides,
    parse_value,
    read_yaml,
    section,
    set_dotted,
    to_dict,
)

Tokens = Annotated[Int, Field(ge=1, le=1_000_000)]
# The registries' names, read without torch (`harness.algorithms.names`): registering an estimator or a
# policy loss in its module is all it takes for the config to allow it.
AdvEstimator = Literal[names.ADV_ESTIMATORS]  # type: ignore[valid-type]
LossAggregation = Literal[names.LOSS_AGGREGATIONS]  # type: ignore[valid-type]
PolicyLoss = Literal[names.POLICY_LOSSES]  # type: ignore[valid-type]
NEEDS_CRITIC, NEEDS_GROUPS = names.NEEDS_CRITIC, names.NEEDS_GROUPS


def _checked(ok: Any, allowed: str) -> Any:
    """An AfterValidator refusing strings for which `ok(s)` is false; the error says `allowed`."""
    def check(s: str) -> str:
        if "\x00" in s or not ok(s):
            raise ValueError(f"allowed: {allowed}")
        return s

    return AfterValidator(check)


def _uri_or_path(s: str) -> bool:
    try:
        urlsplit(s)  # raises on malformed netlocs such as 'http://[::1'
    except ValueError:
        return False
    return bool(s) and not re.search(r"\s", s)


PathStr = Annotated[Str, _checked(lambda s: len(s) <= 4096, "a path (no NUL bytes, at most 4096 characters)")]
Name = Annotated[Str, _checked(lambda s: 0 < len(s) <= 200, "a non-empty name of at most 200 characters")]
FolderName = Annotated[Name, _checked(
    lambda s: not re.search(r"[/\\]", s) and s not in (".", ".."),
    "one folder name under logging.output_dir: no '/' or '\\', not '.' or '..'")]
TrackingURI = Annotated[Str, _checked(
    _uri_or_path, "an MLflow tracking URI (sqlite:///mlflow.db, http://host:5000, file:///dir) or a directory path, without spaces")]


@section
class ModelConfig:
    sft_path: PathStr = "world:sft"
    """SFT causal LM: a Hugging Face name, a local directory, or `world:sft` (inside data.world_dir). It is also the frozen reference model."""
    pretrained_path: PathStr = "world:pretrained"
    """Pretrained (non-SFT) causal LM, used when policy_init=pretrained (paper Fig. 8)."""
    reward_path: PathStr = "world:reward"
    """Reward model: a sequence-classification model with one scalar head, scored at the last token."""
    critic_path: PathStr | None = None
    """Where the critic's weights come from: null = model.reward_path when critic_init=reward, else model.sft_path (any HF name or local dir)."""
    tokenizer_path: PathStr | None = None
    """Tokenizer directory or name; null = the one saved with sft_path."""
    policy_init: Literal["sft", "pretrained"] = "sft"
    """Where the policy starts: the SFT model, or the pretrained model without SFT (trick 9). The reference stays the SFT model either way."""
    critic_init: Literal["reward", "sft", "random"] = "reward"
    """Critic start (trick 8): `reward` = reward-model trunk and head applied per token (PPO-max); `sft` = SFT trunk with a fresh random head; `random` = SFT architecture with random weights."""
    autocast: Literal["none", "bf16"] = "none"
    """Mixed precision for forward passes: `bf16` autocast (CPUs with avx512_bf16, GPUs); losses and optimizer state stay fp32."""
    audit_reward_paths: Literal["auto", "world", "none"] | list[PathStr] = "auto"
    """Audit reward models scored on every training sample as a second opinion on the reward (never trained on; logged as audit/*, read by the early warning; each costs about one reward-model forward a step): a list of reward-model paths (HF names or local dirs, one scalar label, the policy's vocabulary), `none`, `world` = the embedded world's own 3 audit RMs, built beside it on first use (each on fresh preference pairs the reward model never saw; harness.world.audit; ~2 CPU minutes once), or `auto` = those where already built (`python -m harness.world build --audit-rms 3`), else none."""


@section
class DataConfig:
    source: Literal["world", "hh_rlhf"] = "world"
    """Prompt source: the embedded world (`python -m harness.world build`) or an Anthropic HH-RLHF jsonl(.gz) file."""
    world_dir: PathStr = ".harness/world"
    """Directory of the built embedded world; `world:` model paths resolve inside it."""
    hh_path: PathStr = ""
    """HH-RLHF jsonl or jsonl.gz file (`chosen`/`rejected` dialogues), used when source=hh_rlhf."""
    max_prompt_tokens: Tokens = 64
    """Prompts longer than this keep their last tokens (the end of a dialogue matters most); they are cut further if prompt + generation.max_new_tokens would not fit the policy's context."""
    eval_prompts: Count = 64
    """Held-out prompts scored at eval steps (gold reward, win rate vs SFT, RM score histogram)."""
    add_special_tokens: Bool = True
    """Encode prompts with the special tokens the tokenizer adds for its model's training (a Llama or Mistral tokenizer's BOS; GPT-2's and the embedded world's add none), so the policy, reference, critic and reward model see what they were trained on; false = the text's tokens alone (with a chat template, its leading BOS dropped too)."""
    chat_template: Literal["auto", "on", "off"] = "auto"
    """Encode prompts through the tokenizer's chat template (an HH-RLHF dialogue as its user and assistant turns, other text as one user turn, ending in the template's assistant prompt): `auto` = when the tokenizer has one (the embedded world's has none), `on` = required (a tokenizer without one is refused before the run), `off` = the raw text."""


@section
class GenerationConfig:
    max_new_tokens: Tokens = 24
    """Response length cap in tokens; `response/frac_at_cap` measures how many runs into it."""
    temperature: Annotated[Float, Field(ge=0.05, le=100)] = 1.0
    """Sampling temperature; log-probs for the losses use the same temperature."""
    top_k: Count = 0
    """Keep only the k most likely tokens when sampling (0 = off)."""
    top_p: Annotated[Float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    stop_at_eos: Bool = True
    """End a response at the EOS token (it counts as the last response token); false = always run to the cap."""
    samples_per_prompt: PosCount = 1
    """G: responses sampled per prompt (a group; the group estimators need G >= 2). ppo.rollout_batch_size counts responses, so rollout_batch_size / G prompts are drawn per step."""


@section
class PPOConfig:
    steps: PosCount = 200
    """PPO steps (one rollout batch, then ppo_epochs over it, per step)."""
    rollout_batch_size: Batch = 32
    """Responses sampled per step: rollout_batch_size / generation.samples_per_prompt prompts, G responses each."""
    ppo_epochs: Annotated[Int, Field(ge=1, le=1000)] = 2
    """Passes over each rollout batch."""
    num_minibatches: Batch = 2
    """Minibatches per epoch; rollout_batch_size must divide evenly."""
    policy_lr: Pos = 5e-5
    """Policy AdamW learning rate."""
    critic_lr: Pos = 1e-4
    """Critic AdamW learning rate."""
    warmup_steps: Count = 0
    """Linear learning-rate warmup, in optimizer updates, for both policy and critic."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate shape after warmup, decaying to zero at the last update (`constant` = none)."""
    weight_decay: NonNeg = 0.0
    """AdamW weight decay."""
    adv_estimator: AdvEstimator = "gae"
    """Advantage estimator (`harness.algorithms.estimators`): `gae` uses the critic; the others are critic-free (no critic is built or trained): `grpo`, `dr_grpo`, `rloo` and `reinforce_pp_baseline` compare the G samples of a prompt (generation.samples_per_prompt >= 2), `reinforce_pp` whitens returns over the batch, `remax` subtracts the score of one greedy response per prompt. ppo.adv_normalize still whitens per minibatch on top (false = the estimator's own scale)."""
    loss_aggregation: LossAggregation = "token_mean"
    """How the policy loss's tokens combine: `token_mean` over all tokens of the minibatch (PPO's usual); `seq_mean_token_mean` = mean over responses of each one's token mean (GRPO's original); `seq_mean_token_sum` = mean over responses of token sums / generation.max_new_tokens (Dr. GRPO)."""
    gamma: Unit = 1.0
    """GAE discount; the reference code uses 1."""
    gae_lambda: Unit = 0.95
    """GAE lambda (trick 10): 0 = one-step TD, 1 = Monte-Carlo returns. Paper figures use 0.9 unless varied (Fig. 19). With critic_gae_lambda set, the policy's advantages only."""
    critic_gae_lambda: Unit | None = None
    """Decoupled GAE (VAPO, Yue et al. 2025, Sec. 4.1): the critic's targets use this lambda (VAPO: 1.0, unbiased returns for the value), the policy's advantages gae_lambda (VAPO: 0.95 or less, lower variance); null = gae_lambda for both. adv_estimator=gae only."""
    clip_eps: Annotated[Float, Field(gt=0, le=1)] | None = 0.2
    """Clipped surrogate epsilon (trick 11), the lower range 1 - clip_eps (verl's clip_ratio_low); null = unclipped ratio * advantage."""
    clip_eps_high: Annotated[Float, Field(gt=0, le=10)] | None = None
    """Clip-higher (DAPO, Yu et al. 2025, Sec. 3.1; verl's clip_ratio_high): the upper range, ratio clipped to [1 - clip_eps, 1 + clip_eps_high] (DAPO: 0.2 / 0.28); null = clip_eps (PPO's symmetric clip). At least clip_eps, except with cispo (whose weights usually have no lower bound: clip_eps 1). Also the upper range of gspo, cispo and clip_cov. Logs policy/clipfrac_high."""
    dual_clip_c: Annotated[Float, Field(gt=1, le=1000)] | None = None
    """Dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c, ROLL's dual_clip_loss): for negative advantages the loss is capped at -c*A (c > 1; verl's default 3), so a huge ratio cannot blow one token's loss up; null = off. policy_loss=ppo only. Logs policy/dual_clipfrac."""
    value_clip: Pos | None = 0.2
    """Value-loss clipping delta_vf (trick 7): 0.5*max((V-R)^2, (clip(V, V_old+-delta_vf)-R)^2); null = plain 0.5*(V-R)^2."""
    max_grad_norm: NonNeg = 1.0
    """Global gradient clipping (trick 12), per model; 0 = off. The norm before clipping is logged either way."""
    policy_loss: PolicyLoss = "ppo"
    """Policy objective (`harness.algorithms.losses`): `ppo` clipped surrogate; `apa` squared error to pi_init*exp(A/apa_lambda); `awr` advantage-weighted regression; `gspo` one length-normalised sequence ratio per response and its clip (GSPO, needs loss_aggregation=seq_mean_token_mean); `cispo` clipped, stop-gradient importance weights times log pi, every token's gradient kept (MiniMax-M1); `clip_cov` / `kl_cov` the surrogate with the gradient of a few high-covariance tokens cut, or KL-penalised (Cui et al. 2025). gspo, cispo, clip_cov and kl_cov use the rollout ratio (importance_sampling=rollout)."""
    importance_sampling: Literal["rollout", "reference", "off"] = "rollout"
    """For policy_loss=ppo (trick 2, Fig. 7). `rollout`: standard PPO, ratio = pi_theta/pi_rollout (clipped by clip_eps), every variant's baseline. `reference`: the paper's importance sampling (Sec. 5.3.2): the behaviour distribution is fixed to the reference (SFT) model, ratio = pi_theta/pi_ref with the clip around it ("an infinite experience buffer"). `off`: no ratio, the plain policy gradient -A*log pi_theta (every epoch's data treated as freshly sampled)."""
    apa_lambda: Pos = 0.1
    """APA lambda: loss = mean((log pi - A/lambda - log pi_init)^2); larger stays closer to pi_init (= the reference)."""
    awr_beta: Pos = 2.0
    """AWR temperature: loss = -mean(log pi * exp(A/beta))."""
    awr_max_weight: Pos | None = None
    """Clip AWR weights exp(A/beta) to at most this (null = unclipped, as the reference code)."""
    dynamic_sampling_tol: NonNeg | None = None
    """DAPO's dynamic sampling (Yu et al. 2025, Sec. 3.2) for the group estimators: a prompt group whose G raw reward-model scores span at most this (max - min) is dropped from the update (its tokens leave every loss); null = off. DAPO refills the batch by sampling more prompts; here the batch shrinks instead (a minibatch left empty is skipped; a batch with no informative group at all is kept whole, so that every step updates and logs). Logs response/informative_groups_frac."""
    clip_cov_ratio: Annotated[Float, Field(gt=0, le=1)] = 0.0002
    """Clip-Cov (policy_loss=clip_cov): the fraction of response tokens whose gradient is cut (at least one per micro-batch), drawn among those with covariance in (clip_cov_lb, clip_cov_ub) (Cui et al. 2025: 2e-4)."""
    clip_cov_lb: Float = 1.0
    """Clip-Cov: lower covariance bound of the tokens it may cut (Cui et al. / verl: 1)."""
    clip_cov_ub: Float = 5.0
    """Clip-Cov: upper covariance bound (Cui et al. / verl: 5); above clip_cov_lb."""
    kl_cov_ratio: Annotated[Float, Field(gt=0, le=1)] = 0.002
    """KL-Cov (policy_loss=kl_cov): the fraction of response tokens of largest covariance that get the KL penalty (at least one per micro-batch; Cui et al. 2025: 2e-3)."""
    kl_cov_coef: NonNeg = 1.0
    """KL-Cov: beta, the weight of |log pi_theta - log pi_rollout| on those tokens (Cui et al. / verl: 1)."""
    adv_normalize: Bool = True
    """Advantage normalization (trick 6), as adv_normalize_mode says; false = the estimator's own scale."""
    adv_normalize_mode: Literal["minibatch", "group_mean_batch_std"] = "minibatch"
    """How adv_normalize normalizes: `minibatch` = masked whitening per minibatch (the paper's trick 6); `group_mean_batch_std` = LitePPO's (Liu et al. 2025, "Tricks or Traps?", Sec. 4.1): once per rollout batch, each response's advantage minus its prompt group's mean, over the whole batch's standard deviation (needs generation.samples_per_prompt >= 2). LitePPO = this with loss_aggregation=token_mean."""
    adv_clip: Pos | None = None
    """Advantage clipping delta_a: clamp to +-delta_a after normalization (null = off)."""
    kl_coef: NonNeg = 0.05
    """KL coefficient eta (trick 1), placed by kl_placement; 0 = off."""
    kl_placement: Literal["reward", "loss"] = "reward"
    """`reward`: the token-level penalty r_t = -eta * KL_t at every response token; `loss` (GRPO): no KL in the reward, eta * aggregate(KL_t) (by loss_aggregation) added to the policy loss."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL estimator, in the reward or the loss alike: k1 = log(pi/ref); k2 = 0.5*log(pi/ref)^2; k3 = ref/pi - 1 - log(ref/pi)."""
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    """`fixed` eta, or the adaptive controller of Ziegler et al.: eta *= 1 + clip(kl/kl_target - 1, +-0.2) * batch/kl_horizon."""
    kl_target: Pos = 0.1
    """Adaptive controller target, in the units of objective/kl (mean per-token k1, nats)."""
    kl_horizon: PosCount = 10000
    """Adaptive controller horizon in samples."""
    entropy_coef: NonNeg = 0.0
    """Entropy bonus weight (trick 3); 0 = off. Without entropy_target the loss adds -coef * entropy."""
    entropy_target: NonNeg | None = None
    """The paper's entropy clip: loss adds coef * |entropy - target| instead (mean per-token entropy, nats; the paper's 30 was in its own units)."""
    ptx_coef: NonNeg = 0.0
    """PPO-ptx: weight of the LM loss on SFT data added to the policy loss; 0 = off."""
    ptx_batch_size: Batch = 16
    """SFT sequences per PPO-ptx minibatch."""
    critic_pretrain_steps: Count = 0
    """Critic pretraining (trick 8): this many rollout steps updating only the critic, policy frozen, before PPO starts. It is also VAPO's value pretraining / critic warm-up (Yue et al. 2025, Sec. 4.1: 50 steps, with critic_gae_lambda=1)."""
    reuse_rollout_logprobs: Bool = False
    """Take old log-probs from the sampling pass instead of a separate forward (faster; ratios then differ from 1 by the KV-cache round-off)."""


@section
class RewardConfig:
    scale: Bool = False
    """Reward scaling (trick 4): divide the RM score by its running std. Ignored when normalize is on."""
    normalize: Bool = True
    """Reward normalization (trick 5): (r - running mean) / running std. Independent of `scale` (the reference code's quirk that normalization needs scaling is not copied)."""
    clip: Pos | None = 0.8
    """Reward clipping delta_r: clamp the processed score to +-delta (null = off; 0 is refused, since it would zero every reward)."""
    overlong_buffer: Count = 0
    """DAPO's soft overlong punishment (Yu et al. 2025, Sec. 3.4): in the last overlong_buffer tokens before generation.max_new_tokens, a penalty growing linearly from 0 to -overlong_penalty is added to the processed score (after normalization and clipping); 0 = off. Logs reward/overlong_penalty."""
    overlong_penalty: Pos = 1.0
    """The overlong punishment at the cap (DAPO: 1; verl's overlong_buffer.penalty_factor)."""
    running_stats_init: Count = 0
    """Rollout batches scored before PPO starts only to seed the running statistics (0 = stats start empty)."""


@section
class LoggingConfig:
    tracking_uri: TrackingURI | None = None
    """MLflow tracking URI (sqlite file, directory or server URL), without spaces; null = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db. A runner's --tracking-uri and $MLFLOW_TRACKING_URI beat it (harness.tracking.resolve_uri)."""
    experiment: Name = "harness"
    """MLflow experiment name."""
    run_name: FolderName | None = None
    """MLflow run name and checkpoint folder name, so one path component (null = generated from experiment, policy loss and seed)."""
    parent_run_id: Str | None = None
    """Log as a child of this MLflow run (set by the ablation runner and sweeps)."""
    tags: dict[Str, Str] = field(default_factory=dict)
    """Extra MLflow tags for the run."""
    output_dir: PathStr = "runs"
    """Checkpoints and run files go under output_dir/run_name (refused at load time when a file is in the way)."""
    sample_every: Count = 50
    """Log a table of sample prompts/responses/rewards every N steps (0 = only at the end)."""
    num_samples: Annotated[Int, Field(ge=0, le=10000)] = 8
    """Rows in each sample table."""
    eval_every: Count = 50
    """Score held-out prompts every N steps: gold reward, win rate vs SFT, RM score histogram (0 = off)."""
    checkpoint_every: Count = 50
    """Save policy, critic, optimizers and running stats every N steps (0 = only at the end)."""
    keep_best: Bool = True
    """Keep the policy weights of the best held-out eval before the collapse rule fires (paper App. A: the best model comes before collapse) in the run folder's best_policy.pt, its step in tag harness.best_step; false saves the disk and time a large model's copies cost."""
    progress: Bool = True
    """Show a progress bar."""


@section
class CollapseConfig:
    enabled: Bool = True
    """Track collapse: the gold truth where a gold reward exists, and the warning detector on every run (harness.metrics). On the embedded world the run's collapse flag (tag harness.collapsed, collapse/step) is the gold truth; without gold (HH-RLHF, any Hugging Face model) it is the detector's warning."""
    baseline_steps: PosCount = 5
    """Gold truth: the first steps whose mean per-step gold is the run's start level (the policy is still the SFT model)."""
    window: PosCount = 10
    """Gold truth: steps in the trailing mean of the per-step gold score (one noisy batch neither makes nor hides a fall)."""
    margin: Float = 0.3
    """Gold truth: how far (gold units) the trailing mean must fall below the start level (a negative margin also flags a run whose gold did not rise by more than -margin)."""
    confirm: PosCount = 20
    """Gold truth: steps in a row the trailing mean must stay below start - margin; the onset is the first of them, known `confirm - 1` steps later."""
    detector: PathStr = "default"
    """The warning detector (harness.detector): `default` = the committed harness/detector_params_no_audit.json, or harness/detector_params.json for a run with audit reward models (fit on the embedded world's runs on ten worlds, scored on a world it was not fit on: reports/detector/, `python -m analysis.detector evaluate`), `off`, or a file written by `python -m analysis.detector fit`. Logs collapse/warning every step and collapse/warning_step once."""
    warn_threshold: Unit | None = None
    """The detector's threshold instead of the file's (another point of its operating curve: lower warns earlier and more often)."""
    stop_on_collapse: Bool = False
    """End training once the run is marked collapsed (status FINISHED, tag harness.collapsed=true): on the world `confirm - 1` steps after the gold onset, without gold at the warning."""
    on_warning: Literal["none", "stop", "raise_kl", "rollback"] = "none"
    """What the trainer does once, on the step the detector warns (never on the gold truth, which a real run does not have): `none`; `stop` = end the run there (its last policy is the one before the fall); `raise_kl` = eta becomes max(eta * warning_kl_factor, warning_kl_min) in place; `rollback` = policy, critic, optimizers and reward statistics back to the snapshot taken at least rollback_steps steps before, then raise_kl. Tag harness.warning_action, metric collapse/action_step (measured on held-out runs: bench/RESULTS.md)."""
    warning_kl_factor: Annotated[Float, Field(ge=1, le=1000)] = 2.0
    """raise_kl / rollback: the KL coefficient is multiplied by this..."""
    warning_kl_min: Annotated[Float, Field(ge=0, le=100)] = 0.05
    """...and is at least this (a run without a KL penalty gets one)."""
    rollback_steps: Annotated[Int, Field(ge=1, le=100_000)] = 10
    """rollback: snapshots of the trainer every this many steps; the warning restores the one at least this far back (two kept in memory)."""


@section
class DistributedConfig:
    deepspeed: Bool = False
    """Wrap policy and critic with deepspeed.initialize (launch with `deepspeed` or `torchrun`)."""
    zero_stage: Annotated[Int, Field(ge=0, le=3)] = 0
    """ZeRO stage; 3 also shards the frozen reference and reward models."""
    offload_optimizer: Bool = False
    """ZeRO CPU offload of optimizer state."""
    offload_params: Bool = False
    """ZeRO-3 CPU offload of parameters."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """DeepSpeed training precision."""
    gradient_checkpointing: Bool = False
    """Recompute activations in the backward pass to save memory."""
    gradient_accumulation: Batch = 1
    """Micro-batches accumulated per optimizer step."""


@section
class TrainConfig:
    seed: Seed = 0
    """Seed for torch, sampling and data order; two runs with one seed and config are identical."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` = CUDA when available, else CPU."""
    threads: Annotated[Int, Field(ge=0, le=4096)] = 0
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


# ------------------------------------------------------------------ loading, hashing, docs
def _file_in_the_way(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` (or itself) when it is not a directory: mkdir would fail."""
    for d in (path, *path.parents):
        try:
            if d.exists():
                return None if d.is_dir() else d
        except OSError:  # unreadable: creating the folder will say why
            return None
    return None


def cross_checks(cfg: TrainConfig) -> list[str]:
    """Every rule that spans fields, in one place (and the rules about files: output_dir is creatable, a
    detector file reads). What depends on the machine or the launch (CUDA, bf16, DeepSpeed installed,
    ranks) is harness.parallel.validate's; what depends on the models (paths, vocabularies, context)
    harness.models.preflight's."""
    p: list[str] = []
    d, ppo = cfg.distributed, cfg.ppo
    if not d.deepspeed:
        for name, value, default in (("zero_stage", d.zero_stage, 0), ("offload_optimizer", d.offload_optimizer, False),
                                     ("offload_params", d.offload_params, False), ("precision", d.precision, "fp32")):
            if value != default:
                p.append(f"distributed.{name}: got {value!r} with distributed.deepspeed=false; allowed: {default!r} "
                         f"(a DeepSpeed setting; set distributed.deepspeed=true, or use model.autocast=bf16 for mixed precision without it)")
    else:
        if d.precision != "fp32" and d.zero_stage == 0:
            p.append(f"distributed.zero_stage: got 0 with distributed.precision={d.precision!r}; allowed: 1, 2 or 3 "
                     "(DeepSpeed's stage-0 mixed-precision wrapper takes an extra AdamW step at start-up; stage 1 costs nothing extra)")
        if d.offload_optimizer and d.zero_stage == 0:
            p.append("distributed.offload_optimizer: got true with zero_stage=0; allowed: only with zero_stage 1, 2 or 3")
    if cfg.model.audit_reward_paths == "world" and cfg.data.source != "world":
        p.append(f"model.audit_reward_paths: got 'world' with data.source={cfg.data.source!r}; allowed: auto, none or "
                 "a list of reward-model paths (the world's audit RMs exist only on the embedded world)")
    c = cfg.collapse
    if c.on_warning != "none" and (not c.enabled or c.detector == "off"):
        p.append(f"collapse.on_warning: got {c.on_warning!r} with collapse.enabled={c.enabled} and collapse.detector="
                 f"{c.detector!r}; allowed: none (an action needs the warning detector on)")
    for name in ("baseline_steps", "confirm"):  # one the user set (the defaults stay for runs shorter than them)
        value = getattr(c, name)
        if c.enabled and value > ppo.steps and value != getattr(CollapseConfig(), name):
            p.append(f"collapse.{name}: got {value} with ppo.steps={ppo.steps}; allowed: at most ppo.steps (a "
                     "run this short never reaches it, so no collapse could be judged)")
    G, est = cfg.generation.samples_per_prompt, ppo.adv_estimator
    if est in NEEDS_GROUPS and G < 2:
        p.append(f"generation.samples_per_prompt: got {G} with ppo.adv_estimator={est}; allowed: 2 or more "
                 "(the estimator compares the samples of one prompt)")
    if est not in NEEDS_CRITIC and ppo.critic_pretrain_steps:
        p.append(f"ppo.critic_pretrain_steps: got {ppo.critic_pretrain_steps} with ppo.adv_estimator={est}; "
                 "allowed: 0 (a critic-free estimator builds no critic)")
    p += _trick_checks(cfg)
    if cfg.ppo.rollout_batch_size % cfg.ppo.num_minibatches:
        p.append(f"ppo.num_minibatches: got {cfg.ppo.num_minibatches}; allowed: a divisor of "
                 f"ppo.rollout_batch_size={cfg.ppo.rollout_batch_size}")
    G = cfg.generation.samples_per_prompt
    if cfg.ppo.rollout_batch_size % G:
        p.append(f"ppo.rollout_batch_size: got {cfg.ppo.rollout_batch_size}; allowed: a multiple of "
                 f"generation.samples_per_prompt={G} (it counts responses, G per prompt)")
    if cfg.data.source == "hh_rlhf" and not cfg.data.hh_path:
        p.append("data.hh_path: got ''; allowed: a path to an HH-RLHF .jsonl or .jsonl.gz file when data.source=hh_rlhf")
    if cfg.distributed.offload_params and cfg.distributed.zero_stage != 3:
        p.append(f"distributed.offload_params: got true with zero_stage={cfg.distributed.zero_stage}; allowed: only with zero_stage 3")
    if cfg.collapse.detector not in ("default", "off"):  # a detector file: readable and well-formed
        from .detector import load_params

        try:
            load_params(cfg.collapse.detector)
        except ConfigError as e:
            p += e.problems
    blocker = _file_in_the_way(Path(cfg.logging.output_dir))
    if blocker is not None:
        p.append(f"logging.output_dir: got {cfg.logging.output_dir!r}; allowed: a directory, but {str(blocker)!r} is a file")
    return p


def _takes(param: str) -> list[str]:
    """The policy losses that take keyword `param` (read from their registration, `names.POLICY_LOSS_INPUTS`)."""
    return [n for n, args in names.POLICY_LOSS_INPUTS.items() if param in args]


def _trick_checks(cfg: TrainConfig) -> list[str]:
    """The rules of the tricks after the paper (docs/PAPER.md): a setting that the chosen loss,
    estimator or grouping would silently ignore, or that makes no sense with another, is refused."""
    p: list[str] = []
    ppo, G = cfg.ppo, cfg.generation.samples_per_prompt
    loss, clip_losses = ppo.policy_loss, _takes("clip_eps_high")
    if ppo.clip_eps_high is not None:
        if loss not in clip_losses:
            p.append(f"ppo.clip_eps_high: got {ppo.clip_eps_high} with ppo.policy_loss={loss}; allowed: null "
                     f"(only {', '.join(clip_losses)} clip a ratio)")
        elif ppo.clip_eps is None:
            p.append(f"ppo.clip_eps_high: got {ppo.clip_eps_high} with ppo.clip_eps=null; allowed: null "
                     "(clip-higher widens the upper side of a clip: set ppo.clip_eps, the lower range)")
        elif ppo.clip_eps_high < ppo.clip_eps and loss != "cispo":  # CISPO bounds a weight: no lower bound (clip_eps 1) is its usual setting
            p.append(f"ppo.clip_eps_high: got {ppo.clip_eps_high} with ppo.clip_eps={ppo.clip_eps}; allowed: null or a number "
                     f">= ppo.clip_eps={ppo.clip_eps} (a lower clip range above the upper one is not clip-higher)")
    if ppo.dual_clip_c is not None and (loss not in _takes("dual_clip_c") or ppo.importance_sampling == "off"):
        p.append(f"ppo.dual_clip_c: got {ppo.dual_clip_c} with ppo.policy_loss={loss}, ppo.importance_sampling="
                 f"{ppo.importance_sampling}; allowed: null (dual-clip bounds a ratio's surrogate: policy_loss "
                 f"{', '.join(_takes('dual_clip_c'))} with importance_sampling rollout or reference)")
    if loss in clip_losses and loss not in _takes("importance_sampling") and ppo.importance_sampling != "rollout":
        p.append(f"ppo.importance_sampling: got {ppo.importance_sampling!r} with ppo.policy_loss={loss}; allowed: 'rollout' "
                 "(its ratio is pi_theta / pi_rollout)")
    if loss in clip_losses and loss not in _takes("importance_sampling") and ppo.clip_eps is None:
        p.append(f"ppo.clip_eps: got null with ppo.policy_loss={loss}; allowed: a number > 0 and <= 1 (its ratio is clipped)")
    if loss == "gspo" and ppo.loss_aggregation != "seq_mean_token_mean":
        p.append(f"ppo.loss_aggregation: got {ppo.loss_aggregation!r} with ppo.policy_loss=gspo; allowed: 'seq_mean_token_mean' "
                 "(GSPO's ratio is one per response: a token-level aggregation weighs each response by its length)")
    if ppo.adv_normalize_mode == "group_mean_batch_std":
        if not ppo.adv_normalize:
            p.append("ppo.adv_normalize_mode: got 'group_mean_batch_std' with ppo.adv_normalize=false; allowed: 'minibatch' "
                     "(the mode of a normalization that is off), or set ppo.adv_normalize=true")
        elif G < 2:
            p.append(f"ppo.adv_normalize_mode: got 'group_mean_batch_std' with generation.samples_per_prompt={G}; allowed: "
                     "'minibatch' (a group mean needs groups: set generation.samples_per_prompt >= 2)")
    if ppo.dynamic_sampling_tol is not None and ppo.adv_estimator not in NEEDS_GROUPS:
        p.append(f"ppo.dynamic_sampling_tol: got {ppo.dynamic_sampling_tol} with ppo.adv_estimator={ppo.adv_estimator}; "
                 f"allowed: null (it drops prompt groups: one of {', '.join(sorted(NEEDS_GROUPS))})")
    if ppo.critic_gae_lambda is not None and ppo.adv_estimator not in NEEDS_CRITIC:
        p.append(f"ppo.critic_gae_lambda: got {ppo.critic_gae_lambda} with ppo.adv_estimator={ppo.adv_estimator}; "
                 f"allowed: null (only {', '.join(sorted(NEEDS_CRITIC))} trains a critic)")
    cap, buf = cfg.generation.max_new_tokens, cfg.reward.overlong_buffer
    if buf > cap:
        p.append(f"reward.overlong_buffer: got {buf} with generation.max_new_tokens={cap}; allowed: 0 to {cap} "
                 "(the buffer lies before the length cap)")
    if ppo.clip_cov_lb >= ppo.clip_cov_ub:
        p.append(f"ppo.clip_cov_lb: got {ppo.clip_cov_lb} with ppo.clip_cov_ub={ppo.clip_cov_ub}; allowed: a number "
                 f"below ppo.clip_cov_ub (the covariance band Clip-Cov draws from)")
    return p


def from_dict(data: dict[str, Any] | None, cls: type = TrainConfig, source: str | None = None) -> Any:
    """Build and validate a config from a nested dict; raises ConfigError listing every problem."""
    cfg = schema.validate(cls, data, source)
    problems = cross_checks(cfg) if cls is TrainConfig else []
    if problems:
        raise ConfigError([f"{source}: {p}" if source else p for p in problems])
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> TrainConfig:
    """YAML file (optional) + overrides -> validated TrainConfig."""
    return schema.load(TrainConfig, path, overrides, cross_checks)


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


def computed_fields(cfg: TrainConfig) -> dict[str, Any]:
    """The flattened fields that change what a run computes (not where it logs)."""
    return {k: v for k, v in flatten(to_dict(cfg)).items() if not k.startswith(BOOKKEEPING)}


HASH_NEUTRAL_AT_DEFAULT = (
    "ppo.clip_eps_high", "ppo.dual_clip_c", "ppo.adv_normalize_mode", "ppo.critic_gae_lambda", "ppo.dynamic_sampling_tol",
    "ppo.clip_cov_ratio", "ppo.clip_cov_lb", "ppo.clip_cov_ub", "ppo.kl_cov_ratio", "ppo.kl_cov_coef",
    "reward.overlong_buffer", "reward.overlong_penalty",
    "model.audit_reward_paths", "collapse.on_warning", "collapse.warning_kl_factor", "collapse.warning_kl_min",
    "collapse.rollback_steps", "data.add_special_tokens", "data.chat_template",
)
"""Fields added after runs were stored by their config hash (the tricks after the paper, the audit reward models,
the actions on a warning and how prompts are encoded), each with a default
that computes what runs did before it existed: at that default they are left out of `config_hash`, so a stored
run (a grid's, the design study's) keeps its hash and is found, not trained again. Set, they count."""


def config_hash(cfg: TrainConfig) -> str:
    """Hash of `computed_fields`, less the HASH_NEUTRAL_AT_DEFAULT fields at their defaults."""
    flat, default = computed_fields(cfg), flatten(to_dict(TrainConfig()))
    kept = {k: v for k, v in flat.items() if not (k in HASH_NEUTRAL_AT_DEFAULT and v == default[k])}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def help_text() -> str:
    """Every TrainConfig key with its default, what is allowed and its doc string (for --help)."""
    return schema.help_text(TrainConfig)
