"""Names shared by the trainer, the ablation runner, sweeps and analysis: MLflow metric keys, tags
and artifact paths. Everything downstream of training meets at the MLflow store, so these names are
the contract; change them here or nowhere. Metric keys are grouped by prefix as TRL and verl name
them; all are logged every PPO step except eval/ (every logging.eval_every steps), collapse/step
(once) and the world's rm/ keys (reward-model training)."""

# -- objective: what the run optimizes and how far it moved (paper section 4) -----------------
RM_SCORE = "objective/rm_score"  # raw reward-model score, before any scaling (mean over batch)
RM_SCORE_STD = "objective/rm_score_std"
GOLD_SCORE = "objective/gold_score"  # hidden gold reward (embedded world only)
GOLD_SCORE_STD = "objective/gold_score_std"
KL = "objective/kl"  # per sample mean over response tokens of log pi - log pi_ref (k1), batch mean
KL_K3 = "objective/kl_k3"  # same with the k3 estimator (non-negative)
KL_COEF = "objective/kl_coef"  # eta in force this step (moves with the adaptive controller)
ENTROPY = "objective/entropy"  # mean per-token entropy of the policy on its samples (nats)
PPL = "objective/ppl"  # exp(mean token NLL) of the samples under the policy, batch mean
PPL_TOKENS = "objective/ppl_tokens"  # exp(NLL pooled over all response tokens): no outlier spikes
PPL_REF = "objective/ppl_ref"  # same under the reference (SFT) model
NON_SCORE_REWARD = "objective/non_score_reward"  # summed KL-penalty reward per sample, batch mean
SCORE_PROCESSED = "objective/score_processed"  # score after scaling/normalization/clipping

LENGTH = "response/length_mean"
SAMPLED_TOKENS = "response/sampled_tokens"  # response tokens sampled so far (all rollouts but eval; cumulative)
LENGTH_MAX = "response/length_max"
LENGTH_STD = "response/length_std"  # spread of response lengths in the batch (tokens)
FRAC_AT_CAP = "response/frac_at_cap"
GROUPS_KEPT_FRAC = "response/informative_groups_frac"  # DAPO's dynamic sampling (ppo.dynamic_sampling_tol): share of prompt groups whose scores differ (kept); only while on

PG_LOSS = "policy/pg_loss"
ENTROPY_LOSS = "policy/entropy_loss"
PTX_LOSS = "policy/ptx_loss"
APPROX_KL = "policy/approx_kl"  # 0.5*mean((log pi - log pi_rollout)^2)
POLICY_CLIPFRAC = "policy/clipfrac"
RATIO_MEAN = "policy/ratio_mean"
RATIO_STD = "policy/ratio_std"
RATIO_MAX = "policy/ratio_max"
# Logged only while the trick that has the quantity is on (docs/PAPER.md, "tricks after the paper"):
POLICY_CLIPFRAC_HIGH = "policy/clipfrac_high"  # clip-higher (ppo.clip_eps_high): fraction of tokens clipped at 1 + clip_eps_high
POLICY_DUAL_CLIPFRAC = "policy/dual_clipfrac"  # dual-clip (ppo.dual_clip_c): fraction of tokens capped at -c*A
POLICY_LOGP_ADV_COV = "policy/logp_adv_cov"  # clip_cov / kl_cov: token mean of (log pi - mean)(A - mean), Cui et al. 2025

VF_LOSS = "val/vf_loss"
VF_CLIPFRAC = "val/clipfrac"
VALUES = "val/values_mean"
RETURNS = "val/returns_mean"
RETURNS_STD = "val/returns_std"
EXPLAINED_VAR = "val/explained_var"  # 1 - Var(returns - values) / Var(returns) over response tokens (1: a perfect critic)

# -- advantages (after normalization/clipping, as used by the loss) -----------------------------
ADV_MEAN = "adv/mean"
ADV_STD = "adv/std"
ADV_RAW_MEAN = "adv/raw_mean"
ADV_RAW_STD = "adv/raw_std"

REWARD_RUNNING_MEAN = "reward/running_mean"
REWARD_RUNNING_STD = "reward/running_std"
OVERLONG_PENALTY = "reward/overlong_penalty"  # DAPO's soft overlong punishment (reward.overlong_buffer), batch mean; only while on

GRAD_NORM_POLICY = "optim/grad_norm_policy"  # before clipping, mean over updates this step
GRAD_NORM_CRITIC = "optim/grad_norm_critic"
LR_POLICY = "optim/lr_policy"
LR_CRITIC = "optim/lr_critic"

TOKENS_PER_S = "perf/tokens_per_s"  # generated response tokens per second of step time
STEP_S = "perf/step_s"
TIME_ROLLOUT = "perf/time_rollout_s"
TIME_SCORE = "perf/time_score_s"
TIME_ADVANTAGE = "perf/time_advantage_s"
TIME_UPDATE = "perf/time_update_s"
TIME_LOGGING = "perf/time_logging_s"  # logging time of the previous step (this step's is not known yet)

# -- signals that need no gold and may move before it falls (harness.signals) ------------------
DISTINCT_1 = "signal/distinct_1"  # unique tokens / tokens over the batch's responses
DISTINCT_2 = "signal/distinct_2"  # unique 2-grams / 2-grams over the batch's responses
REPEATED_2GRAM = "signal/repeated_2gram"  # share of a response's 2-grams seen earlier in it, batch mean
GROUP_SIMILARITY = "signal/group_similarity"  # mean pairwise Jaccard of one prompt's samples' 2-grams (samples_per_prompt > 1)
AUDIT_MEAN = "audit/score_mean"  # audit reward models' mean score (model.audit_reward_paths; only where there are some)
AUDIT_STD = "audit/score_std"  # spread over the batch of the members' mean score
AUDIT_GAP = "audit/gap"  # proxy RM score minus audit score, batch means
AUDIT_DISAGREEMENT = "audit/disagreement"  # std over the audit members of a sample's score, batch mean
AUDIT_MEMBER = "audit/score_{k}"  # each member's batch mean (.format(k=0))

EVAL_GOLD = "eval/gold_score"
EVAL_RM = "eval/rm_score"
EVAL_WIN_RATE = "eval/win_rate_vs_sft"  # gold(policy) > gold(SFT) on the same prompt; ties count half
EVAL_LENGTH = "eval/length_mean"

COLLAPSE_STEP = "collapse/step"  # logged once, when the run's collapse flag is raised; its value is the step it marks (the gold onset on the world)
WARNING = "collapse/warning"  # the detector's warning score this step (harness.detector; from the first full window)
WARNING_STEP = "collapse/warning_step"  # logged once, on the step the detector warns; its value is that step
ACTION_STEP = "collapse/action_step"  # logged once, on the step collapse.on_warning acted; its value is that step
GOLD_ONSET = "collapse/gold_onset"  # logged once, on the step the gold onset is confirmed; its value is the onset step (harness.metrics.GoldTruth)

# -- reward-model training (world build; experiment `world`) ------------------------------------
RM_TRAIN_ACC = "rm/train_acc"
RM_EVAL_ACC = "rm/eval_acc"
RM_TRAIN_LOSS = "rm/train_loss"
RM_EVAL_ACC_GOLD = "rm/eval_acc_gold"  # held-out accuracy against the gold order (gold ties skipped)
RM_LABEL_CEILING = "rm/label_ceiling"  # accuracy of the gold order against the noisy held-out labels
RM_LABEL_CEILING_EXPECTED = "rm/label_ceiling_expected"  # same, in expectation over the label draws
SFT_GOLD_MEAN = "world/sft_gold_mean"  # mean gold of SFT samples on eval prompts
SFT_ENDED_FRAC = "world/sft_ended_frac"  # fraction of those samples that ended before the cap
PRETRAIN_LOSS = "world/pretrain_loss"
SFT_LOSS = "world/sft_loss"
SFT_EVAL_NLL = "world/sft_eval_nll"  # SFT model's response NLL on fresh reviews of eval prompts
WORLD_BUILD_S = "world/build_s"

STEP_METRICS = [
    RM_SCORE, RM_SCORE_STD, KL, KL_K3, KL_COEF, ENTROPY, PPL, PPL_REF, NON_SCORE_REWARD,
    SCORE_PROCESSED, LENGTH, SAMPLED_TOKENS, LENGTH_MAX, LENGTH_STD, FRAC_AT_CAP, PG_LOSS, ENTROPY_LOSS, PTX_LOSS, APPROX_KL,
    POLICY_CLIPFRAC, RATIO_MEAN, RATIO_STD, RATIO_MAX, VF_LOSS, VF_CLIPFRAC, VALUES, RETURNS,
    RETURNS_STD, EXPLAINED_VAR, ADV_MEAN, ADV_STD, ADV_RAW_MEAN, ADV_RAW_STD, REWARD_RUNNING_MEAN,
    REWARD_RUNNING_STD, GRAD_NORM_POLICY, GRAD_NORM_CRITIC, LR_POLICY, LR_CRITIC, TOKENS_PER_S,
    STEP_S, TIME_ROLLOUT, TIME_SCORE, TIME_ADVANTAGE, TIME_UPDATE, TIME_LOGGING, DISTINCT_1, DISTINCT_2, REPEATED_2GRAM,
]
"""Logged at every step (gold keys too when the source has a gold reward)."""
GOLD_METRICS = [GOLD_SCORE, GOLD_SCORE_STD]
AUDIT_METRICS = [AUDIT_MEAN, AUDIT_STD, AUDIT_GAP, AUDIT_DISAGREEMENT]
"""Logged at every step by a run with audit reward models (and AUDIT_MEMBER per member)."""
EVAL_METRICS = [EVAL_GOLD, EVAL_RM, EVAL_WIN_RATE, EVAL_LENGTH]
TRICK_METRICS = [POLICY_CLIPFRAC_HIGH, POLICY_DUAL_CLIPFRAC, POLICY_LOGP_ADV_COV, OVERLONG_PENALTY, GROUPS_KEPT_FRAC]
"""Logged at every step while their trick is on."""
KNOWN_METRICS = list(dict.fromkeys(
    STEP_METRICS + GOLD_METRICS + EVAL_METRICS + AUDIT_METRICS + TRICK_METRICS
    + [PPL_TOKENS, GROUP_SIMILARITY, COLLAPSE_STEP, WARNING, WARNING_STEP, ACTION_STEP, GOLD_ONSET, RM_TRAIN_ACC, RM_EVAL_ACC,
       RM_TRAIN_LOSS]))
"""Every metric a figure panel, a claim or a sweep objective may name: the one list."""

TAG_SEED = "harness.seed"
TAG_COMMIT = "harness.git_commit"
TAG_CONFIG_HASH = "harness.config_hash"
TAG_POLICY_LOSS = "harness.policy_loss"
TAG_COLLAPSED = "harness.collapsed"  # "true" / "false", set at the end of a run
TAG_COLLAPSE_REASON = "harness.collapse_reason"
TAG_FAILURE = "harness.failure_reason"  # set when a run ends FAILED (NaN loss, exception)
TAG_BEST_STEP = "harness.best_step"  # step of the best held-out eval before the collapse rule fired (best_policy.pt)
TAG_STOPPED = "harness.stopped_by"  # "collapse", "warning" or "callback" when a run ended before ppo.steps
TAG_WARNING_ACTION = "harness.warning_action"  # collapse.on_warning, set on the step it acted
TAG_ROLE = "harness.role"  # "train" | "parent" | "world"
TAG_PID = "harness.pid"  # the process that trains the run (rank 0), set whenever it (re)opens the run
TAG_ADV_ESTIMATOR = "harness.adv_estimator"  # ppo.adv_estimator of a train run
TAG_CRITIC_FREE = "harness.critic_free"  # "true" when that estimator trains no critic
TAG_DETECTOR = "provenance.detector"  # the warning detector a run ran with (harness.detector.fingerprint)
# Set by the ablation runner / sweeps on child runs:
TAG_ABLATION = "harness.ablation"
TAG_FIGURE = "harness.figure"
TAG_VARIANT = "harness.variant"
TAG_WORLD_SEED = "harness.world_seed"  # the world seed of a run in a grid over worlds (`worlds:`)
TAG_WORLD_SHIPPED = "harness.world_shipped"  # a world run that unpacked the shipped world: its content hash
TAG_TRIAL = "harness.trial"
TAG_SWEEP = "harness.sweep"
TAG_TRIAL_STATE = "harness.trial_state"
TAG_TRIAL_OUTCOME = "harness.trial_outcome"
SWEEP_OBJECTIVE = "sweep/objective"  # a trial run's objective value (logged once per seed run)
STUDY_PREFIX = "study/"  # study/<name>: a sweep run's value of each of the sweep file's `objectives` (logged once)

STOP_FILE = "STOP"  # a file of this name in a run folder stops the run at its next step (harness.parallel.agree_stop)
ARTIFACT_CONFIG = "config.yaml"  # the resolved config
SAMPLES_DIR = "samples"  # samples/step_000050.json: {"step", "rows": [{prompt, response, rm_score, gold_score, length}]}
EVAL_SCORES_DIR = "eval"  # eval/rm_scores_step_000050.json: {"step", "rm": [...], "gold": [...]} (Fig. 13)
RM_SCORE_DIFF = "rm_score_diff.json"  # world run: {"diff": [...]} chosen - rejected on held-out pairs (Fig. 2)
