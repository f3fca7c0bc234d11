"""The PPO step, top to bottom: rollout -> scores -> per-token rewards -> GAE -> PPO epochs.

Every trick is a flag in `harness.config`; every formula is a pure function in
`harness.algorithms`. This module only orchestrates, so the loop reads in one place.

One trainer for one process or many (`parallel.DistEnv`: every collective is a no-op at world
size 1). What W ranks compute is, up to float rounding, what one rank computes on the same
global batch:

- **Global batch, sharded.** `ppo.rollout_batch_size` is the global batch. Every rank draws the
  same prompt indices (the data generator is seeded alike) and generates and scores its contiguous
  slice of rows with keyed sampling (`rollout.sample`): a row's tokens do not depend on its rank.
  Prompts are left-padded to the global batch's longest, and decoding runs until every rank's rows
  have ended, so shapes agree.
- **Gather once, compute the rest everywhere.** The scored shards are all-gathered: reward
  statistics, per-token rewards, GAE and the rollout metrics are the one-rank computation, run
  redundantly (cheap elementwise ops).
- **Global minibatches, token-weighted losses.** Minibatches come from the global batch by the
  one-rank permutation; advantages are whitened over the global minibatch; each rank takes its
  share of the minibatch rows, split into `distributed.gradient_accumulation` micro-batches, and
  back-propagates sum(token losses) / (global token count): summed over ranks and micro-batches,
  the one-rank minibatch gradient. Logged losses are all-reduced token sums, the same on every rank.
- **Consolidated checkpoints.** `state_dict()` gathers the single-process format from every rank,
  so a checkpoint of any world size or ZeRO stage reloads into any other.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from . import keys
from .algorithms import (
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    RunningMeanStd,
    compute_gae,
    entropy_term,
    kl_per_token,
    masked_mean,
    masked_whiten,
    perplexity,
    process_scores,
    token_rewards,
    value_loss,
)
from .config import TrainConfig
from .data import PromptSource
from .models import Models
from .parallel import DistEnv, Engine, NonFiniteLoss, frozen
from .rollout import (
    STREAM_EVAL, STREAM_ROLLOUT, Rollout, counter_hash, critic_values, fuse_activations, left_pad, lm_loss,
    logprobs_and_entropy, position_ids, sample,
)


@dataclass
class Batch:
    """A scored rollout (the global batch) with everything the update needs, all [B, R] unless noted."""

    rollout: Rollout
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    old_values: torch.Tensor
    entropy: torch.Tensor
    scores: torch.Tensor  # [B] raw RM score
    processed_scores: torch.Tensor  # [B]
    gold: torch.Tensor | None  # [B]
    rewards: torch.Tensor
    non_score_rewards: torch.Tensor
    kl: torch.Tensor  # k1 per token
    advantages: torch.Tensor
    returns: torch.Tensor
    prompts: list[str]
    responses: list[str]
    first_pass: dict | None = None
    """This rank's scoring-pass outputs that still hold their autograd graph ("logprobs", "entropy",
    "values"), reused by the update's first epoch when it has one minibatch (same inputs, parameters
    not yet stepped)."""


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
    """Response tokens in the whole minibatch (all ranks): every loss is a token sum divided by it."""
    parts: list[slice]
    """This rank's micro-batches: rows of the minibatch."""
    first: dict
    """Scoring-pass graphs for this rank's rows (one micro-batch), or empty."""


def lr_lambda(cfg: TrainConfig, total_updates: int):
    warm, kind = cfg.ppo.warmup_steps, cfg.ppo.lr_schedule

    def f(update: int) -> float:
        if warm and update < warm:
            return (update + 1) / warm
        if kind == "constant":
            return 1.0
        frac = min(1.0, (update - warm) / max(1, total_updates - warm))
        return 1.0 - frac if kind == "linear" else 0.5 * (1 + math.cos(math.pi * frac))

    return f


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
            raise ValueError(
                f"generation.max_new_tokens: got {cfg.generation.max_new_tokens}; allowed: less than the policy's "
                f"context of {self.max_positions} tokens, leaving room for the prompt"
            )
        for model in (models.policy, models.reference, models.reward, models.critic):
            fuse_activations(model)  # GPT-2's gelu_new as one fused kernel: same function, ~3x cheaper
        p, d = cfg.ppo, cfg.distributed
        schedule = lr_lambda(cfg, max(1, p.steps * p.ppo_epochs * p.num_minibatches))
        self.policy = Engine(models.policy, p.policy_lr, schedule, cfg, env, device)
        self.critic = Engine(models.critic, p.critic_lr, schedule, cfg, env, device)
        self.reference = frozen(models.reference, cfg, env, device)
        self.reward = frozen(models.reward, cfg, env, device)
        self.fast_sampling = not (d.deepspeed and d.zero_stage == 3)  # the static decoder reads whole weights
        self.reward_stats = RunningMeanStd()
        self.kl_ctl = (
            AdaptiveKLController(p.kl_coef, p.kl_target, p.kl_horizon)
            if p.kl_controller == "adaptive" else FixedKLController(p.kl_coef)
        )
        self.data_gen = torch.Generator().manual_seed(cfg.seed)
        self.rollout_counter = 0  # rollouts made so far: the sampling noise's counter
        self.prompt_order: list[int] = []
        self.prompt_tokens = [self._encode_prompt(t) for t in source.train_prompts]
        self.eval_tokens = [self._encode_prompt(t) for t in source.eval_prompts]
        self.sft_eval: dict | None = None  # SFT responses on eval prompts, made once
        self.autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16) if cfg.model.autocast == "bf16" else contextlib.nullcontext()
        )

    # ------------------------------------------------------------------ data
    def _encode_prompt(self, text: str) -> list[int]:
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return ids[-self.max_prompt_tokens:]

    def next_prompts(self, n: int) -> list[int]:
        """Indices of the next n training prompts: a fresh shuffle each pass over the data."""
        out = []
        while len(out) < n:
            if not self.prompt_order:
                self.prompt_order = torch.randperm(len(self.prompt_tokens), generator=self.data_gen).tolist()
            out.append(self.prompt_order.pop())
        return out

    # ------------------------------------------------------------------ rollout + scoring
    def generate(self, model, token_lists: list[list[int]], stream: int, counter: int, with_entropy: bool = False) -> Rollout:
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
                top_k=g.top_k, top_p=g.top_p, stop_at_eos=g.stop_at_eos, with_entropy=with_entropy,
                fast=self.fast_sampling, all_finished=lambda done: self.env.all_true(done, self.device),
            )

    def gather(self, t: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """The first n rows of the ranks' shards, in rank order (the global batch)."""
        return None if t is None else self.env.all_gather(t)[:n]

    def gather_rollout(self, ro: Rollout, n: int) -> Rollout:
        return Rollout(*(self.gather(getattr(ro, f.name), n) for f in dataclasses.fields(Rollout)))

    def decode(self, ro: Rollout) -> tuple[list[str], list[str]]:
        prompts = [self.tok.decode(ids[m.bool()].tolist(), skip_special_tokens=True) for ids, m in zip(ro.prompt_ids, ro.prompt_mask)]
        responses = [
            self.tok.decode([t for t in ids[m.bool()].tolist() if t != self.eos_id], skip_special_tokens=True)
            for ids, m in zip(ro.response_ids, ro.response_mask)
        ]
        return prompts, responses

    @torch.no_grad()
    def score(self, ro: Rollout) -> torch.Tensor:
        """Raw RM scores of this rank's rows."""
        attn = ro.attention_mask
        with self.autocast:
            return self.reward.score_last(ro.sequences, attn, position_ids(attn)).float()

    def gold(self, ro: Rollout, prompts: list[str], responses: list[str]) -> torch.Tensor | None:
        if self.source.gold is None:
            return None
        return torch.tensor(self.source.gold(prompts, responses, ro.ended.tolist()), dtype=torch.float32)

    def advantages(self, scores, logprobs, ref_logprobs, values, mask):
        """Scores -> processed scores -> per-token rewards (KL penalty) -> GAE advantages and returns."""
        cfg, p = self.cfg, self.cfg.ppo
        processed = process_scores(scores, self.reward_stats, scale=cfg.reward.scale, normalize=cfg.reward.normalize, clip=cfg.reward.clip)
        kl = (logprobs - ref_logprobs) * mask
        kl_pen = kl_per_token(logprobs, ref_logprobs, p.kl_estimator) * mask
        rewards, non_score = token_rewards(processed, kl_pen, mask, self.kl_ctl.value)
        advantages, returns = compute_gae(rewards, values, mask, p.gamma, p.gae_lambda)
        return processed, kl, rewards, non_score, advantages, returns

    @torch.no_grad()
    def make_batch(self, timers: dict[str, float]) -> Batch:
        cfg, p = self.cfg, self.cfg.ppo
        t0 = time.perf_counter()
        B = p.rollout_batch_size
        idx = self.next_prompts(B)
        counter, self.rollout_counter = self.rollout_counter, self.rollout_counter + 1
        ro = self.generate(self.m.policy, [self.prompt_tokens[i] for i in idx], STREAM_ROLLOUT, counter, with_entropy=p.reuse_rollout_logprobs)
        t1 = time.perf_counter()
        P, T = ro.prompt_ids.shape[1], cfg.generation.temperature
        seq, attn, mask = ro.sequences, ro.attention_mask, ro.response_mask.float()
        # With one minibatch, the update's first epoch runs the policy and critic on exactly these rows
        # with the same parameters: keep the graphs of these forwards and let it backprop through them.
        keep = p.num_minibatches == 1 and self.policy.keeps_graphs
        first: dict = {}
        with self.autocast:
            if p.reuse_rollout_logprobs:  # old log-probs and entropy from the sampling pass: no policy forward here
                logprobs, entropy = ro.sample_logprobs, ro.sample_entropy
            else:
                with torch.set_grad_enabled(keep):
                    logprobs, entropy = logprobs_and_entropy(self.policy, seq, attn, P, ro.response_ids, T)
                if keep:
                    first["logprobs"], first["entropy"] = logprobs, (entropy if p.entropy_coef > 0 else None)
                    logprobs, entropy = logprobs.detach(), entropy.detach()
            ref_logprobs, _ = logprobs_and_entropy(self.reference, seq, attn, P, ro.response_ids, T, with_entropy=False)
            with torch.set_grad_enabled(keep):
                values = critic_values(self.critic, seq, attn, P).float()
            if keep:
                first["values"], values = values, values.detach()
        scores = self.score(ro)
        gt = self.gather
        logprobs, ref_logprobs, values = gt(logprobs.float() * mask, B), gt(ref_logprobs.float() * mask, B), gt(values * mask, B)
        entropy, scores, ro = gt(entropy.float(), B), gt(scores, B), self.gather_rollout(ro, B)
        prompts, responses = self.decode(ro)
        gold = self.gold(ro, prompts, responses)
        t2 = time.perf_counter()
        mask = ro.response_mask.float()
        processed, kl, rewards, non_score, advantages, returns = self.advantages(scores, logprobs, ref_logprobs, values, mask)
        t3 = time.perf_counter()
        timers[keys.TIME_ROLLOUT] = t1 - t0
        timers[keys.TIME_SCORE] = t2 - t1
        timers[keys.TIME_ADVANTAGE] = t3 - t2
        return Batch(ro, logprobs, ref_logprobs, values, entropy, scores, processed, gold,
                     rewards, non_score, kl, advantages, returns, prompts, responses, first or None)

    # ------------------------------------------------------------------ update
    def _ptx_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The global PPO-ptx batch (the same on every rank: drawn from the shared data generator)."""
        pairs = self.source.sft_texts
        pick = torch.randint(len(pairs), (self.cfg.ppo.ptx_batch_size,), generator=self.data_gen).tolist()
        seqs = []
        for i in pick:
            prompt, response = pairs[i]
            ids = self._encode_prompt(prompt) + self.tok(response, add_special_tokens=False)["input_ids"] + [self.eos_id]
            seqs.append(ids[: self.max_positions])  # long SFT replies (HH-RLHF) must fit the model's context
        L = max(map(len, seqs))
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        return ids.to(self.device), mask.to(self.device)

    def minibatch_advantages(self, adv: torch.Tensor, m: torch.Tensor, add) -> torch.Tensor:
        """Advantage normalization (masked whitening over the minibatch) and clipping, logged before and after."""
        p = self.cfg.ppo
        add(keys.ADV_RAW_MEAN, masked_mean(adv, m).item())
        if p.adv_normalize:
            adv = masked_whiten(adv, m)
        if p.adv_clip is not None:
            adv = adv.clamp(-p.adv_clip, p.adv_clip)
        add(keys.ADV_MEAN, masked_mean(adv, m).item())
        add(keys.ADV_STD, masked_mean((adv - masked_mean(adv, m)) ** 2, m).sqrt().item())
        return adv

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

        first, b.first_pass = (b.first_pass or {}), None  # scoring-pass graphs, for epoch 0 with one minibatch
        for epoch in range(p.ppo_epochs):
            if epoch == 1:
                first = {}  # frees the graphs
            perm = torch.randperm(B, generator=self.data_gen)
            for s in range(0, B, mb_size):
                # sorted rows: with one minibatch each rank's share is exactly its rollout shard (the first pass's rows)
                i = perm[s : s + mb_size].sort().values.to(self.device)
                m = mask[i]
                R = int(m.sum(1).max().item())  # trim right padding shared by this minibatch
                m = m[:, :R]
                x = Minibatch(
                    seq[i][:, : P + R], attn[i][:, : P + R], ro.response_ids[i][:, :R], m,
                    self.minibatch_advantages(b.advantages[i][:, :R], m, add), b.old_logprobs[i][:, :R],
                    b.ref_logprobs[i][:, :R], b.old_values[i][:, :R], b.returns[i][:, :R], P, m.sum().clamp(min=1), parts,
                    {k: v[:, :R] for k, v in first.items() if v is not None} if mb_size == B else {},
                )
                if train_policy:
                    self.policy_step(x, add)
                self.critic_step(x, add)
        return {k: sum(v) / len(v) for k, v in acc.items()}

    def policy_step(self, x: Minibatch, add) -> None:
        """One optimizer step of the policy on a minibatch: loss = (sum of token losses of this rank's
        micro-batches) / (minibatch tokens), the entropy term and PPO-ptx alike."""
        p, env, f64 = self.cfg.ppo, self.env, dict(dtype=torch.float64, device=self.device)
        T, with_entropy = self.cfg.generation.temperature, p.entropy_coef > 0
        ptx = self._ptx_batch() if p.ptx_coef > 0 else None
        if ptx is not None:
            n_ptx = ptx[1][:, 1:].sum().clamp(min=1)
            ptx_per = ptx[0].shape[0] // (env.world_size * len(x.parts))

        def forward(rows: slice):
            if x.first.get("logprobs") is not None:  # the scoring pass's forward: same rows, same parameters
                return x.first["logprobs"], x.first.get("entropy")
            with self.policy.training(), self.autocast:
                return logprobs_and_entropy(self.policy, x.seq[rows], x.attn[rows], x.P, x.response[rows], T, with_entropy=with_entropy)

        # |H - target|: its gradient's sign comes from the global minibatch mean H, which must be known
        # before the first backward; with several micro-batches, a no-grad forward measures it first
        sign = None
        if with_entropy and p.entropy_target is not None and len(x.parts) > 1:
            with torch.no_grad():
                h = sum((forward(rows)[1].float() * x.mask[rows]).sum() for rows in x.parts)
            sign = torch.sign(env.all_reduce(h) / x.n_tokens - p.entropy_target)
        tot = torch.zeros(7, **f64)  # sums of: pg loss, entropy, clipped, approx-KL, ratio, ptx loss, tokens
        ratios, norm = [], None
        for u, rows in enumerate(x.parts):
            mu = x.mask[rows]
            n_u = mu.sum()
            logprobs, entropy = forward(rows)
            pg_mean, st = POLICY_LOSSES[p.policy_loss](
                logprobs.float(), x.old_logprobs[rows], x.adv[rows], mu, clip_eps=p.clip_eps, importance_sampling=p.importance_sampling,
                ref_logprobs=x.ref_logprobs[rows], apa_lambda=p.apa_lambda, awr_beta=p.awr_beta, awr_max_weight=p.awr_max_weight,
            )
            ent_sum = (entropy.float() * mu).sum() if with_entropy else torch.zeros((), device=self.device)
            ptx_sum = torch.zeros((), device=self.device)
            if ptx is not None:
                k0 = (env.rank * len(x.parts) + u) * ptx_per
                ids, pm = ptx[0][k0 : k0 + ptx_per], ptx[1][k0 : k0 + ptx_per]
                with self.policy.training(), self.autocast:
                    ptx_sum = lm_loss(self.policy, ids, pm) * pm[:, 1:].sum()
            ratio, log_ratio = st["ratio"], st["log_ratio"]
            ratios.append((ratio, mu))
            glob = env.all_reduce(torch.stack([
                (pg_mean * n_u).detach(), ent_sum.detach(), st["clipfrac"].to(self.device) * n_u,
                0.5 * (log_ratio**2 * mu).sum(), (ratio * mu).sum(), ptx_sum.detach(), n_u,
            ]).to(torch.float64))
            tot += glob
            if not torch.isfinite(glob[[0, 1, 5]]).all():
                raise NonFiniteLoss(f"policy loss is non-finite (pg_loss sum {glob[0].item()}, ptx sum {glob[5].item()}); the run diverged")
            loss = pg_mean * n_u / x.n_tokens
            if with_entropy:
                if p.entropy_target is None:
                    loss = loss - p.entropy_coef * ent_sum / x.n_tokens
                else:
                    if sign is None:  # one micro-batch per rank: this forward saw the whole minibatch
                        sign = torch.sign(glob[1] / x.n_tokens - p.entropy_target)
                    loss = loss + p.entropy_coef * sign.float() * ent_sum / x.n_tokens
            if ptx is not None:
                loss = loss + p.ptx_coef * ptx_sum / n_ptx
            norm = self.policy.backward(loss)
        n = tot[6].clamp(min=1)
        r_mean = tot[4] / n
        r_var = env.all_reduce(sum(((r.double() - r_mean) ** 2 * mu).sum() for r, mu in ratios))
        add(keys.GRAD_NORM_POLICY, norm)
        add(keys.PG_LOSS, tot[0] / n)
        add(keys.ENTROPY_LOSS, entropy_term((tot[1] / n).float(), p.entropy_coef, p.entropy_target) if with_entropy else 0.0)
        if ptx is not None:
            add(keys.PTX_LOSS, tot[5] / n_ptx)
        add(keys.POLICY_CLIPFRAC, tot[2] / n)
        add(keys.APPROX_KL, tot[3] / n)
        add(keys.RATIO_MEAN, r_mean)
        add(keys.RATIO_STD, (r_var / n).sqrt())
        add(keys.RATIO_MAX, env.all_reduce(torch.stack([(r * mu).max() for r, mu in ratios]).max(), "max"))

    def critic_step(self, x: Minibatch, add) -> None:
        """One optimizer step of the critic on a minibatch (token-weighted like `policy_step`)."""
        tot, norm = torch.zeros(2, dtype=torch.float64, device=self.device), None
        for rows in x.parts:
            mu = x.mask[rows]
            n_u = mu.sum()
            if "values" in x.first:
                v = x.first["values"]
            else:
                with self.critic.training(), self.autocast:
                    v = critic_values(self.critic, x.seq[rows], x.attn[rows], x.P).float()
            vf_mean, vf_clipfrac = value_loss(v, x.old_values[rows], x.returns[rows], mu, self.cfg.ppo.value_clip)
            glob = self.env.all_reduce(torch.stack([(vf_mean * n_u).detach(), vf_clipfrac.to(self.device) * n_u]).to(torch.float64))
            tot += glob
            if not torch.isfinite(glob[0]):
                raise NonFiniteLoss(f"value loss is {glob[0].item()}; the run diverged")
            norm = self.critic.backward(vf_mean * n_u / x.n_tokens)
        add(keys.GRAD_NORM_CRITIC, norm)
        add(keys.VF_LOSS, tot[0] / x.n_tokens)
        add(keys.VF_CLIPFRAC, tot[1] / x.n_tokens)

    # ------------------------------------------------------------------ one step
    def rollout_metrics(self, b: Batch) -> dict[str, float]:
        ro, mask = b.rollout, b.rollout.response_mask.float()
        lengths = ro.lengths.float()
        n_tok = mask.sum(1).clamp(min=1)
        kl_sample = b.kl.sum(1) / n_tok
        k3 = (torch.expm1(b.ref_logprobs - b.old_logprobs) - (b.ref_logprobs - b.old_logprobs)) * mask
        ppl, ppl_tokens = perplexity(b.old_logprobs, mask)
        out = {
            keys.RM_SCORE: b.scores.mean().item(),
            keys.RM_SCORE_STD: b.scores.std().item() if len(b.scores) > 1 else 0.0,
            keys.KL: kl_sample.mean().item(),
            keys.KL_K3: (k3.sum(1) / n_tok).mean().item(),
            keys.KL_COEF: self.kl_ctl.value,
            keys.ENTROPY: masked_mean(b.entropy.float(), mask).item(),
            keys.PPL: ppl,
            keys.PPL_TOKENS: ppl_tokens,
            keys.PPL_REF: perplexity(b.ref_logprobs, mask)[0],
            keys.NON_SCORE_REWARD: b.non_score_rewards.sum(1).mean().item(),
            keys.SCORE_PROCESSED: b.processed_scores.mean().item(),
            keys.LENGTH: lengths.mean().item(),
            keys.LENGTH_MAX: lengths.max().item(),
            keys.FRAC_AT_CAP: (lengths >= self.cfg.generation.max_new_tokens).float().mean().item(),
            keys.VALUES: masked_mean(b.old_values, mask).item(),
            keys.RETURNS: masked_mean(b.returns, mask).item(),
            keys.RETURNS_STD: masked_mean((b.returns - masked_mean(b.returns, mask)) ** 2, mask).sqrt().item(),
            keys.ADV_RAW_STD: masked_mean((b.advantages - masked_mean(b.advantages, mask)) ** 2, mask).sqrt().item(),
            keys.REWARD_RUNNING_MEAN: self.reward_stats.mean,
            keys.REWARD_RUNNING_STD: self.reward_stats.std,
            keys.LR_POLICY: self.policy.lr,
            keys.LR_CRITIC: self.critic.lr,
        }
        if b.gold is not None:
            out[keys.GOLD_SCORE] = b.gold.mean().item()
            out[keys.GOLD_SCORE_STD] = b.gold.std().item() if len(b.gold) > 1 else 0.0
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
        b = self.make_batch({})
        return self.update(b, train_policy=False)

    def seed_reward_stats(self) -> None:
        for _ in range(self.cfg.reward.running_stats_init):
            b = self.make_batch({})
            del b

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> tuple[dict[str, float], dict]:
        """Held-out prompts: RM and gold scores of the policy, and win rate against the SFT model
        (both sample with the same keys, so a prompt's noise is the same for both)."""
        if not self.eval_tokens:
            return {}, {}
        bs = self.cfg.ppo.rollout_batch_size

        def run(model) -> dict:
            out: dict[str, list] = {"rm": [], "gold": [], "length": [], "responses": []}
            for s in range(0, len(self.eval_tokens), bs):
                lists = self.eval_tokens[s : s + bs]
                ro = self.generate(model, lists, STREAM_EVAL, s)
                scores, ro = self.gather(self.score(ro), len(lists)), self.gather_rollout(ro, len(lists))
                prompts, responses = self.decode(ro)
                gold = self.gold(ro, prompts, responses)
                out["rm"] += scores.tolist()
                out["gold"] += [] if gold is None else gold.tolist()
                out["length"] += ro.lengths.tolist()
                out["responses"] += responses
            return out

        if self.sft_eval is None:
            self.sft_eval = run(self.reference)
        return eval_summary(run(self.m.policy), self.sft_eval)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """Single-process checkpoint format, gathered from every rank (call on all ranks)."""
        pw, po = self.policy.full_state()
        cw, co = self.critic.full_state()
        return {
            "policy": pw, "critic": cw, "policy_opt": po, "critic_opt": co,
            "policy_sched": self.policy.sched.state_dict(), "critic_sched": self.critic.sched.state_dict(),
            "reward_stats": self.reward_stats.state_dict(), "kl_coef": self.kl_ctl.value,
            "data_gen": self.data_gen.get_state(), "prompt_order": torch.tensor(self.prompt_order, dtype=torch.long),
            "rollout_counter": self.rollout_counter, "world_size": self.env.world_size,
        }

    def load_state_dict(self, s: dict) -> None:
        self.policy.load_full_state(s["policy"], s["policy_opt"])
        self.critic.load_full_state(s["critic"], s["critic_opt"])
        self.policy.sched.load_state_dict(s["policy_sched"])
        self.critic.sched.load_state_dict(s["critic_sched"])
        self.reward_stats.load_state_dict(s["reward_stats"])
        self.kl_ctl.value = float(s["kl_coef"])
        self.data_gen.set_state(s["data_gen"])
        self.prompt_order = s["prompt_order"].tolist()
        self.rollout_counter = int(s["rollout_counter"])
