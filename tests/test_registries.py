"""One place per name (issue 36, item 4): an advantage estimator or a policy loss is added by
registering it in its module; the config's allowed values, its needs (critic, groups) and the tests'
lists come from that registration, read without importing torch (harness.algorithms.names)."""
from __future__ import annotations

import inspect
import subprocess
import sys
import typing

import pytest

from harness.algorithms import names


def test_loading_a_config_imports_no_torch():
    code = ("import sys; from harness.config import load_config; load_config(None, ['ppo.policy_loss=gspo', "
            "'ppo.loss_aggregation=seq_mean_token_mean']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_the_names_read_are_the_registries():
    from harness.algorithms.estimators import ADV_ESTIMATORS
    from harness.algorithms.losses import POLICY_LOSSES

    assert names.ADV_ESTIMATORS == tuple(ADV_ESTIMATORS) and names.POLICY_LOSSES == tuple(POLICY_LOSSES)
    for read, live in ((names.ESTIMATOR_INPUTS, ADV_ESTIMATORS), (names.POLICY_LOSS_INPUTS, POLICY_LOSSES)):
        assert read == {n: tuple(inspect.signature(fn).parameters) for n, fn in live.items()}


def test_config_allows_exactly_the_registered_names():
    from harness.config import PPOConfig

    hints = typing.get_type_hints(PPOConfig)
    assert typing.get_args(hints["adv_estimator"]) == names.ADV_ESTIMATORS
    assert typing.get_args(hints["policy_loss"]) == names.POLICY_LOSSES
    assert typing.get_args(hints["loss_aggregation"]) == names.LOSS_AGGREGATIONS


def test_a_bad_value_names_the_registered_ones():
    from harness.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["ppo.policy_loss=gpso"])
    allowed = ", ".join(map(repr, names.POLICY_LOSSES))
    assert e.value.problems == [f"--set: ppo.policy_loss: got 'gpso'; allowed: one of {allowed} (did you mean 'gspo'?)"]


def test_a_registration_the_reader_cannot_see_is_refused():
    from harness.algorithms.estimators import register_adv_est
    from harness.algorithms.losses import register_policy_loss

    def made_at_run_time(logprobs, old_logprobs, advantages, **_):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="'made_up'.*register it with a literal name"):
        register_policy_loss("made_up")(made_at_run_time)
    with pytest.raises(ValueError, match="registered twice"):
        register_adv_est("gae")(made_at_run_time)
    with pytest.raises(ValueError, match="'ppo': registered with inputs"):  # a name read, but another signature
        from harness.algorithms import losses

        saved = losses.POLICY_LOSSES.pop("ppo")
        try:
            register_policy_loss("ppo")(made_at_run_time)
        finally:
            losses.POLICY_LOSSES["ppo"] = saved


def test_the_reader_needs_literal_names(tmp_path, monkeypatch):
    (tmp_path / "fake.py").write_text(
        "@register_x('a')\ndef a(x, *, values, **_): ...\n\n"
        "@other('b')\ndef b(x): ...\n\n"
        "@register_x('c')\ndef c(group): ...\n")
    monkeypatch.setattr(names, "HERE", tmp_path)
    assert names.registered("fake", "register_x") == {"a": ("x", "values", "_"), "c": ("group",)}
    (tmp_path / "bad.py").write_text("NAME = 'd'\n\n@register_x(NAME)\ndef d(x): ...\n")
    with pytest.raises(ValueError, match=r"bad.py:3: @register_x takes one literal name"):
        names.registered("bad", "register_x")
