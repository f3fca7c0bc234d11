"""A few real PPO / APA / AWR steps of tiny models, logged to a real MLflow store and read back."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from harness import keys, statefile, tracking
from harness.algorithms.names import ADV_ESTIMATORS
from harness.config import ConfigError, load_config
from harness.train import main as train_main
from harness.train import train

from helpers import fast_overrides


def run(tiny_world, tmp_path, **extra):
    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **extra))
    return cfg, train(cfg)


@pytest.mark.parametrize("loss", ["ppo", "apa", "awr"])
def test_every_metric_reaches_mlflow(tiny_world, tmp_path, loss):
    cfg, res = run(tiny_world, tmp_path, **{"ppo.policy_loss": loss, "ppo.ptx_coef": 0.1, "ppo.entropy_coef": 0.01})
    assert res.status == "FINISHED", res.error
    c = tracking.client(cfg.logging.tracking_uri)
    r = c.get_run(res.run_id)
    expected = keys.STEP_METRICS + keys.GOLD_METRICS + keys.EVAL_METRICS + [keys.PTX_LOSS]
    assert [k for k in expected if k not in r.data.metrics] == []
    # one point per step for step metrics; eval at steps 0, 2, 4
    assert [m.step for m in c.get_metric_history(res.run_id, keys.KL)] == [1, 2, 3, 4]
    assert [m.step for m in c.get_metric_history(res.run_id, keys.EVAL_WIN_RATE)] == [0, 2, 4]
    assert r.data.params["ppo.policy_loss"] == loss and r.data.params["reward.clip"] == "0.8"
    assert r.data.tags[keys.TAG_SEED] == "0" and r.data.tags[keys.TAG_COLLAPSED] in ("true", "false")
    assert keys.TAG_COMMIT in r.data.tags and r.info.status == "FINISHED"
    arts = {a.path for a in c.list_artifacts(res.run_id)}
    assert {"config.yaml", "samples", "eval"} <= arts
    samples = tracking.load_json_artifact(cfg.logging.tracking_uri, res.run_id, "samples/step_000004.json")
    assert samples["step"] == 4 and len(samples["rows"]) == 8 and "response" in samples["rows"][0]
    assert all(math.isfinite(v) for v in r.data.metrics.values())


def test_reference_and_reward_model_receive_no_gradient(tiny_world, tmp_path):
    from harness.data import load_source
    from harness.models import Models
    from harness.trainer import PPOTrainer

    cfg = load_config(None, fast_overrides(tiny_world, tmp_path))
    torch.manual_seed(0)
    models = Models(cfg, torch.device("cpu"))
    before_ref = [p.clone() for p in models.reference.parameters()]
    before_rm = [p.clone() for p in models.reward.parameters()]
    before_pol = [p.clone() for p in models.policy.parameters()]
    trainer = PPOTrainer(cfg, models, load_source(cfg), torch.device("cpu"))
    trainer.step()
    for m in (models.reference, models.reward):
        assert all(not p.requires_grad and p.grad is None for p in m.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before_ref, models.reference.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before_rm, models.reward.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(before_pol, models.policy.parameters()))


def test_first_minibatch_ratio_is_one_and_same_seed_same_run(tiny_world, tmp_path):
    cfg, a = run(tiny_world, tmp_path / "a", **{"ppo.steps": 2, "logging.eval_every": 0})
    _, b = run(tiny_world, tmp_path / "b", **{"ppo.steps": 2, "logging.eval_every": 0})
    assert a.final_metrics[keys.RM_SCORE] == b.final_metrics[keys.RM_SCORE]
    assert a.final_metrics[keys.PG_LOSS] == b.final_metrics[keys.PG_LOSS]
    hist = tracking.metric_history(cfg.logging.tracking_uri, a.run_id, keys.APPROX_KL)
    assert hist[0][1] < 1e-3  # one epoch: each minibatch is seen once, right after its rollout


def test_nan_loss_ends_run_failed_without_raising(tiny_world, tmp_path):
    # an absurd learning rate blows the policy up within a few updates
    cfg, res = run(tiny_world, tmp_path, **{"ppo.steps": 30, "ppo.policy_lr": 1e30, "ppo.max_grad_norm": 0, "logging.eval_every": 0,
                                              "ppo.adv_normalize": False, "ppo.clip_eps": None, "reward.normalize": False})
    assert res.status == "FAILED"
    assert res.error and ("non-finite" in res.error or "nan" in res.error.lower() or "inf" in res.error.lower())
    r = tracking.client(cfg.logging.tracking_uri).get_run(res.run_id)
    assert r.info.status == "FAILED" and keys.TAG_FAILURE in r.data.tags


def test_killed_run_resumes_into_the_same_mlflow_run(tiny_world, tmp_path):
    over = {"ppo.steps": 4, "logging.checkpoint_every": 2, "logging.eval_every": 0}
    _, full = run(tiny_world, tmp_path / "full", **over)

    cfg = load_config(None, fast_overrides(tiny_world, tmp_path / "killed", **over))

    def kill_at_3(step, metrics):
        if step == 3:
            raise KeyboardInterrupt  # as if the process were interrupted during step 3's bookkeeping
        return False

    with pytest.raises(KeyboardInterrupt):
        train(cfg, on_step=kill_at_3)
    c = tracking.client(cfg.logging.tracking_uri)
    killed_id = c.search_runs([c.get_experiment_by_name(cfg.logging.experiment).experiment_id])[0].info.run_id
    assert c.get_run(killed_id).info.status == "KILLED"

    resumed = train(cfg, resume=True)
    assert resumed.run_id == killed_id and resumed.status == "FINISHED" and resumed.steps_done == 4
    assert c.get_run(killed_id).info.status == "FINISHED"
    # step 3 was logged before the kill; resumed from step 2 it is replayed but not logged twice
    steps = [s for s, _ in tracking.metric_history(cfg.logging.tracking_uri, killed_id, keys.KL)]
    assert sorted(steps) == [1, 2, 3, 4]
    # resuming reproduces the uninterrupted run: weights, optimizers and RNG streams were restored
    assert resumed.final_metrics[keys.RM_SCORE] == pytest.approx(full.final_metrics[keys.RM_SCORE], abs=1e-5)
    assert resumed.final_metrics[keys.PG_LOSS] == pytest.approx(full.final_metrics[keys.PG_LOSS], abs=1e-5)


def test_run_killed_in_its_first_step_resumes_without_logging_its_start_twice(tiny_world, tmp_path, monkeypatch):
    # killed after critic pretraining and the step-0 eval were logged, before step 1 was: no
    # checkpoint yet, so the resumed run replays its start into the same MLflow run
    from harness.trainer import PPOTrainer

    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **{"ppo.steps": 2, "ppo.critic_pretrain_steps": 2}))
    real_step, calls = PPOTrainer.step, []

    def step_killed_once(self):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt  # as a kill during the first step would
        return real_step(self)

    monkeypatch.setattr(PPOTrainer, "step", step_killed_once)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    uri = cfg.logging.tracking_uri
    c = tracking.client(uri)
    (killed,) = c.search_runs([c.get_experiment_by_name(cfg.logging.experiment).experiment_id])
    assert tracking.metric_history(uri, killed.info.run_id, keys.EVAL_RM) and not tracking.metric_history(uri, killed.info.run_id, keys.KL)

    resumed = train(cfg, resume=True)
    assert resumed.run_id == killed.info.run_id and resumed.status == "FINISHED"
    steps = {k: [m.step for m in c.get_metric_history(resumed.run_id, k)] for k in c.get_run(resumed.run_id).data.metrics}
    assert steps[keys.EVAL_RM] == [0, 2] and steps[keys.KL] == [1, 2]
    assert any(k.startswith("critic_pretrain/") for k in steps)
    assert {k: s for k, s in steps.items() if len(s) != len(set(s))} == {}  # no point logged twice


def test_damaged_checkpoint_falls_back_then_restarts(tiny_world, tmp_path, capsys):
    over = {"ppo.steps": 4, "logging.checkpoint_every": 1, "logging.eval_every": 0}
    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **over))
    stop_after_3 = lambda step, m: step == 3  # noqa: E731 - a callback stop leaves checkpoints of steps 2 and 3
    first = train(cfg, on_step=stop_after_3)
    ckpt = Path(first.run_dir) / "ckpt"
    (ckpt / "state.pt").write_bytes((ckpt / "state.pt").read_bytes()[:100])  # truncated
    resumed = train(cfg, resume=True)
    assert resumed.status == "FINISHED" and resumed.run_id == first.run_id
    assert "resuming from the previous checkpoint" in capsys.readouterr().err
    uri = cfg.logging.tracking_uri
    assert sorted(s for s, _ in tracking.metric_history(uri, first.run_id, keys.KL)) == [1, 2, 3, 4]
    # both checkpoints empty: the run restarts from step 0, in the same run, still without duplicates
    for f in ("state.pt", "state.prev.pt"):
        (ckpt / f).write_bytes(b"")
    again = train(cfg, resume=True)
    assert again.status == "FINISHED" and "restarting the run from step 0" in capsys.readouterr().err
    assert sorted(s for s, _ in tracking.metric_history(uri, first.run_id, keys.KL)) == [1, 2, 3, 4]


def test_truncated_run_file_continues_the_run_found_in_the_store_or_starts_over(tiny_world, tmp_path, capsys):
    """run.json cut short (a crash mid-write, a full disk): `--resume` finds the run in the store by
    its name and config hash and continues it from its checkpoint; a store without it: step 0."""
    over = {"ppo.steps": 4, "logging.checkpoint_every": 2, "logging.eval_every": 0, "logging.run_name": "r"}
    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **over))
    with pytest.raises(KeyboardInterrupt):
        train(cfg, on_step=lambda step, m: step == 3 and _raise(KeyboardInterrupt()))
    uri, run_file = cfg.logging.tracking_uri, Path(cfg.logging.output_dir) / "r" / "run.json"
    c = tracking.client(uri)
    (killed,) = c.search_runs([c.get_experiment_by_name(cfg.logging.experiment).experiment_id])
    tracking.reopen_run(uri, killed.info.run_id)  # RUNNING, as a kill -9 leaves it
    run_file.write_text(run_file.read_text()[:40])
    overrides = fast_overrides(tiny_world, tmp_path, **over)
    assert train_main([x for o in overrides for x in ("--set", o)] + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert f"{run_file} is unreadable (40 bytes; JSONDecodeError" in err, err
    assert f"continuing MLflow run {killed.info.run_id}" in err and "by its name 'r' and config hash" in err
    assert c.get_run(killed.info.run_id).info.status == "FINISHED"
    assert sorted(s for s, _ in tracking.metric_history(uri, killed.info.run_id, keys.KL)) == [1, 2, 3, 4]
    # the store no longer holds it: a new run from step 0, saying so
    c.delete_run(killed.info.run_id)
    run_file.write_bytes(b"")
    again = train(cfg, resume=True)
    assert again.status == "FINISHED" and again.run_id != killed.info.run_id and again.steps_done == 4
    assert "holds no run named 'r' with config hash" in capsys.readouterr().err
    assert statefile.read_json_object(run_file)["run_id"] == again.run_id


def _raise(e: BaseException):
    raise e


def test_a_checkpoint_of_another_run_in_the_folder_is_not_resumed(tiny_world, tmp_path, capsys):
    # a run of another config in the same folder (no --resume: a new run), killed before its first
    # checkpoint: the folder still holds the first run's checkpoint, which must not be resumed into it
    over = {"ppo.steps": 2, "logging.checkpoint_every": 1, "logging.eval_every": 0, "logging.run_name": "r"}
    train(load_config(None, fast_overrides(tiny_world, tmp_path, **over)))
    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **over, **{"ppo.kl_coef": 0.3}))
    with pytest.raises(KeyboardInterrupt):
        train(cfg, on_step=lambda step, m: _raise(KeyboardInterrupt()))
    resumed = train(cfg, resume=True)
    assert resumed.status == "FINISHED" and resumed.steps_done == 2, resumed
    assert "holds the checkpoint of run" in capsys.readouterr().err
    assert sorted(s for s, _ in tracking.metric_history(cfg.logging.tracking_uri, resumed.run_id, keys.KL)) == [1, 2]


def test_a_parent_run_missing_from_the_store_is_refused_before_the_run_exists(tiny_world, tmp_path):
    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **{"logging.parent_run_id": "deadbeef"}))
    with pytest.raises(ConfigError, match=r"logging.parent_run_id: got 'deadbeef'; the store sqlite:///\S+ holds no run "
                                          r"with that id"):
        train(cfg)
    assert tracking.client(cfg.logging.tracking_uri).get_experiment_by_name(cfg.logging.experiment) is None


def test_a_response_cap_past_the_policys_context_is_refused_before_the_run_exists(tiny_world, tmp_path):
    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **{"generation.max_new_tokens": 100000}))
    with pytest.raises(ConfigError, match=r"generation.max_new_tokens: got 100000; allowed: less than the policy's "
                                          r"context of \d+ tokens \(model.sft_path 'world:sft'\)"):
        train(cfg)
    assert not (tmp_path / "mlflow.db").exists()  # no store, no run


def test_a_diverged_policy_fails_naming_its_non_finite_weights(tiny_world, tmp_path):
    # one minibatch, one epoch: the blown-up update is the step's last, so no loss of this step sees
    # it; the next rollout samples from NaN logits (and once drew the index past the vocabulary)
    cfg, res = run(tiny_world, tmp_path, **{"ppo.num_minibatches": 1, "ppo.policy_lr": 1e308})
    assert res.status == "FAILED" and res.error.startswith(
        "NonFiniteLoss: the policy's weights/logits became non-finite"), res.error
    assert "the learning rate is too high" in res.error
    r = tracking.client(cfg.logging.tracking_uri).get_run(res.run_id)
    assert r.info.status == "FAILED" and r.data.tags[keys.TAG_FAILURE] == res.error


def test_resume_with_another_config_is_refused_naming_the_keys(tiny_world, tmp_path):
    over = {"ppo.steps": 2, "logging.checkpoint_every": 1, "logging.eval_every": 0}
    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **over))
    train(cfg)
    changed = load_config(None, fast_overrides(tiny_world, tmp_path, **over, **{"ppo.kl_coef": 0.3}))
    with pytest.raises(ConfigError, match=r"another config \(ppo.kl_coef: 0.05 -> 0.3\)"):
        train(changed, resume=True)


def test_preflight_names_the_field_before_any_run_exists(tiny_world, tmp_path):
    from harness.models import preflight

    base = fast_overrides(tiny_world, tmp_path)
    assert preflight(load_config(None, base)) == []
    cases = {
        "model.sft_path=/nonexistent/model": "model.sft_path",
        "model.reward_path=gpt2-not-cached-here": "huggingface-cli download",
        f"data.world_dir={tmp_path / 'nowhere'}": "data.world_dir",
    }
    for override, expected in cases.items():
        problems = preflight(load_config(None, base + [override]))
        assert problems and expected in " ".join(problems), (override, problems)
    # a reward model with another vocabulary than the policy's
    other = tmp_path / "other_rm"
    from transformers import GPT2Config, GPT2ForSequenceClassification
    GPT2ForSequenceClassification(GPT2Config(vocab_size=77, n_layer=1, n_embd=16, n_head=2, num_labels=1)).save_pretrained(other)
    problems = preflight(load_config(None, base + [f"model.reward_path={other}"]))
    assert any("vocabularies differ" in p and "model.reward_path: 77" in p for p in problems), problems
    with pytest.raises(ConfigError, match="model.reward_path"):
        train(load_config(None, base + [f"model.reward_path={other}"]))
    assert not (tmp_path / "mlflow.db").exists()  # no store, no run


# ---- issue 16: advantage estimators, G samples per prompt, KL placement, loss aggregation ----
GROUPED = {"generation.samples_per_prompt": 4, "ppo.steps": 2, "logging.eval_every": 0, "logging.checkpoint_every": 0}


@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
def test_every_advantage_estimator_trains_two_steps(tiny_world, tmp_path, estimator):
    cfg, res = run(tiny_world, tmp_path, **GROUPED, **{"ppo.adv_estimator": estimator})
    assert res.status == "FINISHED" and res.steps_done == 2, res.error
    r = tracking.client(cfg.logging.tracking_uri).get_run(res.run_id)
    critic_free = estimator != "gae"
    assert r.data.tags["harness.adv_estimator"] == estimator
    assert r.data.tags["harness.critic_free"] == str(critic_free).lower()
    val = [k for k in r.data.metrics if k.startswith("val/") or k in (keys.GRAD_NORM_CRITIC, keys.LR_CRITIC)]
    assert (val == []) == critic_free, val
    assert all(math.isfinite(v) for v in r.data.metrics.values())
    assert r.data.metrics[keys.ADV_RAW_STD] > 0  # the groups' rewards differ: a real signal
    if critic_free:  # the checkpoint holds no critic
        from harness.train import load_checkpoint

        assert "critic" not in load_checkpoint(Path(res.run_dir))


def test_critic_free_run_constructs_no_critic(tiny_world, tmp_path):
    from harness.data import load_source
    from harness.models import Models
    from harness.trainer import PPOTrainer

    cfg = load_config(None, fast_overrides(tiny_world, tmp_path, **{"ppo.adv_estimator": "grpo", "generation.samples_per_prompt": 2}))
    models = Models(cfg, torch.device("cpu"))
    trainer = PPOTrainer(cfg, models, load_source(cfg), torch.device("cpu"))
    assert models.critic is None and trainer.critic is None
    metrics, b = trainer.step()
    assert not [k for k in metrics if k.startswith("val/")]
    # G = 2 samples per prompt: adjacent rows answer one prompt, and keyed sampling makes them differ
    assert b.prompts[0::2] == b.prompts[1::2] and len(set(b.prompts)) == 4
    assert any(r0 != r1 for r0, r1 in zip(b.responses[0::2], b.responses[1::2]))


@pytest.mark.parametrize("extra", [
    {"ppo.kl_placement": "loss", "ppo.kl_estimator": "k3"},
    {"ppo.loss_aggregation": "seq_mean_token_mean"},
    {"ppo.loss_aggregation": "seq_mean_token_sum", "ppo.kl_placement": "loss"},
])
def test_kl_in_the_loss_and_loss_aggregations_run(tiny_world, tmp_path, extra):
    cfg, res = run(tiny_world, tmp_path, **GROUPED, **{"ppo.adv_estimator": "grpo"}, **extra)
    assert res.status == "FINISHED", res.error
    m = tracking.client(cfg.logging.tracking_uri).get_run(res.run_id).data.metrics
    assert all(math.isfinite(v) for v in m.values())
    if extra.get("ppo.kl_placement") == "loss":  # no KL in the reward
        assert m[keys.NON_SCORE_REWARD] == 0.0 and m[keys.KL] != 0.0


def test_group_estimators_need_two_samples_per_prompt():
    # rules between fields: refused as the config loads (harness.config.cross_checks), before any model
    with pytest.raises(ConfigError, match="generation.samples_per_prompt: got 1 with ppo.adv_estimator=rloo; allowed: 2 or more"):
        load_config(None, ["ppo.adv_estimator=rloo"])
    with pytest.raises(ConfigError, match="ppo.critic_pretrain_steps: got 2 with ppo.adv_estimator=remax; allowed: 0"):
        load_config(None, ["ppo.adv_estimator=remax", "ppo.critic_pretrain_steps=2"])
    from harness.parallel import validate

    assert validate(load_config(None, ["ppo.adv_estimator=grpo", "generation.samples_per_prompt=4"]), "cpu", 1) == []
    with pytest.raises(ConfigError, match=r"ppo.rollout_batch_size: got 32; allowed: a multiple of generation.samples_per_prompt=3"):
        load_config(None, ["ppo.adv_estimator=grpo", "generation.samples_per_prompt=3"])
