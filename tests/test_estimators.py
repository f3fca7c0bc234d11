"""Advantage estimators and loss aggregation (harness/algorithms/estimators.py), hand-computed."""
import math

import pytest
import torch

from harness.algorithms.estimators import ADV_ESTIMATORS, NEEDS_CRITIC, NEEDS_GREEDY, NEEDS_GROUPS, aggregate, estimate


def outcome_rewards(scores, lengths, T=3):
    """Rewards with the score at each row's last response token, and the matching mask."""
    B = len(scores)
    r, m = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        m[i, :n] = 1
        r[i, n - 1] = s
    return r, m


def test_config_names_the_registry():
    """harness.config reads the names from the registering files without torch (harness.algorithms.names); they must agree."""
    import typing

    from harness import config
    from harness.algorithms import estimators
    from harness.algorithms.estimators import LOSS_AGGREGATIONS
    from harness.config import PPOConfig

    hints = typing.get_type_hints(PPOConfig)
    assert typing.get_args(hints["adv_estimator"]) == tuple(ADV_ESTIMATORS)
    assert typing.get_args(hints["loss_aggregation"]) == LOSS_AGGREGATIONS
    assert config.NEEDS_CRITIC == estimators.NEEDS_CRITIC and config.NEEDS_GROUPS == estimators.NEEDS_GROUPS


def test_registry_and_needs():
    """The paper-era estimators are registered with their needs (a new one needs no edit here)."""
    assert {"gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax"} <= set(ADV_ESTIMATORS)
    assert NEEDS_CRITIC == {"gae"}
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"} <= NEEDS_GROUPS and not NEEDS_GROUPS & {"reinforce_pp", "remax"}
    assert NEEDS_GREEDY == {"remax"}


def test_rloo_baseline_for_g4():
    r, m = outcome_rewards([1.0, 2.0, 3.0, 6.0], [1, 2, 3, 2])
    adv, ret = estimate("rloo", rewards=r, mask=m, group=torch.tensor([0, 0, 0, 0]))
    # baseline of row 0 = mean(2, 3, 6) = 11/3 -> 1 - 11/3; row 3: 6 - 2 = 4
    expected = [1 - 11 / 3, 2 - 10 / 3, 3 - 3, 6 - 2]
    for i, e in enumerate(expected):
        assert adv[i, 0].item() == pytest.approx(e)
    assert adv[0, 1:].abs().sum() == 0  # masked after the response
    assert torch.equal(adv, ret)


def test_grpo_group_normalization_and_constant_group():
    r, m = outcome_rewards([1.0, 3.0, 5.0, 5.0], [2, 2, 1, 3])
    adv, _ = estimate("grpo", rewards=r, mask=m, group=torch.tensor([7, 7, 9, 9]))
    # group 7: mean 2, sample std sqrt(2) -> -1/sqrt2, +1/sqrt2; group 9 is constant -> 0
    assert adv[0, 0].item() == pytest.approx(-1 / math.sqrt(2), rel=1e-5)
    assert adv[1, 1].item() == pytest.approx(1 / math.sqrt(2), rel=1e-5)
    assert adv[2].abs().sum() == 0 and adv[3].abs().sum() == 0
    dr, _ = estimate("dr_grpo", rewards=r, mask=m, group=torch.tensor([7, 7, 9, 9]))
    assert dr[:, 0].tolist() == [-1.0, 1.0, 0.0, 0.0]


def test_outcome_includes_per_token_kl_penalty():
    r, m = outcome_rewards([1.0, 0.0], [2, 2])
    r = r - 0.1 * m  # KL penalty in the reward at every token
    adv, _ = estimate("dr_grpo", rewards=r, mask=m, group=torch.tensor([0, 0]))
    assert adv[0, 0].item() == pytest.approx(0.5) and adv[1, 0].item() == pytest.approx(-0.5)


def test_reinforce_pp_batch_whitening():
    r, m = outcome_rewards([1.0, 3.0], [2, 1])
    adv, ret = estimate("reinforce_pp", rewards=r, mask=m, gamma=1.0)
    # returns-to-go: row 0 = [1, 1], row 1 = [3]; tokens 1, 1, 3: mean 5/3, unbiased var 4/3
    assert ret[0].tolist() == [1.0, 1.0, 0.0] and ret[1].tolist() == [3.0, 0.0, 0.0]
    sd = math.sqrt(4 / 3)
    assert adv[0, 0].item() == pytest.approx((1 - 5 / 3) / sd, rel=1e-5)
    assert adv[1, 0].item() == pytest.approx((3 - 5 / 3) / sd, rel=1e-5)
    assert adv[1, 1:].abs().sum() == 0
    # discounting: gamma 0.5 halves the score one token back
    _, ret = estimate("reinforce_pp", rewards=r, mask=m, gamma=0.5)
    assert ret[0].tolist() == [0.5, 1.0, 0.0]


def test_reinforce_pp_group_baseline_and_remax():
    r, m = outcome_rewards([1.0, 3.0, 10.0, 10.0], [1, 1, 1, 1])
    _, ret = estimate("reinforce_pp_baseline", rewards=r, mask=m, group=torch.tensor([0, 0, 1, 1]), gamma=1.0)
    assert ret[:, 0].tolist() == [-1.0, 1.0, 0.0, 0.0]
    r, m = outcome_rewards([1.0, 3.0], [2, 1])
    adv, _ = estimate("remax", rewards=r, mask=m, baseline=torch.tensor([0.5, 4.0], dtype=torch.float64))
    assert adv[0].tolist() == [0.5, 0.5, 0.0] and adv[1].tolist() == [-1.0, 0.0, 0.0]


def test_gae_is_the_registered_gae():
    r, m = outcome_rewards([1.0], [2])
    v = torch.tensor([[0.5, 0.25, 0.0]], dtype=torch.float64)
    adv, ret = estimate("gae", rewards=r, values=v, mask=m, gamma=1.0, lam=1.0, group=torch.tensor([0]))
    assert adv[0, :2].tolist() == [0.5, 0.75] and ret[0, :2].tolist() == [1.0, 1.0]
    with pytest.raises(TypeError):
        estimate("gae", rewards=r, mask=m, gamma=1.0, lam=1.0)  # no values: the critic is missing
    with pytest.raises(ValueError, match="allowed"):
        estimate("grop", rewards=r, mask=m)


def test_loss_aggregation_weights_long_and_short_responses():
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    num, den = aggregate(loss, mask, "token_mean")
    assert (num / den).item() == pytest.approx(8 / 5)  # each token weighs 1/5
    num, den = aggregate(loss, mask, "seq_mean_token_mean")
    assert (num / den).item() == pytest.approx((1 + 4) / 2)  # the short response's token weighs 4x
    num, den = aggregate(loss, mask, "seq_mean_token_sum", norm=4)
    assert (num / den).item() == pytest.approx(8 / 4 / 2)
    # pairs combine exactly across micro-batches
    a, b = aggregate(loss[:1], mask[:1], "seq_mean_token_mean"), aggregate(loss[1:], mask[1:], "seq_mean_token_mean")
    assert ((a[0] + b[0]) / (a[1] + b[1])).item() == pytest.approx(2.5)
    with pytest.raises(ValueError):
        aggregate(loss, mask, "seq_mean_token_sum")
