"""Every trick's formula against numbers computed by hand."""
import math

import pytest
import torch

from harness.algorithms import (
    KLController,
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
from harness.algorithms.losses import apa_loss, awr_loss, ppo_loss

T = torch.tensor


def close(a, b, tol=1e-4):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


def test_gae_short_sequence_by_hand():
    # gamma=1, lambda=0.9: deltas 0.7, -0.1, -0.1 from the end; A1 = -0.1 + 0.9*0.7, A0 = -0.1 + 0.9*A1
    adv, ret = compute_gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.4, 0.3]]), T([[1.0, 1.0, 1.0]]), 1.0, 0.9)
    assert close(adv, [[0.377, 0.53, 0.7]])
    assert close(ret, [[0.877, 0.93, 1.0]])


def test_gae_stops_at_end_of_response_and_discounts():
    # response ends at t=1: value after it is 0, the padded position contributes nothing
    adv, ret = compute_gae(T([[0.0, 1.0, 5.0]]), T([[0.5, 0.4, 9.0]]), T([[1.0, 1.0, 0.0]]), 1.0, 0.9)
    assert close(adv, [[0.44, 0.6, 0.0]])
    assert close(ret, [[0.94, 1.0, 0.0]])
    # gamma=0.5, lambda=1: A1 = 1 - 0.4 = 0.6; A0 = 0 + 0.5*0.4 - 0.5 + 0.5*0.6 = 0.0
    adv, _ = compute_gae(T([[0.0, 1.0]]), T([[0.5, 0.4]]), T([[1.0, 1.0]]), 0.5, 1.0)
    assert close(adv, [[0.0, 0.6]])


def test_gae_lambda_zero_is_one_step_td():
    adv, _ = compute_gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.4, 0.3]]), T([[1.0, 1.0, 1.0]]), 1.0, 0.0)
    assert close(adv, [[-0.1, -0.1, 0.7]])


def test_running_stats_merge_matches_whole_stream():
    s = RunningMeanStd()
    s.update(T([1.0, 2.0, 3.0]))
    s.update(T([4.0, 5.0]))
    assert s.count == 5 and math.isclose(s.mean, 3.0) and math.isclose(s.var, 2.0)
    other = RunningMeanStd()
    other.merge(2.0, 2.0 / 3.0, 3)
    other.merge(4.5, 0.25, 2)
    assert math.isclose(other.mean, 3.0) and math.isclose(other.var, 2.0)


def test_reward_normalize_then_clip():
    s = RunningMeanStd()
    out = process_scores(T([1.0, 2.0, 3.0]), s, scale=False, normalize=True, clip=None)
    assert close(out, [-1.2247, 0.0, 1.2247])  # stats include the batch: mean 2, std sqrt(2/3)
    s2 = RunningMeanStd()
    out = process_scores(T([1.0, 2.0, 3.0]), s2, scale=False, normalize=True, clip=0.8)
    assert close(out, [-0.8, 0.0, 0.8])


def test_reward_scaling_alone_and_normalize_without_scale():
    s = RunningMeanStd()
    out = process_scores(T([1.0, 2.0, 3.0]), s, scale=True, normalize=False, clip=None)
    assert close(out, [1.2247, 2.4495, 3.6742])
    # normalization works with scale off (the reference code's quirk is not copied)
    s2 = RunningMeanStd()
    assert close(process_scores(T([1.0, 3.0]), s2, scale=False, normalize=True, clip=None), [-1.0, 1.0])


def test_clip_only_leaves_stats_untouched():
    s = RunningMeanStd()
    assert close(process_scores(T([-5.0, 0.3, 5.0]), s, scale=False, normalize=False, clip=1.0), [-1.0, 0.3, 1.0])
    assert s.count == 0


def test_masked_whiten_ignores_padding():
    out = masked_whiten(T([1.0, 2.0, 3.0, 100.0]), T([1.0, 1.0, 1.0, 0.0]))
    assert close(out, [-1.0, 0.0, 1.0, 0.0])
    assert close(masked_mean(T([1.0, 2.0, 100.0]), T([1.0, 1.0, 0.0])), 1.5)


def test_perplexity_per_sample_and_token_pooled():
    # sample 0: 3 tokens, NLL 1 each; sample 1: 1 token with NLL 4 (an outlier), 2 padded positions
    lp = T([[-1.0, -1.0, -1.0], [-4.0, -9.0, -9.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    per_sample, pooled = perplexity(lp, mask)
    assert math.isclose(per_sample, (math.e + math.e ** 4) / 2, rel_tol=1e-5)
    assert math.isclose(pooled, math.exp((3 + 4) / 4), rel_tol=1e-5)  # the outlier weighs 1 token of 4
    assert pooled < per_sample / 4


def test_kl_estimators():
    lp, ref = T([-1.0]), T([-1.5])  # log pi/ref = 0.5
    assert close(kl_per_token(lp, ref, "k1"), [0.5])
    assert close(kl_per_token(lp, ref, "k2"), [0.125])
    assert close(kl_per_token(lp, ref, "k3"), [math.exp(-0.5) - 1 + 0.5])


def test_token_level_kl_reward():
    kl = T([[0.5, -1.0, 0.0]])
    mask = T([[1.0, 1.0, 0.0]])
    rewards, non_score = token_rewards(T([2.0]), kl, mask, kl_coef=0.1)
    assert close(rewards, [[-0.05, 2.1, 0.0]])  # score lands on the last real token
    assert close(non_score, [[-0.05, 0.1, 0.0]])


def test_ppo_clipped_surrogate():
    m = T([[1.0]])
    loss, st = ppo_loss(T([[math.log(1.5)]]), T([[0.0]]), T([[1.0]]), clip_eps=0.2)
    assert close(masked_mean(loss, m), -1.2) and close(masked_mean(st["clipped"], m), 1.0)
    loss, st = ppo_loss(T([[math.log(1.5)]]), T([[0.0]]), T([[-1.0]]), clip_eps=0.2)
    assert close(masked_mean(loss, m), 1.5) and close(masked_mean(st["clipped"], m), 0.0)
    loss, _ = ppo_loss(T([[math.log(1.5)]]), T([[0.0]]), T([[1.0]]), clip_eps=None)
    assert close(masked_mean(loss, m), -1.5)


def test_ppo_without_importance_sampling_is_plain_policy_gradient():
    logp = torch.tensor([[-2.0]], requires_grad=True)
    loss, _ = ppo_loss(logp, T([[-5.0]]), T([[3.0]]), clip_eps=0.2, importance_sampling="off")
    assert close(loss, [[6.0]])  # -A * log pi, no ratio against the stale -5.0
    loss.sum().backward()
    assert close(logp.grad, [[-3.0]])


def test_importance_sampling_against_the_reference_model():
    # the paper's Sec. 5.3.2: ratio = pi_theta / pi_ref (not / pi_rollout), clipped around 1
    m = T([[1.0, 1.0, 0.0]])
    logp, old, ref = T([[-1.0, -2.0, -9.0]]), T([[-1.0, -2.0, -9.0]]), T([[-1.0 - math.log(1.5), -2.0, 0.0]])
    adv = T([[1.0, -2.0, 5.0]])
    loss, st = ppo_loss(logp, old, adv, clip_eps=0.2, importance_sampling="reference", ref_logprobs=ref)
    # token 1: ratio 1.5 -> min(1.5*1, 1.2*1) = 1.2; token 2: ratio 1 -> -2; token 3 masked
    assert close(masked_mean(loss, m), -(1.2 - 2.0) / 2)
    assert close(st["ratio"][0, :2], [1.5, 1.0]) and close(masked_mean(st["clipped"], m), 0.5)
    # the same data with the standard PPO ratio (rollout == current policy) is not clipped
    loss, st = ppo_loss(logp, old, adv, clip_eps=0.2, importance_sampling="rollout", ref_logprobs=ref)
    assert close(masked_mean(loss, m), -(1.0 - 2.0) / 2) and close(masked_mean(st["clipped"], m), 0.0)
    with pytest.raises(ValueError, match="allowed: rollout, reference, off"):
        ppo_loss(logp, old, adv, clip_eps=0.2, importance_sampling="yes")


def test_apa_and_awr_losses():
    m = T([[1.0]])
    loss, _ = apa_loss(T([[-1.0]]), T([[-1.0]]), T([[1.0]]), ref_logprobs=T([[-1.5]]), apa_lambda=0.5)
    assert close(masked_mean(loss, m), 2.25)  # (-1 - 1/0.5 + 1.5)^2
    loss, _ = awr_loss(T([[-2.0]]), T([[-2.0]]), T([[1.0]]), awr_beta=2.0)
    assert close(masked_mean(loss, m), 2.0 * math.exp(0.5))
    loss, st = awr_loss(T([[-2.0]]), T([[-2.0]]), T([[1.0]]), awr_beta=2.0, awr_max_weight=1.5)
    assert close(masked_mean(loss, m), 3.0) and close(masked_mean(st["clipped"], m), 1.0)


def test_clipped_value_loss():
    m = T([[1.0]])
    loss, frac = value_loss(T([[1.0]]), T([[0.5]]), T([[2.0]]), m, clip=0.2)
    assert close(loss, 0.845) and close(frac, 1.0)  # 0.5*max(1, (0.7-2)^2)
    loss, _ = value_loss(T([[1.0]]), T([[0.5]]), T([[2.0]]), m, clip=None)
    assert close(loss, 0.5)


def test_entropy_bonus_and_clip_variant():
    assert close(entropy_term(T(2.0), 0.01, None), -0.02)
    assert close(entropy_term(T(2.0), 0.01, 30.0), 0.28)


def test_adaptive_kl_controller_moves_toward_target():
    c = KLController(0.1, target=0.1, horizon=100)
    c.update(0.2, n_samples=32)  # error clipped to +0.2
    assert math.isclose(c.value, 0.1 * (1 + 0.2 * 32 / 100))
    c.update(0.05, n_samples=32)  # error -0.5 clipped to -0.2
    assert c.value < 0.1 * (1 + 0.2 * 32 / 100)


def test_lr_schedule_warms_up_then_decays_by_its_kind():
    from harness.algorithms.schedule import lr_lambda

    assert [lr_lambda(4, "cosine", 104)(u) for u in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_lambda(4, "cosine", 104)(54) == pytest.approx(0.5) and lr_lambda(4, "cosine", 104)(104) == pytest.approx(0)
    assert lr_lambda(0, "linear", 100)(25) == pytest.approx(0.75) and lr_lambda(0, "linear", 100)(200) == 0
    assert lr_lambda(0, "constant", 100)(99) == 1.0
