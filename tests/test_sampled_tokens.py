"""A figure file's x axis: `x: sampled_tokens` (issue 16's estimators, KL placement, loss aggregation)
draws every metric at the response tokens sampled so far, from the runs' own logs in a real MLflow
store: sum over steps of ppo.rollout_batch_size (a param of every run) x response/length_mean."""
import numpy as np
import pytest

from analysis.figures import X_LABELS, make_figures
from analysis.store import load_ablation
from analysis.synthetic import Curve, write_ablation
from harness import keys as K
from harness import tracking
from harness.registry import ABLATIONS_DIR, load_registry

BATCH = {"PPO-max": 32, "GRPO": 8}  # responses per step: the two variants sample at different rates


@pytest.mark.parametrize("name", ["estimators", "kl_placement", "loss_aggregation"])
def test_issue_16_figure_files_compare_at_equal_sampled_tokens(name):
    assert load_registry(ABLATIONS_DIR / f"{name}.yaml", resolve=False).x == "sampled_tokens"


def test_the_x_axis_is_cumulative_sampled_tokens_and_says_so(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    write_ablation(uri, "estimators", "est", {v: Curve() for v in BATCH}, seeds=(0, 1), steps=12, sample_every=0)
    write_ablation(uri, "kl_eta", "15", {"KL penalty η=0.05": Curve()}, seeds=(0,), steps=12, sample_every=0)
    for name in ("estimators", "kl_eta"):
        for r in load_ablation(name, uri).runs.itertuples():  # the trainer logs the whole config as params
            tracking.log_params(uri, r.run_id, {"ppo.rollout_batch_size": BATCH.get(r.variant, 32)})

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
