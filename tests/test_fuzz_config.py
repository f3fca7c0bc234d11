"""Generated bad configs: every leaf field of TrainConfig (and WorldConfig) given a wrong type, an
out-of-range value, a mistyped key and null, in a YAML file and as `--set`, plus broken files. Each
must end in a ConfigError that names the file (or --set) and the dotted field: never another
exception, never a run. The same cases go through `python -m harness.train` (in-process), which
must exit 2 with the message and no traceback.
"""
from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from harness.config import ConfigError, TrainConfig, load_config
from harness.schema import iter_fields, set_dotted
from harness.train import main as train_main
from harness.world.config import WorldConfig, load_world_config

from helpers import bad_values, field_parts, mistype, store_uri

LOADERS = {TrainConfig: load_config, WorldConfig: load_world_config}


def cases(cls: type) -> dict[str, list[tuple[str, Any, str]]]:
    """Field (or section) of `cls` -> its (dotted key to set, value, what): bad values, a mistyped key."""
    out: dict[str, list[tuple[str, Any, str]]] = {}
    for key, tp, _default, _doc, meta in iter_fields(cls):
        head, _, leaf = key.rpartition(".")
        typo = f"{head}.{mistype(leaf)}" if head else mistype(leaf)
        out[key] = [(key, value, what) for what, value in bad_values(tp, meta)] + [(typo, 1, "mistyped key")]
    for section in sorted({k.split(".")[0] for k, *_ in iter_fields(cls) if "." in k}):
        out[section] = [(section, None, "section null"), (section, 3, "section scalar"), (section, [1], "section list")]
    return out


FIELDS = [(cls, field, bad) for cls in LOADERS for field, bad in cases(cls).items()]
CASES = [(cls, key, value, what) for cls, _, bad in FIELDS for key, value, what in bad]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def test_every_leaf_field_gets_generated_cases():
    assert {k for cls in LOADERS for k, *_ in iter_fields(cls)} <= {f for _, f, _ in FIELDS} and len(CASES) > 400


@pytest.mark.parametrize("cls, field, bad", FIELDS, ids=[f"{c[0].__name__}:{c[1]}" for c in FIELDS])
def test_each_bad_field_is_a_config_error_naming_file_and_field(folder, cls, field, bad):
    for key, value, what in bad:
        path = folder / f"{cls.__name__}-{key}-{what}.yaml"
        path.write_text(yaml.safe_dump(set_dotted_copy(key, value)))
        over = [f"{key}={json.dumps(value)}"]  # JSON is YAML: the override parses back to the value
        for source, args in ((str(path), (path, None)), ("--set", (None, over))):
            with pytest.raises(ConfigError) as e:
                LOADERS[cls](*args)
            msg = str(e.value)
            assert re.search(rf"{re.escape(source)}: {re.escape(key)}[.:]", msg), (what, msg)
            if what == "mistyped key":
                assert f"{key}: unknown key; did you mean {field}?" in msg, msg


@pytest.mark.parametrize("what", ["wrong type (list)", "mistyped key", "section null"])
def test_the_train_cli_refuses_them_without_a_traceback(folder, capsys, what):
    """Every generated case of one kind through `python -m harness.train` (in-process): exit 2."""
    for cls, key, value, kind in CASES:
        if cls is TrainConfig and kind == what:
            path = folder / f"cli-{key}.yaml"
            path.write_text(yaml.safe_dump(set_dotted_copy(key, value)))
            assert train_main([str(path), "--print-config"]) == 2
            assert train_main(["--set", f"{key}={json.dumps(value)}", "--print-config"]) == 2
            err = capsys.readouterr().err
            assert f"{path}: {key}" in err and f"--set: {key}" in err and "Traceback" not in err, err


def set_dotted_copy(key: str, value: Any) -> dict[str, Any]:
    data: dict[str, Any] = {}
    set_dotted(data, key, value)
    return data


@pytest.mark.parametrize("cls", list(LOADERS))
def test_null_is_accepted_exactly_for_optional_fields(cls):
    for key, tp, *_ in iter_fields(cls):
        if field_parts(tp, [])[0]:
            LOADERS[cls](None, {key: None})


FILES: dict[str, tuple[bytes, str]] = {
    "non-UTF-8": (b"seed: 1\ncomment: caf\xe9\n", "line 2: not UTF-8 text"),
    "UTF-16": ("seed: 1\n".encode("utf-16-le"), "NUL"),
    "BOM then a bad value": ("\ufeffseed: -1\n".encode(), "seed: got -1"),
    "empty": (b"", "the file is empty (or only comments)"),
    "only whitespace": (b"  \n\n", "the file is empty (or only comments)"),
    "comment-only": (b"# seed: 3\n", "the file is empty (or only comments)"),
    "duplicate top key": (b"seed: 1\nseed: 2\n", "duplicate key 'seed'"),
    "duplicate nested key": (b"model:\n  n_layer: 1\n  n_layer: 2\n", "duplicate key 'n_layer'"),
    "list at top level": (b"- seed: 1\n- seed: 2\n", "top level must be a mapping of keys, got list"),
    "scalar at top level": (b"42\n", "top level must be a mapping of keys, got int"),
    "text at top level": (b"just words\n", "top level must be a mapping of keys, got str"),
    "tab indentation": (b"model:\n\tn_layer: 3\n", "not valid YAML"),
    "unclosed bracket": (b"model: {n_layer: 3\n", "not valid YAML"),
    "python tag": (b"seed: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
    "NUL byte": (b"seed: 1\x00\n", "contains NUL bytes"),
    "int key": (b"1: 2\n", "1: unknown key"),
    "null key": (b"~: 2\n", "None: unknown key"),
    "date for a number": (b"seed: 2024-01-01\n", "seed: got datetime.date(2024, 1, 1)"),
}


@pytest.mark.parametrize("name", list(FILES))
def test_each_broken_file_is_a_config_error_naming_the_file(tmp_path, capsys, name):
    content, expected = FILES[name]
    path = tmp_path / "broken.yaml"
    path.write_bytes(content)
    for load in LOADERS.values():
        with pytest.raises(ConfigError) as e:
            load(path)
        assert str(path) in str(e.value) and expected in str(e.value), str(e.value)
    assert train_main([str(path), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and expected in err and "Traceback" not in err


@pytest.mark.parametrize("path_kind", ["missing", "directory"])
def test_a_missing_file_or_a_directory_is_a_config_error(tmp_path, path_kind):
    path = tmp_path / "nope.yaml"
    if path_kind == "directory":
        path.mkdir()
    with pytest.raises(ConfigError, match="not found"):
        load_config(path)


RUN_CASES = {  # valid values this run cannot use: the trainer's CLI refuses each before any MLflow run exists
    "logging.parent_run_id=deadbeef": "logging.parent_run_id: got 'deadbeef'; the store sqlite:///",
    "generation.max_new_tokens=100000": "generation.max_new_tokens: got 100000; allowed: less than the policy's context",
}


@pytest.mark.parametrize("override", list(RUN_CASES))
def test_values_this_run_cannot_use_exit_2_before_any_run_exists(tiny_world, tmp_path, capsys, override):
    from harness import tracking

    from helpers import fast_overrides

    over = fast_overrides(tiny_world, tmp_path) + [override]
    assert train_main([x for o in over for x in ("--set", o)]) == 2
    err = capsys.readouterr().err
    assert RUN_CASES[override] in err and "Traceback" not in err, err
    store = tracking.client(store_uri(tmp_path))
    assert store.get_experiment_by_name("harness") is None  # no run, not even its experiment


def test_a_learning_rate_that_blows_the_weights_up_fails_the_run_naming_it(tiny_world, tmp_path, capsys):
    """1e308 is a valid float: the run starts, and ends FAILED with the reason, not an index error."""
    from helpers import fast_overrides

    over = fast_overrides(tiny_world, tmp_path, **{"ppo.num_minibatches": 1, "ppo.policy_lr": 1e308})
    assert train_main([x for o in over for x in ("--set", o)]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "FAILED" and "the policy's weights/logits became non-finite" in result["error"]


@pytest.mark.parametrize("item", ["novalue", "=3", "ppo..steps=3", ".seed=1", "seed.=1"])
def test_malformed_overrides_are_config_errors(item):
    with pytest.raises(ConfigError) as e:
        load_config(None, [item])
    assert "--set" in str(e.value)
