"""A figure file's x axis: `x: sampled_tokens` (issue 16's estimators, KL placement, loss aggregation)
draws every metric at the response tokens sampled so far (the trainer's response/sampled_tokens), from
the runs' own logs in a real MLflow store; and the trainer's count is every rollout's tokens."""
import numpy as np
import pytest

from analysis.figures import X_LABELS, make_figures
from analysis.store import load_ablation
from analysis.synthetic import Curve, write_ablation
from harness import keys as K
from harness.registry import ABLATIONS_DIR, load_registry

from helpers import store_uri

BATCH = {"PPO-max": 32, "GRPO": 8}  # responses per step: the two variants sample at different rates


@pytest.mark.parametrize("name", ["estimators", "kl_placement", "loss_aggregation"])
def test_issue_16_figure_files_compare_at_equal_sampled_tokens(name):
    assert load_registry(ABLATIONS_DIR / f"{name}.yaml", resolve=False).x == "sampled_tokens"


def test_the_x_axis_is_cumulative_sampled_tokens_and_says_so(tmp_path):
    uri = store_uri(tmp_path)
    write_ablation(uri, "estimators", "est", {v: Curve(batch=b) for v, b in BATCH.items()}, seeds=(0, 1), steps=12,
                   sample_every=0)
    write_ablation(uri, "kl_eta", "15", {"KL penalty η=0.05": Curve()}, seeds=(0,), steps=12, sample_every=0)

    data = load_ablation("estimators", uri)
    axes = make_figures("estimators", uri, out=tmp_path / "out", log_to_parent=False).drawn.axes
    lengths = data.metrics(K.LENGTH)
    for key in (K.RM_SCORE, K.LENGTH):
        ax = axes[key]
        assert ax.get_xlabel() == X_LABELS["sampled_tokens"] == "Sampled response tokens (cumulative)"
        for line in (ln for ln in ax.get_lines() if ln.get_label() in BATCH):
            per_seed = [BATCH[line.get_label()] * np.cumsum(g.sort_values("step")["value"].to_numpy())
                        for _, g in lengths[lengths["variant"] == line.get_label()].groupby("seed")]
            assert np.allclose(line.get_xdata(), np.mean(per_seed, axis=0))
    # the same lengths at a quarter of the responses per step: a quarter of the tokens
    ends = {ln.get_label(): ln.get_xdata()[-1] for ln in axes[K.LENGTH].get_lines() if ln.get_label() in BATCH}
    assert ends["GRPO"] < ends["PPO-max"] / 3

    steps = make_figures("kl_eta", uri, out=tmp_path / "out", log_to_parent=False).drawn.axes[K.KL]
    assert steps.get_xlabel() == "Step" and list(steps.get_lines()[0].get_xdata()) == list(range(1, 13))


@pytest.mark.parametrize("extra", [{"reward.running_stats_init": 2}, {"ppo.adv_estimator": "remax", "ppo.rollout_batch_size": 4}])
def test_the_trainer_counts_every_rollouts_tokens(tiny_world, tmp_path, extra):
    """response/sampled_tokens: the response tokens of every training rollout so far (reward-stat
    seeding batches, ReMax's greedy responses), not eval's; it survives a checkpoint round trip."""
    import torch

    from harness.config import load_config
    from harness.data import load_source
    from harness.models import Models
    from harness.trainer import PPOTrainer

    from helpers import fast_overrides

    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **extra))
    dev = torch.device("cpu")
    trainer = PPOTrainer(cfg, Models(cfg, dev), load_source(cfg), dev)
    seen, batch = [], trainer.make_batch
    trainer.make_batch = lambda timers: seen.append(batch(timers)) or seen[-1]
    trainer.seed_reward_stats()
    trainer.evaluate()
    for _ in range(2):
        m, _ = trainer.step()
    want = sum(int(b.rollout.lengths.sum()) for b in seen)
    if cfg.ppo.adv_estimator == "remax":
        assert m[K.SAMPLED_TOKENS] > want  # plus the greedy responses
    else:
        assert len(seen) == 4 and m[K.SAMPLED_TOKENS] == want
    state = trainer.state_dict()
    other = PPOTrainer(cfg, Models(cfg, dev), load_source(cfg), dev)
    other.load_state_dict(state)
    assert other.sampled_tokens == m[K.SAMPLED_TOKENS]
