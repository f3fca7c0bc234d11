"""Bad input fails before any work, naming the file, the field, the value and what is allowed."""
import subprocess
import sys

import pytest

from harness.algorithms.names import POLICY_LOSSES
from harness.config import ConfigError, TrainConfig, config_hash, from_dict, iter_fields, load_config, to_dict, to_yaml


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text) if isinstance(text, str) else p.write_bytes(text)
    return p


def problems(path=None, overrides=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


def test_yaml_and_dotted_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "ppo:\n  kl_coef: 0.2\n  policy_lr: 1e-5\nreward:\n  clip: null\n"),
                      ["ppo.kl_coef=0.1", "seed=3", "ppo.critic_lr=3e-6"])
    assert cfg.ppo.kl_coef == 0.1 and cfg.reward.clip is None and cfg.seed == 3
    assert cfg.ppo.policy_lr == 1e-5 and cfg.ppo.critic_lr == 3e-6  # YAML 1.1 reads 1e-5 as text; we do not
    assert isinstance(cfg.ppo.max_grad_norm, float)


def test_typo_in_yaml_key_names_the_file_and_the_closest_key(tmp_path):
    p = write(tmp_path, "ppo:\n  kl_cof: 0.1\n")
    assert f"{p}: ppo.kl_cof: unknown key; did you mean ppo.kl_coef?" in problems(p)
    assert "did you mean reward" in problems(write(tmp_path, "rewrd:\n  clip: 0.8\n"))


def test_problems_name_where_the_value_came_from(tmp_path):
    p = write(tmp_path, "ppo:\n  gae_lambda: 1.5\n  clip_eps: yes-please\n")
    msg = problems(p, ["ppo.steps=0"])
    assert f"{p}: ppo.gae_lambda: got 1.5; allowed: a number >= 0 and <= 1" in msg
    assert f"{p}: ppo.clip_eps: got 'yes-please'" in msg  # every problem reported at once
    assert "--set: ppo.steps: got 0; allowed: an integer >= 1 and <= 10000000" in msg
    assert "defaults: ppo.num_minibatches" not in problems(None, ["ppo.rollout_batch_size=5"])


@pytest.mark.parametrize("override, expected", [
    # issue 13: all of these used to be accepted silently
    ("ppo.steps=0", "ppo.steps: got 0; allowed: an integer >= 1 and <= 10000000"),
    ("ppo.steps=1e30", "ppo.steps: got 1e+30; allowed: an integer"),
    ("ppo.rollout_batch_size=1e12", "ppo.rollout_batch_size: got 1000000000000.0; allowed: an integer >= 1 and <= 65536"),
    ("ppo.critic_pretrain_steps=1e12", "ppo.critic_pretrain_steps: got 1000000000000.0; allowed: an integer >= 0"),
    ("ppo.clip_eps=5", "ppo.clip_eps: got 5; allowed: a number > 0 and <= 1 or null"),
    ("generation.temperature=1e-30", "generation.temperature: got 1e-30; allowed: a number >= 0.05"),
    ("ppo=null", "ppo: got None; allowed: a section with keys steps, rollout_batch_size"),
    ("seed=1234567890123456789012", "seed: got 1234567890123456789012; allowed: an integer >= 0 and <= 2147483647"),
    ("logging.tags={a: [1, 2]}", "logging.tags.a: got [1, 2]; allowed: a string"),
    ("generation.stop_at_eos=1", "generation.stop_at_eos: got 1; allowed: true or false"),
    ("generation.stop_at_eos=yes", "generation.stop_at_eos: got 'yes'; allowed: true or false"),
    ("generation.stop_at_eos='true'", "generation.stop_at_eos: got 'true'; allowed: true or false"),
    ("ppo.steps=true", "ppo.steps: got True; allowed: an integer"),
    ("distributed.zero_stage=true", "distributed.zero_stage: got True; allowed: an integer >= 0 and <= 3"),
    ("ppo.steps=2.5", "ppo.steps: got 2.5; allowed: an integer"),
    ("ppo.policy_lr='0.1'", "ppo.policy_lr: got '0.1'; allowed: a number > 0"),
    ("ppo.policy_lr=.nan", "ppo.policy_lr: got nan; allowed: a number"),
    ("logging.run_name=a/b", "logging.run_name: got 'a/b'; allowed: one folder name under logging.output_dir"),
    ("logging.run_name=..", "logging.run_name: got '..'; allowed: one folder name"),
    ("logging.run_name=" + "r" * 201, f"logging.run_name: got '{'r' * 201}'; allowed: a non-empty name of at most 200"),
    ("logging.experiment=''", "logging.experiment: got ''; allowed: a non-empty name"),
    ('logging.experiment="a\\0b"', "logging.experiment: got 'a\\x00b'; allowed: a non-empty name"),
    ("logging.tracking_uri=not a uri", "logging.tracking_uri: got 'not a uri'; allowed: an MLflow tracking URI"),
    ("logging.tracking_uri='http://[::1'", "logging.tracking_uri: got 'http://[::1'"),
    ("reward.clip=0", "reward.clip: got 0; allowed: a number > 0 or null"),  # 0 would zero every reward
    ("ppo.policy_loss=apo", f"ppo.policy_loss: got 'apo'; allowed: one of {', '.join(map(repr, POLICY_LOSSES))} (did you mean 'ppo'?)"),
    ("ppo.num_minibatches=5", "ppo.num_minibatches: got 5; allowed: a divisor of ppo.rollout_batch_size=32"),
    ("x.y=1", "x: unknown key; allowed: seed, device, threads, model"),
])
def test_bad_values_are_refused_with_field_value_and_allowed(override, expected):
    assert f"--set: {expected}" in problems(None, [override])


def test_good_values_at_the_edges_are_accepted():
    cfg = load_config(None, ["ppo.clip_eps=1", "generation.temperature=0.05", "seed=2147483647", "ppo.steps=1e3",
                             "logging.run_name=run-1.a_b", "logging.tracking_uri=file:///tmp/x", "logging.run_name="])
    assert cfg.ppo.steps == 1000 and isinstance(cfg.ppo.steps, int) and cfg.logging.run_name is None


@pytest.mark.parametrize("content, expected", [
    ("", "the file is empty (or only comments)"),
    ("# nothing here\n", "the file is empty (or only comments)"),
    ("ppo:\n  steps: 3\nppo:\n  steps: 4\n", "duplicate key 'ppo'"),
    ("ppo:\n  steps: 3\n  steps: 4\n", "duplicate key 'steps'"),
    (b"seed: 1\nexperiment: caf\xe9\n", "line 2: not UTF-8 text"),
    ("- seed: 1\n", "top level must be a mapping of keys, got list"),
    ("ppo: [1, 2]\n", "ppo: got [1, 2]; allowed: a section"),
    ("seed: !!python/object/apply:os.system ['echo hi']\n", "not valid YAML"),
])
def test_bad_files_are_refused_naming_the_file(tmp_path, content, expected):
    p = write(tmp_path, content)
    msg = problems(p)
    assert str(p) in msg and expected in msg


def test_output_dir_under_a_file_is_refused_at_load_time(tmp_path):
    (tmp_path / "f").write_text("x")
    assert f"logging.output_dir: got '{tmp_path}/f/runs'; allowed: a directory, but '{tmp_path}/f' is a file" in \
        problems(None, [f"logging.output_dir={tmp_path}/f/runs"])


def test_a_utf8_bom_is_not_part_of_the_content(tmp_path):
    assert load_config(write(tmp_path, "\ufeffseed: 4\n".encode())).seed == 4


def test_every_field_has_a_doc_and_default():
    fields = list(iter_fields(TrainConfig))
    assert len(fields) > 60
    assert [k for k, _, _, doc, _ in fields if not doc] == []


def test_config_hash_ignores_bookkeeping_only():
    a = load_config(None, ["logging.run_name=a"])
    b = load_config(None, ["logging.run_name=b", "threads=2"])
    c = load_config(None, ["ppo.kl_coef=0.3"])
    assert config_hash(a) == config_hash(b) != config_hash(c)


def test_config_hash_does_not_depend_on_how_a_number_was_written():
    """Ints given for floats become floats and integral floats for ints become ints, so a resumed or
    re-run config hashes as the one it came from."""
    a = load_config(None, ["ppo.policy_lr=1", "ppo.steps=100", "ppo.kl_coef=0.00001"])
    b = load_config(None, ["ppo.policy_lr=1.0", "ppo.steps=1e2", "ppo.kl_coef=1e-5"])
    assert config_hash(a) == config_hash(b)
    assert config_hash(from_dict(to_dict(a))) == config_hash(a)
    import yaml
    assert from_dict(yaml.safe_load(to_yaml(a))) == a


def test_train_help_documents_every_flag_in_lines_of_at_most_100_characters():
    out = subprocess.run([sys.executable, "-m", "harness.train", "--help"], capture_output=True, text=True, check=True).stdout
    for key, *_ in iter_fields(TrainConfig):
        assert key in out, key
    assert "every epoch's data treated as freshly sampled" in " ".join(out.split())  # a docstring, wrapped
    assert max(len(line) for line in out.splitlines()) <= 100


def test_train_cli_rejects_bad_config_before_building_anything(tmp_path):
    r = subprocess.run([sys.executable, "-m", "harness.train", "--set", "ppo.kl_cof=0.1", "--set", "data.world_dir=/nonexistent"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "did you mean ppo.kl_coef" in r.stderr


def test_help_text_wraps_every_line_at_width():
    from harness.schema import help_text

    lines = help_text(TrainConfig, width=100).splitlines()
    assert max(map(len, lines)) <= 100
    i = next(i for i, line in enumerate(lines) if line.startswith("  ppo.adv_estimator = "))
    assert lines[i + 1].startswith("      ") and "'remax')" in "".join(lines[i : i + 3])
