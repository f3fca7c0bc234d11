"""Issue 16's figure files (estimators, KL placement, loss aggregation, code vs paper) run end to
end at a tiny budget on the tiny world, into a real MLflow store read back."""
import pytest
from mlflow.tracking import MlflowClient

from harness import ablate
from harness import keys as K
from harness.registry import ABLATIONS_DIR, load_registry
from harness.schema import ConfigError

from helpers import store_uri

TINY_RUN = {"ppo.steps": 2, "ppo.rollout_batch_size": 8, "ppo.num_minibatches": 2, "ppo.ppo_epochs": 1,
            "generation.max_new_tokens": 8, "data.eval_prompts": 4, "logging.eval_every": 2,
            "logging.sample_every": 0, "logging.checkpoint_every": 0, "ppo.critic_pretrain_steps": 0}


@pytest.mark.parametrize("name", ["estimators", "kl_placement", "loss_aggregation", "code_vs_paper"])
def test_figure_file_runs_end_to_end(name, tiny_world, tmp_path):
    uri = store_uri(tmp_path)
    sets = [x for k, v in {**TINY_RUN, "data.world_dir": tiny_world}.items() for x in ("--set", f"{k}={v}")]
    argv = [str(ABLATIONS_DIR / f"{name}.yaml"), "--tracking-uri", uri, "--runs-dir", str(tmp_path / "runs"),
            "--seeds", "0", "--workers", "0", "--threads", "1", "--no-progress", *sets]
    assert ablate.main(argv) == 0
    reg = load_registry(ABLATIONS_DIR / f"{name}.yaml")
    c = MlflowClient(uri)
    runs = [r for r in c.search_runs([c.get_experiment_by_name(name).experiment_id])
            if r.data.tags.get(K.TAG_ROLE) == "train"]
    assert sorted(r.data.tags[K.TAG_VARIANT] for r in runs) == sorted(reg.variant_names)
    for r in runs:
        assert r.info.status == "FINISHED" and K.RM_SCORE in r.data.metrics and K.GOLD_SCORE in r.data.metrics
        critic_free = r.data.params["ppo.adv_estimator"] != "gae"
        assert critic_free == (not any(k.startswith("val/") for k in r.data.metrics))


def test_grid_preflight_checks_every_variant_not_only_each_model():
    # every variant shares PPO-max's models and data; a group estimator at G = 1 must still be caught: a
    # rule between fields (harness.config.cross_checks), refused as each variant's config loads
    with pytest.raises(ConfigError) as e:
        load_registry(ABLATIONS_DIR / "estimators.yaml", overrides={"generation.samples_per_prompt": 1})
    problems = e.value.problems
    assert any("variant 'GRPO' seed 0: generation.samples_per_prompt: got 1" in p for p in problems), problems
    assert not any("variant 'PPO-max'" in p and "samples_per_prompt" in p for p in problems)
