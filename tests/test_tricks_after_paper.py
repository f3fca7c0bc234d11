"""The tricks after the paper (docs/PAPER.md, "tricks after the paper"), each formula against numbers
worked by hand; each flag's default leaving today's loss untouched; bad combinations refused before
any run, naming field, value and what is allowed; and a few tiny end-to-end runs, flags combined."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from harness import keys, tracking
from harness.algorithms import compute_gae
from harness.algorithms.estimators import group_mean_batch_std, informative_groups
from harness.algorithms.losses import (
    POLICY_LOSSES,
    cispo_loss,
    clip_bounds,
    clip_cov_loss,
    dual_clip,
    gspo_loss,
    kl_cov_loss,
    logp_adv_cov,
    ppo_loss,
)
from harness.algorithms.rewards import overlong_penalty
from harness.config import HASH_NEUTRAL_AT_DEFAULT, ConfigError, config_hash, load_config
from harness.train import train

from helpers import fast_overrides

T = torch.tensor


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol)


def logs(ratios):
    """(logprobs, old_logprobs) of one row whose token ratios are `ratios`, logprobs requiring grad."""
    old = torch.full((1, len(ratios)), -1.0, dtype=torch.float64)
    new = (old + torch.log(T([ratios], dtype=torch.float64))).requires_grad_()
    return new, old


# ---------------------------------------------------------------- clip-higher (DAPO)
def test_clip_higher_widens_only_the_upper_side():
    assert clip_bounds(0.2, None) == (0.8, 1.2) and clip_bounds(0.2, 0.28) == (0.8, 1.28)
    new, old = logs([1.1, 1.25, 1.4])
    A = torch.ones(1, 3, dtype=torch.float64)
    sym, st_sym = ppo_loss(new, old, A, clip_eps=0.2)
    high, st = ppo_loss(new, old, A, clip_eps=0.2, clip_eps_high=0.28)
    assert close(sym, [[-1.1, -1.2, -1.2]]) and close(high, [[-1.1, -1.25, -1.28]])
    assert st["clipped"].tolist() == [[0, 0, 1]] and st[keys.POLICY_CLIPFRAC_HIGH].tolist() == [[0, 0, 1]]
    assert keys.POLICY_CLIPFRAC_HIGH not in st_sym  # the default logs nothing new
    # the lower side is PPO's: ratio 0.7 with A = -1 is clipped at 0.8 -> loss 0.8, not counted as "high"
    new, old = logs([0.7])
    loss, st = ppo_loss(new, old, -torch.ones(1, 1, dtype=torch.float64), clip_eps=0.2, clip_eps_high=0.28)
    assert close(loss, [[0.8]]) and st["clipped"].item() == 1 and st[keys.POLICY_CLIPFRAC_HIGH].item() == 0


def test_defaults_leave_the_ppo_loss_as_it_was():
    """clip_eps_high=None and dual_clip_c=None: exactly -min(rA, clamp(r, 1-eps, 1+eps)A), no new stats."""
    g = torch.Generator().manual_seed(0)
    new, old, A = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    loss, st = ppo_loss(new, old, A, clip_eps=0.2, clip_eps_high=None, dual_clip_c=None)
    r = torch.exp(new - old)
    assert torch.equal(loss, -torch.min(r * A, torch.clamp(r, 0.8, 1.2) * A))
    assert set(st) == {"clipped", "ratio", "log_ratio"}


# ---------------------------------------------------------------- dual-clip (Ye et al. 2020)
def test_dual_clip_caps_negative_advantages_at_c():
    new, old = logs([5.0, 2.0, 5.0])
    A = T([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    plain, _ = ppo_loss(new, old, A, clip_eps=0.2)
    # A < 0: -min(rA, clip(r)A) = r -> 5 and 2; A > 0: -min(5, 1.2) = -1.2
    assert close(plain, [[5.0, 2.0, -1.2]])
    loss, st = ppo_loss(new, old, A, clip_eps=0.2, dual_clip_c=3.0)
    assert close(loss, [[3.0, 2.0, -1.2]]) and st[keys.POLICY_DUAL_CLIPFRAC].tolist() == [[1, 0, 0]]
    loss.sum().backward()
    assert new.grad[0, 0].item() == 0  # the capped token no longer pushes
    capped, hit = dual_clip(T([[4.0, 1.0]]), T([[-1.0, -1.0]]), 3.0)
    assert capped.tolist() == [[3.0, 1.0]] and hit.tolist() == [[1.0, 0.0]]


# ---------------------------------------------------------------- GSPO (Zheng et al. 2025)
def test_gspo_sequence_ratio_is_the_geometric_mean_and_clips_whole_responses():
    new, old = logs([1.2, 0.9])
    mask, A = torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    s = math.sqrt(1.2 * 0.9)  # exp(mean log ratio)
    loss, st = gspo_loss(new, old, A, mask=mask, clip_eps=0.2)
    assert close(loss, [[-s, -s]]) and close(st["ratio"], [[s, s]]) and st["clipped"].sum() == 0
    # per-response mean of the token losses: gradient of -s*A w.r.t. each log pi = -s*A/|y|
    loss.mean().backward()
    assert close(new.grad, [[-s / 2, -s / 2]])
    # a narrow clip (GSPO's own ranges are ~3e-4) cuts the whole response at 1 + eps_high
    new2, old2 = logs([1.2, 0.9])
    loss, st = gspo_loss(new2, old2, A, mask=mask, clip_eps=0.01, clip_eps_high=0.02)
    assert close(loss, [[-1.02, -1.02]]) and st["clipped"].tolist() == [[1, 1]]
    # padding does not count: a row with one real token has that token's ratio
    new3, old3 = logs([1.5, 3.0])
    _, st = gspo_loss(new3, old3, A, mask=T([[1.0, 0.0]], dtype=torch.float64), clip_eps=0.2)
    assert close(st["ratio"][0, 0], 1.5)


# ---------------------------------------------------------------- CISPO (MiniMax-M1 2025)
def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    new, old = logs([0.5, 1.0, 2.0])
    A = torch.ones(1, 3, dtype=torch.float64)
    loss, st = cispo_loss(new, old, A, clip_eps=0.2, clip_eps_high=0.28)
    # weights clip(r, 0.8, 1.28) = 0.8, 1, 1.28 (stop-gradient): d loss / d log pi = -w * A
    loss.sum().backward()
    assert close(new.grad, [[-0.8, -1.0, -1.28]]) and st["clipped"].tolist() == [[1, 0, 1]]
    assert close(loss, -torch.tensor([[0.8, 1.0, 1.28]], dtype=torch.float64) * new.detach())
    # PPO's clip gives the third token (r = 2 > 1.2, A > 0) no gradient at all
    new_p, old_p = logs([0.5, 1.0, 2.0])
    ppo_loss(new_p, old_p, A, clip_eps=0.2)[0].sum().backward()
    assert new_p.grad[0, 2].item() == 0


# ---------------------------------------------------------------- LitePPO's normalization (Tricks or Traps 2025)
def test_group_mean_batch_std_by_hand():
    adv = T([[1.0], [3.0], [5.0], [5.0]], dtype=torch.float64)
    out = group_mean_batch_std(adv, torch.ones_like(adv), T([0, 0, 1, 1]))
    # group means 2, 2, 5, 5; batch std (ddof 1) of 1, 3, 5, 5 = sqrt(11/3); GRPO's group std would give +-0.707
    sd = math.sqrt(11 / 3)
    assert close(out, [[-1 / sd], [1 / sd], [0.0], [0.0]])
    # per-token advantages: the row's mean enters the group mean; padding stays 0
    adv = T([[1.0, 3.0], [4.0, 0.0]], dtype=torch.float64)
    mask = T([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    out = group_mean_batch_std(adv, mask, T([0, 0]))
    sd = math.sqrt(2.0)  # row means 2 and 4: group mean 3, std sqrt(2)
    assert close(out, [[-2 / sd, 0.0], [1 / sd, 0.0]])


def test_dynamic_sampling_keeps_groups_whose_scores_differ():
    scores, group = T([1.0, 1.0, 0.0, 1.0, 0.5, 0.7]), T([3, 3, 5, 5, 8, 8])
    # ranges 0, 1, 0.2: tol 0 drops only the all-alike group; tol 0.5 also the one within 0.2
    assert informative_groups(scores, group, 0.0).tolist() == [False, False, True, True, True, True]
    assert informative_groups(scores, group, 0.5).tolist() == [False, False, True, True, False, False]


# ---------------------------------------------------------------- Clip-Cov and KL-Cov (Cui et al. 2025)
def test_logp_adv_covariance_by_hand():
    cov = logp_adv_cov(T([[-1.0, -2.0, -4.0]]), T([[1.0, 0.0, -1.0]]), torch.ones(1, 3))
    # log pi - mean = 4/3, -1/3, -5/3; A - mean = 1, 0, -1
    assert close(cov, [[4 / 3, 0.0, 5 / 3]])


def test_clip_cov_cuts_one_token_in_the_band():
    lp = T([[-1.0, -2.0, -4.0]], dtype=torch.float64, requires_grad=True)
    A, mask = T([[1.0, 0.0, -1.0]], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    kw = dict(mask=mask, clip_eps=0.2, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0)
    loss, st = clip_cov_loss(lp, lp.detach(), A, generator=torch.Generator().manual_seed(0), **kw)
    # ratio 1 everywhere: PPO loss -A = -1, 0, 1; tokens 0 and 2 lie in (1, 5); max(int(3 * 2e-4), 1) = 1 is cut
    sel = st["clipped"][0].tolist()
    assert sum(sel) == 1 and sel[1] == 0 and close(st[keys.POLICY_LOGP_ADV_COV], [[4 / 3, 0.0, 5 / 3]])
    keep = [0 if s else v for s, v in zip(sel, [-1.0, 0.0, 1.0])]
    assert close(loss, [keep])
    loss.sum().backward()
    assert lp.grad[0, sel.index(1)].item() == 0
    # outside the band nothing is cut
    _, st = clip_cov_loss(lp, lp.detach(), A, **{**kw, "clip_cov_lb": 2.0})
    assert st["clipped"].sum() == 0


def test_kl_cov_penalizes_the_top_covariance_token():
    lp = T([[-1.0, -2.0, -4.0]], dtype=torch.float64)
    d = T([[0.1, 0.0, -0.2]], dtype=torch.float64)
    A, mask = T([[1.0, 0.0, -1.0]], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    loss, st = kl_cov_loss(lp, lp - d, A, mask=mask, kl_cov_ratio=0.002, kl_cov_coef=1.0)
    # unclipped -rA; token 2 has the largest covariance (5/3): + 1 * |log r| = 0.2
    assert st["clipped"].tolist() == [[0, 0, 1]]
    assert close(loss, [[-math.exp(0.1), 0.0, math.exp(-0.2) + 0.2]])


# ---------------------------------------------------------------- decoupled GAE (VAPO) and overlong (DAPO)
def test_decoupled_gae_critic_targets_with_lambda_one_are_monte_carlo():
    r, v, m = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.4, 0.3]]), torch.ones(1, 3)
    adv, _ = compute_gae(r, v, m, 1.0, 0.9)
    _, ret = compute_gae(r, v, m, 1.0, 1.0)
    assert close(adv, [[0.377, 0.53, 0.7]], tol=1e-4) and close(ret, [[1.0, 1.0, 1.0]])


def test_overlong_penalty_by_hand():
    # cap 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at the cap
    assert close(overlong_penalty(T([5, 6, 7, 9, 10]), 10, 4), [0.0, 0.0, -0.25, -0.75, -1.0])
    assert close(overlong_penalty(T([8, 10]), 10, 4, factor=0.5), [-0.25, -0.5])


# ---------------------------------------------------------------- bad input
def problems(overrides):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    return "\n".join(e.value.problems)


@pytest.mark.parametrize("overrides, expected", [
    (["ppo.clip_eps_high=0.1"], "ppo.clip_eps_high: got 0.1 with ppo.clip_eps=0.2; allowed: null or a number >= ppo.clip_eps=0.2"),
    (["ppo.clip_eps_high=0.3", "ppo.clip_eps=null"], "ppo.clip_eps_high: got 0.3 with ppo.clip_eps=null; allowed: null"),
    (["ppo.clip_eps_high=0.3", "ppo.policy_loss=apa"], "ppo.clip_eps_high: got 0.3 with ppo.policy_loss=apa; allowed: null"),
    (["ppo.dual_clip_c=1"], "ppo.dual_clip_c: got 1; allowed: a number > 1"),
    (["ppo.dual_clip_c=0.5"], "ppo.dual_clip_c: got 0.5; allowed: a number > 1"),
    (["ppo.dual_clip_c=3", "ppo.policy_loss=cispo"], "ppo.dual_clip_c: got 3.0 with ppo.policy_loss=cispo"),
    (["ppo.dual_clip_c=3", "ppo.importance_sampling=off"], "ppo.dual_clip_c: got 3.0 with ppo.policy_loss=ppo, ppo.importance_sampling=off; allowed: null"),
    (["ppo.policy_loss=gspo"], "ppo.loss_aggregation: got 'token_mean' with ppo.policy_loss=gspo; allowed: 'seq_mean_token_mean'"),
    (["ppo.policy_loss=gspo", "ppo.loss_aggregation=seq_mean_token_mean", "ppo.clip_eps=null"],
     "ppo.clip_eps: got null with ppo.policy_loss=gspo; allowed: a number > 0 and <= 1"),
    (["ppo.policy_loss=cispo", "ppo.importance_sampling=reference"],
     "ppo.importance_sampling: got 'reference' with ppo.policy_loss=cispo; allowed: 'rollout'"),
    (["ppo.adv_normalize_mode=group_mean_batch_std"],
     "ppo.adv_normalize_mode: got 'group_mean_batch_std' with generation.samples_per_prompt=1; allowed: 'minibatch'"),
    (["ppo.adv_normalize_mode=group_mean_batch_std", "ppo.adv_normalize=false", "generation.samples_per_prompt=2"],
     "ppo.adv_normalize_mode: got 'group_mean_batch_std' with ppo.adv_normalize=false; allowed: 'minibatch'"),
    (["ppo.adv_normalize_mode=batch"], "ppo.adv_normalize_mode: got 'batch'; allowed: one of 'minibatch', 'group_mean_batch_std'"),
    (["ppo.critic_gae_lambda=1", "ppo.adv_estimator=rloo", "generation.samples_per_prompt=2"],
     "ppo.critic_gae_lambda: got 1.0 with ppo.adv_estimator=rloo; allowed: null"),
    (["ppo.clip_cov_lb=5"], "ppo.clip_cov_lb: got 5.0 with ppo.clip_cov_ub=5.0; allowed: a number below ppo.clip_cov_ub"),
    (["ppo.dynamic_sampling_tol=0"], "ppo.dynamic_sampling_tol: got 0.0 with ppo.adv_estimator=gae; allowed: null"),
    (["reward.overlong_buffer=30"], "reward.overlong_buffer: got 30 with generation.max_new_tokens=24; allowed: 0 to 24"),
])
def test_bad_combinations_are_refused_before_any_run(overrides, expected):
    assert f"--set: {expected}" in problems(overrides)


def test_cispo_may_have_no_lower_bound_and_a_narrow_upper_one():
    cfg = load_config(None, ["ppo.policy_loss=cispo", "ppo.clip_eps=1", "ppo.clip_eps_high=0.28"])
    assert (cfg.ppo.clip_eps, cfg.ppo.clip_eps_high) == (1.0, 0.28)


def test_the_new_fields_at_their_defaults_keep_every_stored_config_hash():
    """Stored runs (a grid's, the design study's) are found by config hash: the bases' hashes as of
    3c21fa3, before the tricks after the paper existed. A field added later with a default that computes
    what runs did before belongs in HASH_NEUTRAL_AT_DEFAULT; set, it changes the hash."""
    bases = Path(__file__).resolve().parents[1] / "ablations" / "bases"
    assert config_hash(load_config(bases / "ppo_max.yaml")) == "d787e26e3f1a9697"
    assert config_hash(load_config(bases / "vanilla.yaml")) == "6cacd6608dce243d"
    changed = {config_hash(load_config(bases / "ppo_max.yaml", [f"{k}={v}"])) for k, v in [
        ("ppo.clip_eps_high", 0.28), ("ppo.dual_clip_c", 3), ("reward.overlong_buffer", 4), ("ppo.kl_cov_coef", 0.5)]}
    assert len(changed) == 4 and "d787e26e3f1a9697" not in changed
    assert len(HASH_NEUTRAL_AT_DEFAULT) == len(set(HASH_NEUTRAL_AT_DEFAULT))


def test_every_new_loss_is_registered():
    assert {"gspo", "cispo", "clip_cov", "kl_cov"} <= set(POLICY_LOSSES)


# ---------------------------------------------------------------- end to end on the tiny world
E2E = {"ppo.steps": 2, "logging.eval_every": 0, "logging.checkpoint_every": 0, "logging.sample_every": 0}
GROUPS = {"generation.samples_per_prompt": 4}


@pytest.mark.parametrize("name, flags, logged", [
    ("ppo_flags", {"ppo.clip_eps_high": 0.28, "ppo.dual_clip_c": 3.0, "ppo.critic_gae_lambda": 1.0,
                   "ppo.critic_pretrain_steps": 1, "reward.overlong_buffer": 4},
     [keys.POLICY_CLIPFRAC_HIGH, keys.POLICY_DUAL_CLIPFRAC, keys.OVERLONG_PENALTY]),
    ("gspo_liteppo", {**GROUPS, "ppo.adv_estimator": "dr_grpo", "ppo.policy_loss": "gspo",
                      "ppo.loss_aggregation": "seq_mean_token_mean", "ppo.clip_eps": 0.0003, "ppo.clip_eps_high": 0.0004,
                      "ppo.adv_normalize_mode": "group_mean_batch_std", "ppo.dynamic_sampling_tol": 0.0},
     [keys.GROUPS_KEPT_FRAC]),
    ("cispo", {**GROUPS, "ppo.adv_estimator": "grpo", "ppo.policy_loss": "cispo", "ppo.clip_eps": 1.0,
               "ppo.clip_eps_high": 0.28}, []),  # no lower bound, the upper range narrower: allowed for CISPO's weights
    ("clip_cov", {"ppo.policy_loss": "clip_cov", "ppo.clip_cov_lb": -100.0}, [keys.POLICY_LOGP_ADV_COV]),
    ("kl_cov", {"ppo.policy_loss": "kl_cov", "ppo.ppo_epochs": 2}, [keys.POLICY_LOGP_ADV_COV]),
])
def test_each_trick_trains_on_the_tiny_world(tiny_world, tmp_path, name, flags, logged):
    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **E2E, **flags))
    res = train(cfg)
    assert res.status == "FINISHED" and res.steps_done == 2, res.error
    m = tracking.client(cfg.logging.tracking_uri).get_run(res.run_id).data.metrics
    assert all(math.isfinite(v) for v in m.values())
    assert [k for k in logged if k not in m] == []
    assert [k for k in keys.TRICK_METRICS if k in m and k not in logged] == []  # nothing logged for an unused trick
    if keys.POLICY_LOGP_ADV_COV in logged:  # at least one token per micro-batch is cut or penalized
        assert m[keys.POLICY_CLIPFRAC] > 0


def test_dynamic_sampling_with_no_informative_group_keeps_the_batch(tiny_world, tmp_path):
    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **{
        **E2E, **GROUPS, "ppo.steps": 1, "ppo.adv_estimator": "grpo", "ppo.dynamic_sampling_tol": 1e9}))
    res = train(cfg)
    assert res.status == "FINISHED", res.error
    m = tracking.client(cfg.logging.tracking_uri).get_run(res.run_id).data.metrics
    assert m[keys.GROUPS_KEPT_FRAC] == 0 and keys.PG_LOSS in m  # none differs by 1e9: updated on the whole batch
