"""The PPO step, top to bottom: rollout -> scores -> per-token rewards -> GAE -> PPO epochs.

Every trick is a flag in `harness.config`; every formula is a pure function in
`harness.algorithms`. This module only orchestrates, so the loop reads in one place.
"""
from __future__ import annotations

import contextlib
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
from .rollout import Rollout, critic_values, fuse_activations, left_pad, lm_loss, logprobs_and_entropy, position_ids, sample


class NonFiniteLoss(RuntimeError):
    """A loss or gradient went NaN/inf; the run ends FAILED with this message."""


@dataclass
class Batch:
    """A scored rollout with everything the update needs, all [B, R] unless noted."""

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
    """Scoring-pass outputs that still hold their autograd graph ("logprobs", "entropy", "values"), reused by
    the update's first epoch when it has one minibatch (same inputs, parameters not yet stepped)."""


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
    def __init__(self, cfg: TrainConfig, models: Models, source: PromptSource, device: torch.device):
        self.cfg, self.m, self.source, self.device = cfg, models, source, device
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
        p = cfg.ppo
        # fused AdamW: one kernel per parameter instead of ~10 elementwise ops (same update, ~3x cheaper on CPU)
        fused = device.type in ("cpu", "cuda")
        self.policy_opt = torch.optim.AdamW(models.policy.parameters(), lr=p.policy_lr, weight_decay=p.weight_decay, fused=fused)
        self.critic_opt = torch.optim.AdamW(models.critic.parameters(), lr=p.critic_lr, weight_decay=p.weight_decay, fused=fused)
        total_updates = max(1, p.steps * p.ppo_epochs * p.num_minibatches)
        self.policy_sched = torch.optim.lr_scheduler.LambdaLR(self.policy_opt, lr_lambda(cfg, total_updates))
        self.critic_sched = torch.optim.lr_scheduler.LambdaLR(self.critic_opt, lr_lambda(cfg, total_updates))
        self.reward_stats = RunningMeanStd()
        self.kl_ctl = (
            AdaptiveKLController(p.kl_coef, p.kl_target, p.kl_horizon)
            if p.kl_controller == "adaptive" else FixedKLController(p.kl_coef)
        )
        self.sample_gen = torch.Generator(device=device).manual_seed(cfg.seed)
        self.data_gen = torch.Generator().manual_seed(cfg.seed)
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
    def generate(self, model, token_lists: list[list[int]], generator: torch.Generator, with_entropy: bool = False) -> Rollout:
        g = self.cfg.generation
        ids, mask = left_pad(token_lists, self.pad_id, self.device)
        with self.autocast:
            return sample(
                model, ids, mask, max_new_tokens=g.max_new_tokens, eos_id=self.eos_id, pad_id=self.pad_id,
                temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, stop_at_eos=g.stop_at_eos, generator=generator,
                with_entropy=with_entropy,
            )

    def decode(self, ro: Rollout) -> tuple[list[str], list[str]]:
        prompts = [self.tok.decode(ids[m.bool()].tolist(), skip_special_tokens=True) for ids, m in zip(ro.prompt_ids, ro.prompt_mask)]
        responses = [
            self.tok.decode([t for t in ids[m.bool()].tolist() if t != self.eos_id], skip_special_tokens=True)
            for ids, m in zip(ro.response_ids, ro.response_mask)
        ]
        return prompts, responses

    @torch.no_grad()
    def score(self, ro: Rollout) -> tuple[torch.Tensor, torch.Tensor, list[str], list[str]]:
        """Raw RM scores and gold scores (NaN-free tensor, or empty when the source has none)."""
        seq, attn = ro.sequences, ro.attention_mask
        with self.autocast:
            scores = self.m.reward.score_last(seq, attn, position_ids(attn)).float()
        prompts, responses = self.decode(ro)
        gold = torch.empty(0)
        if self.source.gold is not None:
            gold = torch.tensor(self.source.gold(prompts, responses, ro.ended.tolist()), dtype=torch.float32)
        return scores, gold, prompts, responses

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
        idx = self.next_prompts(p.rollout_batch_size)
        ro = self.generate(self.m.policy, [self.prompt_tokens[i] for i in idx], self.sample_gen, with_entropy=p.reuse_rollout_logprobs)
        t1 = time.perf_counter()
        P = ro.prompt_ids.shape[1]
        seq, attn, mask = ro.sequences, ro.attention_mask, ro.response_mask.float()
        # With one minibatch, the update's first epoch runs the policy and critic on exactly these sequences
        # with the same parameters: keep the graphs of these forwards and let it backprop through them.
        keep = p.num_minibatches == 1
        first: dict = {}
        with self.autocast:
            if p.reuse_rollout_logprobs:  # old log-probs and entropy from the sampling pass: no policy forward here
                logprobs, entropy = ro.sample_logprobs, ro.sample_entropy
            else:
                with torch.set_grad_enabled(keep):
                    logprobs, entropy = logprobs_and_entropy(self.m.policy, seq, attn, P, ro.response_ids, cfg.generation.temperature)
                if keep:
                    first["logprobs"], first["entropy"] = logprobs, (entropy if p.entropy_coef > 0 else None)
                    logprobs, entropy = logprobs.detach(), entropy.detach()
            ref_logprobs, _ = logprobs_and_entropy(self.m.reference, seq, attn, P, ro.response_ids, cfg.generation.temperature, with_entropy=False)
            with torch.set_grad_enabled(keep):
                values = critic_values(self.m.critic, seq, attn, P).float()
            if keep:
                first["values"], values = values, values.detach()
        logprobs, ref_logprobs = logprobs.float() * mask, ref_logprobs.float() * mask
        values = values * mask
        scores, gold, prompts, responses = self.score(ro)
        t2 = time.perf_counter()
        processed, kl, rewards, non_score, advantages, returns = self.advantages(scores, logprobs, ref_logprobs, values, mask)
        t3 = time.perf_counter()
        timers[keys.TIME_ROLLOUT] = t1 - t0
        timers[keys.TIME_SCORE] = t2 - t1
        timers[keys.TIME_ADVANTAGE] = t3 - t2
        return Batch(ro, logprobs, ref_logprobs, values, entropy, scores, processed, gold if gold.numel() else None,
                     rewards, non_score, kl, advantages, returns, prompts, responses, first or None)

    # ------------------------------------------------------------------ update
    def _clip_and_step(self, model, opt, sched) -> float:
        params = [q for q in model.parameters() if q.grad is not None]
        max_norm = self.cfg.ppo.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if not torch.isfinite(norm):
            raise NonFiniteLoss(f"gradient norm is {norm.item()} (non-finite); try a lower learning rate or ppo.max_grad_norm > 0")
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return norm.item()

    def _ptx_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
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
        """ppo_epochs passes over the batch in num_minibatches minibatches; returns mean stats."""
        cfg, p = self.cfg, self.cfg.ppo
        ro = b.rollout
        B, P = ro.response_ids.shape[0], ro.prompt_ids.shape[1]
        mb_size = B // p.num_minibatches
        seq, attn, mask = ro.sequences, ro.attention_mask, ro.response_mask.float()
        acc: dict[str, list[float]] = {}

        def add(k: str, v: float) -> None:
            acc.setdefault(k, []).append(float(v))

        loss_fn = POLICY_LOSSES[p.policy_loss]
        first, b.first_pass = (b.first_pass or {}), None  # scoring-pass graphs, for epoch 0 with one minibatch
        for epoch in range(p.ppo_epochs):
            if epoch == 1:
                first = {}  # frees the graphs
            perm = torch.randperm(B, generator=self.data_gen)
            for s in range(0, B, mb_size):
                i = perm[s : s + mb_size].to(self.device)
                m = mask[i]
                # trim right padding shared by this minibatch
                R = int(m.sum(1).max().item())
                m = m[:, :R]
                mseq, mattn = seq[i][:, : P + R], attn[i][:, : P + R]
                adv = self.minibatch_advantages(b.advantages[i][:, :R], m, add)

                if train_policy:
                    if "logprobs" in first and mb_size == B:  # the scoring pass's forward: same inputs, same parameters
                        logprobs = first["logprobs"][i][:, :R]
                        entropy = first["entropy"][i][:, :R] if first["entropy"] is not None else None
                    else:
                        with self.autocast:
                            logprobs, entropy = logprobs_and_entropy(self.m.policy, mseq, mattn, P, ro.response_ids[i][:, :R],
                                                                     cfg.generation.temperature, with_entropy=p.entropy_coef > 0)
                    logprobs = logprobs.float()
                    pg_loss, st = loss_fn(
                        logprobs, b.old_logprobs[i][:, :R], adv, m, clip_eps=p.clip_eps, importance_sampling=p.importance_sampling,
                        ref_logprobs=b.ref_logprobs[i][:, :R], apa_lambda=p.apa_lambda, awr_beta=p.awr_beta, awr_max_weight=p.awr_max_weight,
                    )
                    ent_loss = (entropy_term(masked_mean(entropy.float(), m), p.entropy_coef, p.entropy_target)
                                if p.entropy_coef > 0 else torch.zeros(()))
                    loss = pg_loss + ent_loss
                    if p.ptx_coef > 0:
                        ids, pmask = self._ptx_batch()
                        with self.autocast:
                            ptx = lm_loss(self.m.policy, ids, pmask)
                        loss = loss + p.ptx_coef * ptx
                        add(keys.PTX_LOSS, ptx.item())
                    if not torch.isfinite(loss):
                        raise NonFiniteLoss(f"policy loss is {loss.item()} (pg_loss {pg_loss.item()}); the run diverged")
                    loss.backward()
                    add(keys.GRAD_NORM_POLICY, self._clip_and_step(self.m.policy, self.policy_opt, self.policy_sched))
                    ratio, log_ratio = st["ratio"], st["log_ratio"]
                    add(keys.PG_LOSS, pg_loss.item())
                    add(keys.ENTROPY_LOSS, ent_loss.item())
                    add(keys.POLICY_CLIPFRAC, st["clipfrac"].item())
                    add(keys.APPROX_KL, (0.5 * masked_mean(log_ratio**2, m)).item())
                    add(keys.RATIO_MEAN, masked_mean(ratio, m).item())
                    add(keys.RATIO_STD, masked_mean((ratio - masked_mean(ratio, m)) ** 2, m).sqrt().item())
                    add(keys.RATIO_MAX, (ratio * m).max().item())

                if "values" in first and mb_size == B:
                    v = first["values"][i][:, :R]
                else:
                    with self.autocast:
                        v = critic_values(self.m.critic, mseq, mattn, P).float()
                vf_loss, vf_clipfrac = value_loss(v, b.old_values[i][:, :R], b.returns[i][:, :R], m, p.value_clip)
                if not torch.isfinite(vf_loss):
                    raise NonFiniteLoss(f"value loss is {vf_loss.item()}; the run diverged")
                vf_loss.backward()
                add(keys.GRAD_NORM_CRITIC, self._clip_and_step(self.m.critic, self.critic_opt, self.critic_sched))
                add(keys.VF_LOSS, vf_loss.item())
                add(keys.VF_CLIPFRAC, vf_clipfrac.item())
        return {k: sum(v) / len(v) for k, v in acc.items()}

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
            keys.LR_POLICY: self.policy_sched.get_last_lr()[0],
            keys.LR_CRITIC: self.critic_sched.get_last_lr()[0],
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
        step_s = time.perf_counter() - t0
        metrics.update(timers)
        metrics[keys.STEP_S] = step_s
        metrics[keys.TOKENS_PER_S] = b.rollout.response_mask.sum().item() / step_s
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
        """Held-out prompts: RM and gold scores of the policy, and win rate against the SFT model."""
        if not self.eval_tokens:
            return {}, {}
        bs = self.cfg.ppo.rollout_batch_size
        eval_seed = self.cfg.seed + 10_007

        def run(model) -> dict:
            gen = torch.Generator(device=self.device).manual_seed(eval_seed)
            rm, gold, lengths, texts = [], [], [], []
            for s in range(0, len(self.eval_tokens), bs):
                ro = self.generate(model, self.eval_tokens[s : s + bs], gen)
                sc, g, _, resp = self.score(ro)
                rm += sc.tolist()
                gold += g.tolist()
                lengths += ro.lengths.tolist()
                texts += resp
            return {"rm": rm, "gold": gold, "length": lengths, "responses": texts}

        if self.sft_eval is None:
            self.sft_eval = run(self.m.reference)
        return eval_summary(run(self.m.policy), self.sft_eval)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        return {
            "policy": self.m.policy.state_dict(),
            "critic": self.m.critic.state_dict(),
            "policy_opt": self.policy_opt.state_dict(),
            "critic_opt": self.critic_opt.state_dict(),
            "policy_sched": self.policy_sched.state_dict(),
            "critic_sched": self.critic_sched.state_dict(),
            "reward_stats": self.reward_stats.state_dict(),
            "kl_coef": self.kl_ctl.value,
            "sample_gen": self.sample_gen.get_state(),
            "data_gen": self.data_gen.get_state(),
            "prompt_order": torch.tensor(self.prompt_order, dtype=torch.long),
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, s: dict) -> None:
        self.m.policy.load_state_dict(s["policy"])
        self.m.critic.load_state_dict(s["critic"])
        self.policy_opt.load_state_dict(s["policy_opt"])
        self.critic_opt.load_state_dict(s["critic_opt"])
        self.policy_sched.load_state_dict(s["policy_sched"])
        self.critic_sched.load_state_dict(s["critic_sched"])
        self.reward_stats.load_state_dict(s["reward_stats"])
        self.kl_ctl.value = float(s["kl_coef"])
        self.sample_gen.set_state(s["sample_gen"])
        self.data_gen.set_state(s["data_gen"])
        self.prompt_order = s["prompt_order"].tolist()
        torch.set_rng_state(s["torch_rng"])
