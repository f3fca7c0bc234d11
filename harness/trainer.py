"""The PPO step, top to bottom: rollout -> scores -> per-token rewards -> advantages -> PPO epochs.

Formulas live in `harness.algorithms`; this module only orchestrates. On W ranks it computes what one
rank does with the same global batch, up to float rounding: each rank samples its slice (keyed
sampling), the scored shards are all-gathered once (rewards and advantages computed redundantly),
and each rank back-propagates its share of a global minibatch's loss numerator over the global denominator.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from . import keys, signals
from .algorithms import (
    POLICY_LOSSES,
    KLController,
    RunningMeanStd,
    entropy_term,
    kl_per_token,
    masked_mean,
    masked_var,
    masked_whiten,
    perplexity,
    process_scores,
    token_rewards,
    value_loss,
)
from .algorithms.estimators import (
    NEEDS_GREEDY,
    aggregate,
    compute_gae,
    estimate,
    group_mean_batch_std,
    informative_groups,
)
from .algorithms.rewards import overlong_penalty
from .algorithms.schedule import lr_lambda
from .config import TrainConfig
from .data import PromptSource
from .models import Models, encode_prompt
from .parallel import DistEnv, Engine, NonFiniteLoss, frozen
from .rollout import (
    STREAM_EVAL,
    STREAM_ROLLOUT,
    Rollout,
    counter_hash,
    critic_values,
    fuse_activations,
    last_scores,
    left_pad,
    lm_loss,
    logprobs_and_entropy,
    sample,
)


@dataclass
class Batch:
    """A scored rollout (the global batch) with everything the update needs, all [B, R] unless noted."""

    rollout: Rollout
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    old_values: torch.Tensor  # zeros without a critic
    entropy: torch.Tensor
    scores: torch.Tensor  # [B] raw RM score
    processed_scores: torch.Tensor  # [B]
    gold: torch.Tensor | None  # [B]
    non_score_rewards: torch.Tensor
    kl: torch.Tensor  # k1 per token
    advantages: torch.Tensor
    returns: torch.Tensor
    prompts: list[str]
    responses: list[str]
    overlong: torch.Tensor | None  # [B] DAPO's overlong penalty in processed_scores (reward.overlong_buffer), else None
    keep: torch.Tensor | None  # [B] bool: rows of the prompt groups DAPO's dynamic sampling keeps (ppo.dynamic_sampling_tol), else None
    first_perm: torch.Tensor | None = None
    """The update's first epoch's row order, drawn before scoring (the same draw, in the same order)."""
    first_pass: Forwards | None = None
    """Where the update's first minibatch gets its forwards: the scoring pass's, graphs kept, where it
    could keep them (None: fresh forwards)."""
    audit: torch.Tensor | None = None
    """[k, B] the audit reward models' raw scores (None: the run has none)."""


@dataclass
class Minibatch:
    """One global minibatch trimmed to its longest response (R tokens), and this rank's share."""

    seq: torch.Tensor  # [mb, P + R]
    attn: torch.Tensor
    response: torch.Tensor  # [mb, R], and the rest likewise
    mask: torch.Tensor
    adv: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    P: int
    n_tokens: torch.Tensor
    """Response tokens in the whole minibatch (all ranks): the critic, entropy and ptx losses are token
    sums divided by it."""
    parts: list[slice]
    """This rank's micro-batches: rows of the minibatch."""


class Forwards:
    """Where `policy_step` and `critic_step` get the policy's log-probs and entropy, and the critic's
    values, of this rank's rows of a minibatch: the scoring pass's own forward, or a fresh one.

    The update's first minibatch runs the policy and critic on rows that the scoring pass (`make_batch`)
    ran with the same parameters. Where a graph made outside `Engine.training` may be back-propagated
    (`Engine.keeps_graphs`: plain torch, one micro-batch per step, so one ask per minibatch) and one
    rank holds those rows (one minibatch: a rank's share is its own rollout shard; several: one rank),
    `scoring_policy` / `scoring_critic` forward them apart with their autograd graphs kept, and the
    first ask for each gets the kept graph (then drops it: used once) instead of a second forward of
    the same rows: the same numbers, one forward fewer. Every other ask runs a fresh forward.
    """

    def __init__(self, trainer: PPOTrainer, first_perm: torch.Tensor | None = None):
        """first_perm: the update's first epoch's row order, whose first minibatch's scoring forwards
        to keep where allowed; None: keep nothing."""
        self.trainer = trainer
        p, W = trainer.cfg.ppo, trainer.env.world_size
        self.keep = first_perm is not None and trainer.policy.keeps_graphs and (p.num_minibatches == 1 or W == 1)
        self.rows = None  # the kept rows of this rank's shard: None = all of them (one minibatch)
        if self.keep and p.num_minibatches > 1:  # one rank: its shard is the global batch
            self.rows = first_perm[: len(first_perm) // p.num_minibatches].sort().values.to(trainer.device)
        self.kept: dict[str, torch.Tensor] = {}

    # ---------------------------------------------------------------- make_batch: the scoring pass
    def scoring_policy(self, seq, attn, response, P: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's log-probs and entropy [n, R] of all of this rank's rows (no grad), under the
        caller's autocast; the entropy's graph is kept only for an entropy bonus."""
        t = self.trainer
        names = ("logprobs", "entropy") if t.cfg.ppo.entropy_coef > 0 else ("logprobs",)
        return self._scoring(lambda s_, a_, r_: logprobs_and_entropy(t.policy, s_, a_, P, r_, t.cfg.generation.temperature,
                                                                     pack=t.pack), seq, attn, response, names)

    def scoring_critic(self, seq, attn, response, P: int) -> torch.Tensor:
        """The critic's values [n, R] of all of this rank's rows (no grad), under the caller's autocast."""
        t = self.trainer
        return self._scoring(lambda s_, a_, r_: (critic_values(t.critic, s_, a_, P, t.pack).float(),),
                             seq, attn, response, ("values",))[0]

    def _scoring(self, fn, seq, attn, response, names: tuple[str, ...]) -> tuple:
        """fn(seq, attn, response) -> tensors [n, R] (or None) for all rows, detached; the kept rows'
        outputs, graphs and all, stored under `names` (zipped with fn's outputs)."""
        if not self.keep:
            return fn(seq, attn, response)
        if self.rows is None:  # all of this rank's rows
            with torch.enable_grad():
                out = fn(seq, attn, response)
            self.kept.update(zip(names, out))
            return tuple(None if t is None else t.detach() for t in out)
        rows = self.rows
        with torch.enable_grad():
            out = fn(seq[rows], attn[rows], response[rows])
        self.kept.update(zip(names, out))
        rest = torch.ones(len(seq), dtype=torch.bool, device=seq.device)
        rest[rows] = False
        others = fn(seq[rest], attn[rest], response[rest])
        return tuple(None if a is None else torch.empty(len(seq), *a.shape[1:], dtype=a.dtype, device=a.device)
                     .index_copy_(0, rows, a.detach()).masked_scatter_(rest[:, None], b) for a, b in zip(out, others))

    # ---------------------------------------------------------------- the update
    def policy(self, x: Minibatch, rows: slice) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The policy's log-probs and (with an entropy bonus, else None) entropy [n, R] of x's `rows`."""
        R, kept = x.mask.shape[1], self.kept.pop("logprobs", None)
        if kept is not None:  # the scoring pass's forward: same rows, same parameters
            entropy = self.kept.pop("entropy", None)
            return kept[:, :R], None if entropy is None else entropy[:, :R]
        t = self.trainer
        with t.policy.training(), t.autocast:
            return logprobs_and_entropy(t.policy, x.seq[rows], x.attn[rows], x.P, x.response[rows], t.cfg.generation.temperature,
                                        with_entropy=t.cfg.ppo.entropy_coef > 0, pack=t.pack)

    def critic(self, x: Minibatch, rows: slice) -> torch.Tensor:
        """The critic's values [n, R] of x's `rows` (float32)."""
        kept = self.kept.pop("values", None)
        if kept is not None:  # the scoring pass's forward: same rows, same parameters
            return kept[:, : x.mask.shape[1]]
        t = self.trainer
        with t.critic.training(), t.autocast:
            return critic_values(t.critic, x.seq[rows], x.attn[rows], x.P, t.pack).float()


def eval_summary(pol: dict, sft: dict) -> tuple[dict[str, float], dict]:
    """Eval metrics from the policy's and the SFT model's held-out scores (dicts of per-prompt
    lists: rm, gold, length), and the scores to log as an artifact. Win rate: the policy's gold
    score beats the SFT model's on the same prompt, ties count half."""
    out = {keys.EVAL_RM: sum(pol["rm"]) / len(pol["rm"]), keys.EVAL_LENGTH: sum(pol["length"]) / len(pol["length"])}
    if pol["gold"]:
        out[keys.EVAL_GOLD] = sum(pol["gold"]) / len(pol["gold"])
        wins = [1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(pol["gold"], sft["gold"])]
        out[keys.EVAL_WIN_RATE] = sum(wins) / len(wins)
    return out, {"rm": pol["rm"], "gold": pol["gold"], "sft_rm": sft["rm"], "sft_gold": sft["gold"]}


class PPOTrainer:
    def __init__(self, cfg: TrainConfig, models: Models, source: PromptSource, device: torch.device, env: DistEnv = DistEnv()):
        self.cfg, self.m, self.source, self.device, self.env = cfg, models, source, device, env
        self.tok = models.tokenizer
        self.eos_id, self.pad_id = self.tok.eos_token_id, self.tok.pad_token_id
        pc = models.policy.config
        self.max_positions = getattr(pc, "max_position_embeddings", None) or getattr(pc, "n_positions", None) or 10**9
        # prompt + response must fit the context: prompts give way (they keep their last tokens)
        self.max_prompt_tokens = min(cfg.data.max_prompt_tokens, self.max_positions - cfg.generation.max_new_tokens)
        if self.max_prompt_tokens < 1:
            raise ValueError(f"generation.max_new_tokens: got {cfg.generation.max_new_tokens}; allowed: less than the "
                             f"policy's context of {self.max_positions} tokens, leaving room for the prompt")
        for model in (models.policy, models.reference, models.reward, models.critic):
            if model is not None:
                fuse_activations(model)  # GPT-2's gelu_new in one cheap form: same function (rollout.GELUTanh)
        p, d = cfg.ppo, cfg.distributed
        schedule = lr_lambda(p.warmup_steps, p.lr_schedule, max(1, p.steps * p.ppo_epochs * p.num_minibatches))
        self.policy = Engine(models.policy, p.policy_lr, schedule, cfg, env, device)
        # critic-free estimators (`Models` built no critic): no critic forward, update, pretraining or val/ metrics
        self.critic = None if models.critic is None else Engine(models.critic, p.critic_lr, schedule, cfg, env, device)
        self.reference = frozen(models.reference, cfg, env, device)
        self.reward = frozen(models.reward, cfg, env, device)
        self.audit = [frozen(m, cfg, env, device) for m in models.audit]
        self.fast_sampling = not (d.deepspeed and d.zero_stage == 3)  # the static decoder reads whole weights
        # teacher-forced passes over real tokens only (gpt2.packed_hidden) call the modules' parts
        # directly: plain torch only (a DeepSpeed engine's forward must run as a whole)
        self.pack = not d.deepspeed
        self.reward_stats = RunningMeanStd()
        self.cov_gen: torch.Generator | None = None  # Clip-Cov's token draw (set per update)
        self.kl_ctl = KLController(p.kl_coef, p.kl_target if p.kl_controller == "adaptive" else None, p.kl_horizon)
        self.data_gen = torch.Generator().manual_seed(cfg.seed)
        self.rollout_counter = 0  # rollouts made so far: the sampling noise's counter
        self.sampled_tokens = 0  # response tokens sampled so far, all ranks (training rollouts, ReMax's greedy ones)
        self.prompt_order: list[int] = []
        self.prompt_tokens = [self._encode_prompt(t) for t in source.train_prompts]
        self.eval_tokens = [self._encode_prompt(t) for t in source.eval_prompts]
        self.sft_eval: dict | None = None  # SFT responses on eval prompts, made once
        bf16 = cfg.model.autocast == "bf16"
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    # ------------------------------------------------------------------ data
    def _encode_prompt(self, text: str) -> list[int]:
        """`models.encode_prompt`'s ids; a longer prompt keeps its last tokens, and its leading BOS."""
        ids, n = encode_prompt(self.tok, text, self.cfg), self.max_prompt_tokens
        keep = int(n > 1 and self.tok.bos_token_id is not None and ids[:1] == [self.tok.bos_token_id])
        return ids if len(ids) <= n else ids[:keep] + ids[len(ids) - n + keep:]

    def next_prompts(self, n: int) -> list[int]:
        """Indices of the next n training prompts: a fresh shuffle each pass over the data."""
        out = []
        while len(out) < n:
            if not self.prompt_order:
                self.prompt_order = torch.randperm(len(self.prompt_tokens), generator=self.data_gen).tolist()
            out.append(self.prompt_order.pop())
        return out

    # ------------------------------------------------------------------ rollout + scoring
    def generate(self, model, token_lists: list[list[int]], stream: int, counter: int, **kw) -> Rollout:
        """This rank's shard of a global batch of prompts. Rows are padded to a multiple of the world
        size with copies of row 0 (`gather` drops them); row j's noise is keyed by (seed, stream, counter, j)."""
        g, W = self.cfg.generation, self.env.world_size
        lists = token_lists + [token_lists[0]] * (-len(token_lists) % W)
        lo, hi = self.env.shard(len(lists))
        ids, mask = left_pad(lists[lo:hi], self.pad_id, self.device, width=max(map(len, lists)))
        with self.autocast:
            return sample(
                model, ids, mask, counter_hash(self.cfg.seed, stream, counter, torch.arange(lo, hi)),
                max_new_tokens=g.max_new_tokens, eos_id=self.eos_id, pad_id=self.pad_id, temperature=g.temperature,
                top_k=g.top_k, top_p=g.top_p, stop_at_eos=g.stop_at_eos, fast=self.fast_sampling,
                all_finished=lambda done: self.env.all_true(done, self.device), **kw,
            )

    def gather(self, t: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """The first n rows of the ranks' shards, in rank order (the global batch)."""
        return None if t is None else self.env.all_gather(t)[:n]

    @torch.no_grad()
    def scored(self, ro: Rollout, n: int) -> tuple[Rollout, torch.Tensor, list[str], list[str], torch.Tensor | None]:
        """This rank's shard scored by the RM, then the global batch of n rows: (rollout, raw
        scores, prompt texts, response texts, gold scores or None)."""
        with self.autocast:
            scores = last_scores(self.reward, ro.sequences, ro.attention_mask, self.pack).float()
        scores = self.gather(scores, n)
        ro = Rollout(*(self.gather(getattr(ro, f.name), n) for f in dataclasses.fields(Rollout)))
        prompts = [self.tok.decode(ids[m.bool()].tolist(), skip_special_tokens=True) for ids, m in zip(ro.prompt_ids, ro.prompt_mask)]
        responses = [
            self.tok.decode([t for t in ids[m.bool()].tolist() if t != self.eos_id], skip_special_tokens=True)
            for ids, m in zip(ro.response_ids, ro.response_mask)
        ]
        gold = None
        if self.source.gold is not None:
            gold = torch.tensor(self.source.gold(prompts, responses, ro.ended.tolist()), dtype=torch.float32)
        return ro, scores, prompts, responses, gold

    def process(self, scores: torch.Tensor, update_stats: bool = True) -> torch.Tensor:
        r = self.cfg.reward
        return process_scores(scores, self.reward_stats, scale=r.scale, normalize=r.normalize, clip=r.clip,
                              update_stats=update_stats)

    @torch.no_grad()
    def make_batch(self, timers: dict[str, float]) -> Batch:
        cfg, p = self.cfg, self.cfg.ppo
        t0 = time.perf_counter()
        B, G = p.rollout_batch_size, cfg.generation.samples_per_prompt
        idx = self.next_prompts(B // G)
        perm = torch.randperm(B, generator=self.data_gen)  # the update's first epoch order (its next draw)
        lists = [self.prompt_tokens[i] for i in idx]
        counter, self.rollout_counter = self.rollout_counter, self.rollout_counter + 1
        # the G samples of a prompt are adjacent rows (group = row // G); keyed by row, they differ
        ro = self.generate(self.m.policy, [t for t in lists for _ in range(G)], STREAM_ROLLOUT, counter,
                           with_entropy=p.reuse_rollout_logprobs)
        t1 = time.perf_counter()
        P, T = ro.prompt_ids.shape[1], cfg.generation.temperature
        seq, attn, mask = ro.sequences, ro.attention_mask, ro.response_mask.float()
        # the update's first minibatch reuses these forwards of its rows where it can (`Forwards`)
        first = Forwards(self, perm)
        with self.autocast:
            if p.reuse_rollout_logprobs:  # old log-probs and entropy from the sampling pass: no policy forward here
                logprobs, entropy = ro.sample_logprobs, ro.sample_entropy
            else:
                logprobs, entropy = first.scoring_policy(seq, attn, ro.response_ids, P)
            ref_logprobs, _ = logprobs_and_entropy(self.reference, seq, attn, P, ro.response_ids, T, with_entropy=False,
                                                   pack=self.pack)
            values = torch.zeros_like(mask)
            if self.critic is not None:
                values = first.scoring_critic(seq, attn, ro.response_ids, P)
        gt = self.gather
        logprobs, ref_logprobs, values = gt(logprobs.float() * mask, B), gt(ref_logprobs.float() * mask, B), gt(values * mask, B)
        entropy = gt(entropy.float(), B)
        audit = None
        if self.audit:  # this rank's shard scored by each audit RM, then the global batch [k, B]
            with self.autocast:
                audit = torch.stack([self.gather(last_scores(m, ro.sequences, ro.attention_mask, self.pack).float(), B)
                                     for m in self.audit])
        ro, scores, prompts, responses, gold = self.scored(ro, B)
        self.sampled_tokens += int(ro.lengths.sum())
        processed = self.process(scores)
        overlong = None
        if cfg.reward.overlong_buffer:  # DAPO: pushed back from the cap after normalization, so it is not undone
            overlong = overlong_penalty(ro.lengths, cfg.generation.max_new_tokens, cfg.reward.overlong_buffer,
                                        cfg.reward.overlong_penalty).to(processed)
            processed = processed + overlong
        baseline = None
        if p.adv_estimator in NEEDS_GREEDY:  # ReMax: the greedy response's processed score, per prompt
            greedy, greedy_scores = self.scored(self.generate(self.m.policy, lists, STREAM_ROLLOUT, counter, greedy=True),
                                                len(lists))[:2]
            self.sampled_tokens += int(greedy.lengths.sum())
            baseline = self.process(greedy_scores, update_stats=False).repeat_interleave(G)
        t2 = time.perf_counter()
        mask = ro.response_mask.float()
        kl = (logprobs - ref_logprobs) * mask
        kl_pen = kl_per_token(logprobs, ref_logprobs, p.kl_estimator) * mask
        # the penalty in the reward, or (kl_placement=loss) none here and eta * KL in the policy loss
        kl_coef = self.kl_ctl.value if p.kl_placement == "reward" else 0.0
        rewards, non_score = token_rewards(processed, kl_pen, mask, kl_coef)
        group = torch.arange(B, device=mask.device) // G
        advantages, returns = estimate(
            p.adv_estimator, rewards=rewards, values=values, mask=mask, gamma=p.gamma, lam=p.gae_lambda,
            group=group, baseline=baseline,
        )
        keep = None if p.dynamic_sampling_tol is None else informative_groups(scores.to(mask.device), group, p.dynamic_sampling_tol)
        if p.critic_gae_lambda is not None:  # VAPO's decoupled GAE: the critic's targets with their own lambda
            returns = compute_gae(rewards, values, mask, p.gamma, p.critic_gae_lambda)[1]
        timers |= {keys.TIME_ROLLOUT: t1 - t0, keys.TIME_SCORE: t2 - t1, keys.TIME_ADVANTAGE: time.perf_counter() - t2}
        return Batch(ro, logprobs, ref_logprobs, values, entropy, scores, processed, gold,
                     non_score, kl, advantages, returns, prompts, responses, overlong, keep, perm, first, audit)

    # ------------------------------------------------------------------ update
    def _ptx_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The global PPO-ptx batch, right-padded (the same on every rank: drawn from the shared data generator)."""
        pairs = self.source.sft_texts
        pick = torch.randint(len(pairs), (self.cfg.ppo.ptx_batch_size,), generator=self.data_gen).tolist()
        seqs = []
        for i in pick:
            prompt, response = pairs[i]
            ids = self._encode_prompt(prompt) + self.tok(response, add_special_tokens=False)["input_ids"] + [self.eos_id]
            seqs.append(torch.tensor(ids[: self.max_positions]))  # long SFT replies (HH-RLHF) must fit the context
        pad = torch.nn.utils.rnn.pad_sequence
        ids = pad(seqs, batch_first=True, padding_value=self.pad_id)
        mask = pad([torch.ones_like(s) for s in seqs], batch_first=True)
        return ids.to(self.device), mask.to(self.device)

    def update(self, b: Batch, train_policy: bool = True) -> dict[str, float]:
        """ppo_epochs passes over the batch in num_minibatches global minibatches; returns mean stats."""
        p, env = self.cfg.ppo, self.env
        ro = b.rollout
        B, P = ro.response_ids.shape[0], ro.prompt_ids.shape[1]
        mb_size = B // p.num_minibatches
        gas = self.cfg.distributed.gradient_accumulation
        per = mb_size // env.world_size
        micro = per // gas
        parts = [slice(env.rank * per + u * micro, env.rank * per + (u + 1) * micro) for u in range(gas)]
        seq, attn, mask = ro.sequences, ro.attention_mask, ro.response_mask.float()
        acc: dict[str, list[float]] = {}

        def add(k: str, v) -> None:
            acc.setdefault(k, []).append(float(v))

        if b.keep is not None and b.keep.any():  # DAPO's dynamic sampling: the dropped groups' tokens leave every loss
            mask = mask * b.keep[:, None]
        advantages, whiten = b.advantages, p.adv_normalize
        if p.adv_normalize and p.adv_normalize_mode == "group_mean_batch_std":  # LitePPO: once over the whole batch
            advantages = group_mean_batch_std(advantages, mask, torch.arange(B, device=mask.device) // self.cfg.generation.samples_per_prompt)
            whiten = False
        # Clip-Cov's random token draw: its own generator, keyed by the rollout (ranks and resumes agree; data_gen untouched)
        self.cov_gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.rollout_counter) if p.policy_loss == "clip_cov" else None
        fresh = Forwards(self)  # asks forward afresh
        forwards, b.first_pass = b.first_pass or fresh, None  # the first minibatch's: the scoring pass's, where kept
        for epoch in range(p.ppo_epochs):
            perm = b.first_perm if epoch == 0 else torch.randperm(B, generator=self.data_gen)
            for s in range(0, B, mb_size):
                # sorted rows: with one minibatch each rank's share is exactly its rollout shard (the first pass's rows)
                i = perm[s : s + mb_size].sort().values.to(self.device)
                m = mask[i]
                R = int(m.sum(1).max().item())  # trim right padding shared by this minibatch
                if R == 0:  # every row dropped by dynamic sampling: no update (a zero loss would still move AdamW)
                    forwards = fresh
                    continue
                m = m[:, :R]
                adv = b.advantages[i][:, :R]
                add(keys.ADV_RAW_MEAN, masked_mean(adv, m).item())
                if advantages is not b.advantages:  # LitePPO's, normalized over the whole batch above
                    adv = advantages[i][:, :R]
                if whiten:
                    adv = masked_whiten(adv, m)
                if p.adv_clip is not None:
                    adv = adv.clamp(-p.adv_clip, p.adv_clip)
                add(keys.ADV_MEAN, masked_mean(adv, m).item())
                add(keys.ADV_STD, masked_var(adv, m, unbiased=False).sqrt().item())
                x = Minibatch(
                    seq[i][:, : P + R], attn[i][:, : P + R], ro.response_ids[i][:, :R], m, adv,
                    b.old_logprobs[i][:, :R], b.ref_logprobs[i][:, :R], b.old_values[i][:, :R], b.returns[i][:, :R],
                    P, m.sum().clamp(min=1), parts,
                )
                if train_policy:
                    self.policy_step(x, forwards, add)
                if self.critic is not None:
                    self.critic_step(x, forwards, add)
                forwards = fresh  # the scoring pass's graphs serve the first minibatch only: any left are freed
        return {k: sum(v) / len(v) for k, v in acc.items()}

    def policy_step(self, x: Minibatch, forwards: Forwards, add) -> None:
        """One optimizer step of the policy on a minibatch. Each micro-batch back-propagates its share
        of the policy loss's `aggregate` numerator (plus eta * the KL's with kl_placement=loss) over
        the whole minibatch's denominator; the entropy term and PPO-ptx are token means alike."""
        p, env, with_entropy = self.cfg.ppo, self.env, self.cfg.ppo.entropy_coef > 0
        agg = (p.loss_aggregation, self.cfg.generation.max_new_tokens)
        den = aggregate(x.mask, x.mask, *agg)[1].clamp(min=1)  # from the mask alone: every rank knows it
        kl_coef = self.kl_ctl.value if p.kl_placement == "loss" else 0.0
        ptx = self._ptx_batch() if p.ptx_coef > 0 else None
        if ptx is not None:
            n_ptx = ptx[1][:, 1:].sum().clamp(min=1)
            ptx_per = ptx[0].shape[0] // (env.world_size * len(x.parts))

        # |H - target|: its gradient's sign comes from the global minibatch mean H, which must be known
        # before the first backward; with several micro-batches, a no-grad forward measures it first
        sign = None
        if with_entropy and p.entropy_target is not None and len(x.parts) > 1:
            with torch.no_grad():
                h = sum((forwards.policy(x, rows)[1].float() * x.mask[rows]).sum() for rows in x.parts)
            sign = torch.sign(env.all_reduce(h) / x.n_tokens - p.entropy_target)
        tot: dict[str, torch.Tensor] = {}  # this minibatch's sums over all ranks and micro-batches
        ratios, norm = [], None
        for u, rows in enumerate(x.parts):
            mu = x.mask[rows]
            logprobs, entropy = forwards.policy(x, rows)
            logprobs = logprobs.float()
            loss_tok, st = POLICY_LOSSES[p.policy_loss](
                logprobs, x.old_logprobs[rows], x.adv[rows], clip_eps=p.clip_eps,
                importance_sampling=p.importance_sampling, ref_logprobs=x.ref_logprobs[rows], apa_lambda=p.apa_lambda,
                awr_beta=p.awr_beta, awr_max_weight=p.awr_max_weight, mask=mu, clip_eps_high=p.clip_eps_high,
                dual_clip_c=p.dual_clip_c, clip_cov_ratio=p.clip_cov_ratio, clip_cov_lb=p.clip_cov_lb, clip_cov_ub=p.clip_cov_ub,
                kl_cov_ratio=p.kl_cov_ratio, kl_cov_coef=p.kl_cov_coef, generator=self.cov_gen,
            )
            pg_num = aggregate(loss_tok, mu, *agg)[0]
            loss_num = pg_num
            if kl_coef:
                kl_tok = kl_per_token(logprobs, x.ref_logprobs[rows], p.kl_estimator)
                loss_num = loss_num + kl_coef * aggregate(kl_tok, mu, *agg)[0]
            ent_sum = (entropy.float() * mu).sum() if with_entropy else torch.zeros((), device=self.device)
            ptx_sum = torch.zeros((), device=self.device)
            if ptx is not None:
                k0 = (env.rank * len(x.parts) + u) * ptx_per
                ids, pm = ptx[0][k0 : k0 + ptx_per], ptx[1][k0 : k0 + ptx_per]
                with self.policy.training(), self.autocast:
                    ptx_sum = lm_loss(self.policy, ids, pm) * pm[:, 1:].sum()
            ratio = st["ratio"]
            ratios.append((ratio, mu))
            glob = env.all_reduce_sums({
                "pg_num": pg_num, "entropy": ent_sum, "clipped": (st["clipped"] * mu).sum(),
                "approx_kl": 0.5 * (st["log_ratio"] ** 2 * mu).sum(), "ratio": (ratio * mu).sum(), "ptx": ptx_sum,
                "tokens": mu.sum(),
                # a trick's own per-token quantity (harness.algorithms.losses), named by its metric key
                **{k: (v * mu).sum() for k, v in st.items() if k not in ("clipped", "ratio", "log_ratio")},
            })
            tot = {k: tot.get(k, 0.0) + g for k, g in glob.items()}
            if not all(math.isfinite(glob[k].item()) for k in ("pg_num", "entropy", "ptx")):
                raise NonFiniteLoss(f"policy loss is non-finite (pg_loss sum {glob['pg_num'].item()}, "
                                    f"ptx sum {glob['ptx'].item()}); the run diverged")
            loss = loss_num / den
            if with_entropy:
                if p.entropy_target is None:
                    loss = loss - p.entropy_coef * ent_sum / x.n_tokens
                else:
                    if sign is None:  # one micro-batch per rank: this forward saw the whole minibatch
                        sign = torch.sign(glob["entropy"] / x.n_tokens - p.entropy_target)
                    loss = loss + p.entropy_coef * sign.float() * ent_sum / x.n_tokens
            if ptx is not None:
                loss = loss + p.ptx_coef * ptx_sum / n_ptx
            norm = self.policy.backward(loss)
        n = tot["tokens"].clamp(min=1)
        r_mean = tot["ratio"] / n
        r_var = env.all_reduce(sum(((r.double() - r_mean) ** 2 * mu).sum() for r, mu in ratios))
        add(keys.GRAD_NORM_POLICY, norm)
        add(keys.PG_LOSS, tot["pg_num"] / den)
        add(keys.ENTROPY_LOSS, entropy_term((tot["entropy"] / n).float(), p.entropy_coef, p.entropy_target) if with_entropy else 0.0)
        if ptx is not None:
            add(keys.PTX_LOSS, tot["ptx"] / n_ptx)
        add(keys.POLICY_CLIPFRAC, tot["clipped"] / n)
        for k in tot.keys() & set(keys.TRICK_METRICS):
            add(k, tot[k] / n)
        add(keys.APPROX_KL, tot["approx_kl"] / n)
        add(keys.RATIO_MEAN, r_mean)
        add(keys.RATIO_STD, (r_var / n).sqrt())
        add(keys.RATIO_MAX, env.all_reduce(torch.stack([(r * mu).max() for r, mu in ratios]).max(), "max"))

    def critic_step(self, x: Minibatch, forwards: Forwards, add) -> None:
        """One optimizer step of the critic on a minibatch (token-weighted like `policy_step`)."""
        tot: dict[str, torch.Tensor] = {}  # this minibatch's sums over all ranks and micro-batches
        norm = None
        for rows in x.parts:
            mu = x.mask[rows]
            n_u = mu.sum()
            v = forwards.critic(x, rows)
            vf_mean, vf_clipfrac = value_loss(v, x.old_values[rows], x.returns[rows], mu, self.cfg.ppo.value_clip)
            glob = self.env.all_reduce_sums({"vf_loss": vf_mean * n_u, "vf_clipfrac": vf_clipfrac.to(self.device) * n_u})
            tot = {k: tot.get(k, 0.0) + g for k, g in glob.items()}
            if not math.isfinite(glob["vf_loss"].item()):
                raise NonFiniteLoss(f"value loss is {glob['vf_loss'].item()}; the run diverged")
            norm = self.critic.backward(vf_mean * n_u / x.n_tokens)
        add(keys.GRAD_NORM_CRITIC, norm)
        add(keys.VF_LOSS, tot["vf_loss"] / x.n_tokens)
        add(keys.VF_CLIPFRAC, tot["vf_clipfrac"] / x.n_tokens)

    # ------------------------------------------------------------------ one step
    def rollout_metrics(self, b: Batch) -> dict[str, float]:
        ro, mask = b.rollout, b.rollout.response_mask.float()
        lengths = ro.lengths.float()
        n_tok = mask.sum(1).clamp(min=1)
        k3 = kl_per_token(b.old_logprobs, b.ref_logprobs, "k3") * mask
        ppl, ppl_tokens = perplexity(b.old_logprobs, mask)
        out = {
            keys.RM_SCORE: b.scores.mean().item(),
            keys.RM_SCORE_STD: b.scores.std().item() if len(b.scores) > 1 else 0.0,
            keys.KL: (b.kl.sum(1) / n_tok).mean().item(),
            keys.KL_K3: (k3.sum(1) / n_tok).mean().item(),
            keys.KL_COEF: self.kl_ctl.value,
            keys.ENTROPY: masked_mean(b.entropy.float(), mask).item(),
            keys.PPL: ppl,
            keys.PPL_TOKENS: ppl_tokens,
            keys.PPL_REF: perplexity(b.ref_logprobs, mask)[0],
            keys.NON_SCORE_REWARD: b.non_score_rewards.sum(1).mean().item(),
            keys.SCORE_PROCESSED: b.processed_scores.mean().item(),
            keys.LENGTH: lengths.mean().item(),
            keys.SAMPLED_TOKENS: float(self.sampled_tokens),
            keys.LENGTH_MAX: lengths.max().item(),
            keys.LENGTH_STD: lengths.std().item() if len(lengths) > 1 else 0.0,
            keys.FRAC_AT_CAP: (lengths >= self.cfg.generation.max_new_tokens).float().mean().item(),
            keys.ADV_RAW_STD: masked_var(b.advantages, mask, unbiased=False).sqrt().item(),
            keys.REWARD_RUNNING_MEAN: self.reward_stats.mean,
            keys.REWARD_RUNNING_STD: self.reward_stats.std,
            keys.LR_POLICY: self.policy.lr,
        }
        if self.critic is not None:
            out[keys.VALUES] = masked_mean(b.old_values, mask).item()
            out[keys.RETURNS] = masked_mean(b.returns, mask).item()
            var_returns = masked_var(b.returns, mask, unbiased=False)
            out[keys.RETURNS_STD] = var_returns.sqrt().item()
            out[keys.EXPLAINED_VAR] = (1 - masked_var(b.returns - b.old_values, mask, unbiased=False)
                                       / var_returns.clamp(min=1e-12)).item()
            out[keys.LR_CRITIC] = self.critic.lr
        if b.overlong is not None:
            out[keys.OVERLONG_PENALTY] = b.overlong.mean().item()
        if b.keep is not None:
            out[keys.GROUPS_KEPT_FRAC] = b.keep.float().mean().item()
        out |= self.signal_metrics(b)
        if b.gold is not None:
            out[keys.GOLD_SCORE] = b.gold.mean().item()
            out[keys.GOLD_SCORE_STD] = b.gold.std().item() if len(b.gold) > 1 else 0.0
        return out

    def signal_metrics(self, b: Batch) -> dict[str, float]:
        """What the samples look like and the audit RMs' second opinion (harness.signals)."""
        ro = b.rollout
        ids = [[t for t in row[m.bool()].tolist() if t != self.eos_id] for row, m in zip(ro.response_ids, ro.response_mask)]
        sig = signals.batch_signals(ids, self.cfg.generation.samples_per_prompt)
        out = {keys.DISTINCT_1: sig["distinct_1"], keys.DISTINCT_2: sig["distinct_2"],
               keys.REPEATED_2GRAM: sig["repeated_2gram"]}
        if "group_similarity" in sig:
            out[keys.GROUP_SIMILARITY] = sig["group_similarity"]
        if b.audit is not None:
            a = signals.audit_stats(b.scores, b.audit)
            out |= {keys.AUDIT_MEAN: a["mean"], keys.AUDIT_STD: a["std"], keys.AUDIT_GAP: a["gap"],
                    keys.AUDIT_DISAGREEMENT: a["disagreement"]}
            out |= {keys.AUDIT_MEMBER.format(k=k): v for k, v in enumerate(b.audit.mean(1).tolist())}
        return out

    def step(self) -> tuple[dict[str, float], Batch]:
        timers: dict[str, float] = {}
        t0 = time.perf_counter()
        b = self.make_batch(timers)
        metrics = self.rollout_metrics(b)
        t1 = time.perf_counter()
        metrics.update(self.update(b))
        timers[keys.TIME_UPDATE] = time.perf_counter() - t1
        self.kl_ctl.update(metrics[keys.KL], b.rollout.response_ids.shape[0])
        timers[keys.STEP_S] = time.perf_counter() - t0
        if self.env.active:  # identical metrics on every rank: the slowest rank's timings
            slowest = self.env.all_reduce(torch.tensor(list(timers.values()), dtype=torch.float64, device=self.device), "max")
            timers = dict(zip(timers, slowest.tolist()))
        metrics.update(timers)
        metrics[keys.TOKENS_PER_S] = b.rollout.response_mask.sum().item() / max(timers[keys.STEP_S], 1e-9)
        return metrics, b

    def pretrain_critic(self) -> dict[str, float]:
        """Critic pretraining: one rollout step with the policy frozen, only the critic learns."""
        return self.update(self.make_batch({}), train_policy=False)

    def seed_reward_stats(self) -> None:
        for _ in range(self.cfg.reward.running_stats_init):
            self.make_batch({})

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> tuple[dict[str, float], dict]:
        """Held-out prompts: RM and gold scores of the policy, and win rate against the SFT model
        (both sample with the same keys, so a prompt's noise is the same for both)."""
        if not self.eval_tokens:
            return {}, {}
        bs = self.cfg.ppo.rollout_batch_size

        def run(model) -> dict:
            out: dict[str, list] = {"rm": [], "gold": [], "length": []}
            for s in range(0, len(self.eval_tokens), bs):
                lists = self.eval_tokens[s : s + bs]
                ro, scores, _, _, gold = self.scored(self.generate(model, lists, STREAM_EVAL, s), len(lists))
                out["rm"] += scores.tolist()
                out["gold"] += [] if gold is None else gold.tolist()
                out["length"] += ro.lengths.tolist()
            return out

        if self.sft_eval is None:
            self.sft_eval = run(self.reference)
        return eval_summary(run(self.m.policy), self.sft_eval)

    # ------------------------------------------------------------------ checkpoint state
    def engines(self) -> dict[str, Engine]:
        return {"policy": self.policy} if self.critic is None else {"policy": self.policy, "critic": self.critic}

    def state_dict(self) -> dict:
        """Single-process checkpoint format, gathered from every rank (call on all ranks)."""
        s = {
            "reward_stats": self.reward_stats.state_dict(), "kl_coef": self.kl_ctl.value,
            "data_gen": self.data_gen.get_state(), "prompt_order": torch.tensor(self.prompt_order, dtype=torch.long),
            "rollout_counter": self.rollout_counter, "world_size": self.env.world_size, "sampled_tokens": self.sampled_tokens,
        }
        for name, e in self.engines().items():
            s[name], s[f"{name}_opt"] = e.full_state()
            s[f"{name}_sched"] = e.sched.state_dict()
        return s

    def restore_models(self, s: dict) -> None:
        """Policy, critic, their optimizers and schedules and the reward statistics from a `state_dict`
        snapshot; the data order and sampling counters go on (a rollback resamples, it does not replay)."""
        for name, e in self.engines().items():
            e.load_full_state(s[name], s[f"{name}_opt"])
            e.sched.load_state_dict(s[f"{name}_sched"])
        self.reward_stats.load_state_dict(s["reward_stats"])

    def load_state_dict(self, s: dict) -> None:
        for name, e in self.engines().items():
            e.load_full_state(s[name], s[f"{name}_opt"])
            e.sched.load_state_dict(s[f"{name}_sched"])
        self.reward_stats.load_state_dict(s["reward_stats"])
        self.kl_ctl.value = float(s["kl_coef"])
        self.data_gen.set_state(s["data_gen"])
        self.prompt_order = s["prompt_order"].tolist()
        self.rollout_counter = int(s["rollout_counter"])
        self.sampled_tokens = int(s["sampled_tokens"])
