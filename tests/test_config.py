"""Bad input fails before any work, naming the field, the value and what is allowed."""
import subprocess
import sys

import pytest

from harness.config import ConfigError, PPOConfig, TrainConfig, config_hash, field_docs, iter_fields, load_config


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_yaml_and_dotted_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "ppo:\n  kl_coef: 0.2\nreward:\n  clip: null\n"), ["ppo.kl_coef=0.1", "seed=3"])
    assert cfg.ppo.kl_coef == 0.1 and cfg.reward.clip is None and cfg.seed == 3
    assert isinstance(cfg.ppo.policy_lr, float)


def test_typo_in_yaml_key_names_the_closest_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "ppo:\n  kl_cof: 0.1\n"))
    assert "ppo.kl_cof: unknown key" in str(e.value) and "ppo.kl_coef" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "rewrd:\n  clip: 0.8\n"))
    assert "did you mean reward" in str(e.value)


def test_out_of_range_and_wrong_type_name_field_value_and_allowed(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "ppo:\n  gae_lambda: 1.5\n  clip_eps: yes-please\n"))
    msg = str(e.value)
    assert "ppo.gae_lambda: got 1.5; allowed: a number >= 0 and <= 1" in msg
    assert "ppo.clip_eps: got 'yes-please'" in msg  # both problems reported at once
    with pytest.raises(ConfigError, match=r"reward.clip: got 0; allowed: a number > 0 or null"):
        load_config(None, ["reward.clip=0"])  # clip 0 would zero every reward (reference-code quirk)
    with pytest.raises(ConfigError, match=r"ppo.policy_loss: got 'apo'.*did you mean 'apa'|did you mean 'ppo'"):
        load_config(None, ["ppo.policy_loss=apo"])
    with pytest.raises(ConfigError, match="divisor of ppo.rollout_batch_size"):
        load_config(None, ["ppo.num_minibatches=5"])


def test_unsafe_yaml_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "seed: !!python/object/apply:os.system ['echo hi']\n"))


def test_every_field_has_a_doc_and_default():
    fields = list(iter_fields(TrainConfig))
    assert len(fields) > 60
    undocumented = [k for k, _, _, doc in fields if not doc]
    assert undocumented == []


def test_config_hash_ignores_bookkeeping_only():
    a = load_config(None, ["logging.run_name=a"])
    b = load_config(None, ["logging.run_name=b", "threads=2"])
    c = load_config(None, ["ppo.kl_coef=0.3"])
    assert config_hash(a) == config_hash(b) != config_hash(c)


def test_train_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "harness.train", "--help"], capture_output=True, text=True, check=True).stdout
    for key, _, _, _ in iter_fields(TrainConfig):
        assert key in out, key
    assert field_docs(PPOConfig)["importance_sampling"] in out


def test_train_cli_rejects_bad_config_before_building_anything(tmp_path):
    r = subprocess.run([sys.executable, "-m", "harness.train", "--set", "ppo.kl_cof=0.1", "--set", "data.world_dir=/nonexistent"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "did you mean ppo.kl_coef" in r.stderr
