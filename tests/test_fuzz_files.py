"""Generated bad figure files and sweep files, through the CLIs' dry runs (in-process).

Every leaf of real files (ablations/kl_eta.yaml: grid, profile, trend claims; estimators.yaml:
variants, inherit, literature claims; rm_accuracy.yaml: kind world; sweep_delta_eta.yaml) is given
the values its field must refuse (derived from the field's type in the schema: harness/registry.py's
FigureFile, harness/sweep.py's SweepFile, TrainConfig/WorldConfig for the keys of `set`, `axes`,
`search_space`), a mistyped key, null; every section is nulled and every required key removed; then
broken files (empty, non-UTF-8, duplicate keys) and bad CLI input (seeds, --set, path-like names).
Each case must end in an error naming the file (or the flag) and the field, exit 2 without a
traceback and before any MLflow or Optuna store exists; the unchanged copies dry-run.
"""
from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml

from harness import ablate, sweep, sweepfile
from harness.config import TrainConfig
from harness.registry import ABLATIONS_DIR, FigureFile
from harness.rules import RULES
from harness.schema import iter_fields
from harness.world.config import WorldConfig

from helpers import bad_values, field_parts, mistype

FIGURE_FILES = ["kl_eta", "estimators", "rm_accuracy"]
SWEEP_FILE = "sweep_delta_eta"
STUDY_FILE = "study_tricks"  # a design: groups, choices drawn only `when`, worlds, objectives
SWEEP_FILES = [SWEEP_FILE, STUDY_FILE]
NO_WORLD = "holds no built world"  # the sweep's preflight on a machine without the world: not the case's error


def config_field(cls: type, key: str) -> tuple[Any, list] | None:
    """(annotation, metadata) of a leaf key of a config class, or None."""
    return next(((tp, meta) for k, tp, _d, _doc, meta in iter_fields(cls) if k == key), None)


def section_field(cls: Any, path: list[str]) -> tuple[Any, list] | None:
    """(annotation, metadata) of the field at `path` inside section `cls` (list items by index)."""
    tp, meta = cls, []
    for part in path:
        inner = field_parts(tp, [])[1]
        if part.isdigit() and get_origin(inner) in (typing.Union, types.UnionType):  # `int | list[int]`
            inner = next((a for a in get_args(inner) if get_origin(a) is list), inner)
        fields = getattr(inner, "__pydantic_fields__", {})
        if part in fields:
            tp, meta = fields[part].annotation, list(fields[part].metadata)
        elif get_origin(inner) in (list, dict) and get_args(inner):
            tp, meta = get_args(inner)[-1], []
        else:
            return None
    return tp, meta


def figure_schema(data: dict[str, Any], path: list[str]) -> tuple[Any, list, str] | None:
    """(annotation, metadata, the field an error must name) of a leaf of a figure file."""
    config = WorldConfig if data.get("kind") == "world" else TrainConfig
    for head in (["set"], ["variants", "*", "set"], ["profiles", "*", "set"], ["profiles", "*", "variant_set", "*"],
                 ["grid", "axes"]):
        if len(path) > len(head) and all(h in ("*", p) for h, p in zip(head, path)):
            rest = path[len(head):]
            key = rest[0] if len(rest) == 1 or "." in rest[0] else ".".join(rest)
            found = config_field(config, key)
            return found and (*found, key)
    if path[:1] == ["claims"] and len(path) > 3 and path[2] == "rule":
        rule = RULES.get(data["claims"][int(path[1])]["rule"].get("kind"))
        found = rule and section_field(rule, path[3:])
        return found and (*found, ".".join(path))
    found = section_field(FigureFile, path)
    return found and (*found, ".".join(path))


def sweep_schema(data: dict[str, Any], path: list[str]) -> tuple[Any, list, str] | None:
    """The same for a sweep file (search-space bounds are values of their TrainConfig key; a group's
    settings, a choice's values and its `otherwise` are values of their config key)."""
    if path[0] == "set" and len(path) == 2:
        found = config_field(TrainConfig, path[1])
        return found and (*found, path[1])
    if path[0] == "first_trials":
        return None  # free keys: checked against the search space (cases below)
    if path[0] == "search_space" and len(path) == 5 and path[2] == "group":
        found = config_field(TrainConfig, path[4])
        return found and (*found, path[4])
    if path[0] == "search_space" and len(path) > 2 and (path[2] in ("otherwise", "choices") or path[2].isdigit()):
        found = config_field(TrainConfig, path[1])
        return found and (*found, path[1])
    found = section_field(sweepfile.Dimension, path[2:]) if path[0] == "search_space" and len(path) == 3 else \
        section_field(sweepfile.SweepFile, path)
    return found and (*found, ".".join(path))


def leaves(data: Any, path: tuple = ()) -> typing.Iterator[tuple[list[str], Any]]:
    """(path, value) of every scalar in nested data; dotted keys stay one part (`ppo.kl_coef`)."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else None
    if items is None:
        yield [str(p) for p in path], data
        return
    for k, v in items:
        yield from leaves(v, (*path, k))


def sections(data: Any, path: tuple = ()) -> typing.Iterator[list[str]]:
    """Paths of every mapping and list below the top."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else []
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield [str(p) for p in (*path, k)]
            yield from sections(v, (*path, k))


def get(data: Any, path: list[str]) -> Any:
    for p in path:
        data = data[int(p)] if isinstance(data, list) else data[p]
    return data


def mutated(data: dict[str, Any], path: list[str], value: Any = None, *, rename: str | None = None,
            delete: bool = False) -> dict[str, Any]:
    out = copy.deepcopy(data)
    parent, last = get(out, path[:-1]), path[-1]
    key = int(last) if isinstance(parent, list) else last
    if delete:
        del parent[key]
    elif rename is not None:
        parent[rename] = parent.pop(key)
    else:
        parent[key] = value
    return out


@dataclasses.dataclass
class Case:
    file: str
    what: str
    data: dict[str, Any]
    names: str
    """The field the error must name (a dotted path, or a config key)."""


def required(tp: Any) -> list[str]:
    """The fields of a section without a default."""
    inner = field_parts(tp, [])[1]
    return [f.name for f in dataclasses.fields(inner) if f.default is f.default_factory is dataclasses.MISSING] \
        if dataclasses.is_dataclass(inner) else []


def own_values(key: str) -> bool:
    """A config key whose field has a finite set of values (bool, Literal): a search space may leave them out."""
    found = config_field(TrainConfig, key)
    base = field_parts(found[0], [])[1] if found else None
    return base is bool or get_origin(base) is Literal


def one_type(tp: Any) -> bool:
    """Not a union of several types (`seeds: 3` and `seeds: [0, 1]` are both valid)."""
    union = get_origin(tp) in (typing.Union, types.UnionType)
    return len([a for a in get_args(tp) if a is not type(None)] if union else [tp]) == 1


def generated(file: str) -> list[Case]:
    """Bad values for every leaf, a mistyped key for every mapping key, null/scalar for every
    section, the removal of every key its section requires."""
    data = yaml.safe_load((ABLATIONS_DIR / f"{file}.yaml").read_text())
    if "base" in data:  # the copy lies in tmp_path; a sweep reads its base beside it
        data["base"] = str(ABLATIONS_DIR / data["base"])
    schema_of = sweep_schema if file in SWEEP_FILES else figure_schema
    out = []
    for path, _ in leaves(data):
        found = schema_of(data, path)
        if found and one_type(found[0]):
            tp, meta, field = found
            out += [Case(file, f"{'.'.join(path)}: {what}", mutated(data, path, v), field)
                    for what, v in bad_values(tp, meta)]
        elif path[0] == "first_trials" or path[-2:-1] == ["grid"]:  # values the sampler must be able to draw
            out += [Case(file, f"{'.'.join(path)}: {what}", mutated(data, path, v), ".".join(path))
                    for what, v in (("text", "zzz"), ("out of range", 1e6), ("null", None), ("bool", True))]
        elif path[0] == "search_space" and path[2:3] == ["when"]:  # a value the parent choice never takes
            out += [Case(file, f"{'.'.join(path)}: {what}", mutated(data, path, v), ".".join(path[:4]))
                    for what, v in (("text", "zzz"), ("out of range", 1e6))]
        elif path[0] == "objectives" and path[-1] == "metric":  # a metric every run must log
            out += [Case(file, f"{'.'.join(path)}: {what}", mutated(data, path, v), ".".join(path))
                    for what, v in (("unknown", "objective/zzz"), ("int", 7), ("a world-build metric", "rm/eval_acc"))]
    for path in [p for p, _ in leaves(data)] + list(sections(data)):
        free = path[:-1] == ["profiles"] or (path[0] == "search_space" and path[2:3] == ["group"] and len(path) == 4)
        if isinstance(get(data, path[:-1]), dict) and not free:  # a profile's and a group value's name are free
            typo = mistype(path[-1])
            out.append(Case(file, f"{'.'.join(path)}: mistyped key", mutated(data, path, rename=typo), typo))
    for path in sections(data):
        found = schema_of(data, path)
        if found and path[-1] != "set" and one_type(found[0]):  # an empty `set` is no overrides
            # a search-space key (or its `choices`) left null means the field's own values, if it has some
            own = path[0] == "search_space" and len(path) > 1 and path[2:] in ([], ["choices"]) and own_values(path[1])
            bad = [("scalar", 3)] + ([] if field_parts(found[0], [])[0] or own else [("null", None)])
            out += [Case(file, f"{'.'.join(path)}: section {what}", mutated(data, path, v), ".".join(path))
                    for what, v in bad]
    for path in [[]] + list(sections(data)):
        found = (FigureFile if file not in SWEEP_FILES else sweepfile.SweepFile, []) if not path else schema_of(data, path)
        node = get(data, path)
        if found and isinstance(node, dict):
            out += [Case(file, f"{'.'.join([*path, k])}: missing", mutated(data, [*path, k], delete=True), k)
                    for k in required(found[0]) if k in node]
    return out


DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml: the ~600 cases are written in seconds
CASES = [c for f in [*FIGURE_FILES, *SWEEP_FILES] for c in generated(f)]


def test_cases_cover_every_leaf_of_each_file():
    for f in [*FIGURE_FILES, *SWEEP_FILES]:
        data = yaml.safe_load((ABLATIONS_DIR / f"{f}.yaml").read_text())
        covered = {c.what.split(":")[0] for c in CASES if c.file == f}
        assert {".".join(p) for p, _ in leaves(data)} <= covered, f
    assert len(CASES) > 500


@pytest.mark.parametrize("file", [*FIGURE_FILES, *SWEEP_FILES])
def test_every_generated_case_is_refused_by_the_cli_naming_file_and_field(tmp_path, monkeypatch, capsys, file):
    """Bad values were derived from the field's type, so each must be refused, through
    `python -m harness.ablate FILE --dry-run` / `harness.sweep FILE --dry-run` (in-process): exit 2,
    the file and field on stderr, no traceback, no MLflow or Optuna store."""
    monkeypatch.chdir(tmp_path)
    main = sweep.main if file in SWEEP_FILES else ablate.main
    accepted, unnamed = [], []
    for case in (c for c in CASES if c.file == file):
        path = tmp_path / f"{file}.yaml"  # the name must stay the stem
        path.write_text(yaml.dump(case.data, Dumper=DUMPER, allow_unicode=True))
        rc, err = main([str(path), "--dry-run"]), capsys.readouterr().err
        problems = [line for line in err.splitlines() if line.startswith("  - ") and NO_WORLD not in line]
        if rc != 2 or not problems:
            accepted.append(case.what)
        elif not all(str(path) in p for p in problems) or "Traceback" in err or not re.search(
                rf"(^|[ .'\"(]){re.escape(case.names)}([.:' ]|$)", err, re.M):
            unnamed.append((case.what, err))
        elif case.what.endswith(": missing") and not any(
                re.search(rf"[ .]{re.escape(case.names)}: missing; allowed: ", p) and len(p) < 400 for p in problems):
            unnamed.append((case.what, err))  # named as missing, without its whole section (the file) as the value
    assert not accepted, f"silently accepted: {accepted}"
    assert not unnamed, "\n\n".join(f"{w}:\n{m}" for w, m in unnamed[:5])
    assert not list(tmp_path.glob("*.db")) and not (tmp_path / "runs").exists()


BROKEN: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "the file is empty (or only comments)"),
    "comment-only": (b"# name: x\n", "the file is empty (or only comments)"),
    "non-UTF-8": (b"name: x\ntitle: caf\xe9\n", "line 2: not UTF-8 text"),
    "NUL byte": (b"name: x\x00\n", "contains NUL bytes"),
    "duplicate key": (b"name: x\nseeds: [0]\nseeds: [1]\n", "duplicate key 'seeds'"),
    "a list": (b"- name: x\n", "top level must be a mapping of keys, got list"),
    "bad YAML": (b"name: [x\n", "not valid YAML"),
}


@pytest.mark.parametrize("kind", ["figure", "sweep"])
@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_files_are_refused_naming_the_file(tmp_path, capsys, kind, name):
    content, expected = BROKEN[name]
    path = tmp_path / "x.yaml"
    path.write_bytes(content)
    assert (ablate.main if kind == "figure" else sweep.main)([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and expected in err and "Traceback" not in err, err


def figure_copy(tmp_path: Path, file: str = "kl_eta", **changes: Any) -> Path:
    data = yaml.safe_load((ABLATIONS_DIR / f"{file}.yaml").read_text())
    path = tmp_path / f"{file}.yaml"
    base = {"base": str(ABLATIONS_DIR / data["base"])} if "base" in data else {}
    path.write_text(yaml.safe_dump({**data, **changes, **base}, allow_unicode=True))
    return path


LONG = "v" * 201
FIGURE_CLI = {  # extra arguments or file changes -> what the error says
    "seeds empty": (["--seeds", ""], "--seeds '': allowed: 1 to 1000 seeds"),
    "seeds not numbers": (["--seeds", "a,b"], "--seeds 'a,b': expected integers"),
    "worlds not numbers": (["--worlds", "x"], "--worlds 'x': expected integers"),
    "seeds 22 digits": (["--seeds", "1" * 22], f"--seeds '{'1' * 22}': '{'1' * 22}': allowed: seeds in 0..2147483647"),
    "seeds negative": (["--seeds", "-1"], "--seeds '-1': expected integers"),
    "seeds empty item": (["--seeds", "1,,2"], "--seeds '1,,2': an empty item between commas"),
    "seeds trailing comma": (["--seeds", "0,"], "--seeds '0,': an empty item between commas"),
    "seeds reversed range": (["--seeds", "5-2"], "'5-2': allowed: seeds in"),
    "seeds huge range": (["--seeds", "0-2147483647"], "at most 1000 seeds"),
    "set without =": (["--set", "ppo.steps"], "--set 'ppo.steps': expected KEY=VALUE"),
    "set unknown key": (["--set", "ppo.kl_cof=1"], "--set: ppo.kl_cof: unknown config key; did you mean ppo.kl_coef?"),
    "set bad value": (["--set", "ppo.steps=-3"], "ppo.steps: got -3"),
    "set a section": (["--set", "ppo=3"], "--set: ppo: unknown config key"),
    "set empty key": (["--set", "=3"], "expected KEY=VALUE"),
    "unknown scale": (["--scale", "papr"], "--scale papr: this file has no profiles.papr; available scales: world, paper"),
    "unknown variant": (["--variant", "KL penalty η=0.5"], "--variant 'KL penalty η=0.5': not in kl_eta.yaml"),
    "variant name empty": ({"grid": None, "variants": [{"name": ""}]}, "variants.0.name: got ''"),
    "variant name too long": ({"grid": None, "variants": [LONG]}, f"variants.0.name: got '{LONG}'"),
    "variant name NUL": ({"grid": None, "variants": ["a\x00b"]}, "variants.0.name: got 'a\\x00b'"),
    "variant names one folder": ({"grid": None, "variants": ["a/b", "a b"]}, "has the same folder name as 'a/b'"),
    "seeds twice in the file": ({"seeds": [0, 0]}, "seeds: got [0, 0]; a seed is listed twice"),
    "seed 22 digits in the file": ({"seeds": [10**22]}, "seeds.0: got 10000000000000000000000"),
    "reference worlds twice": ({"reference_worlds": [1, 1]}, "reference_worlds: got [1, 1]; a world seed is listed twice"),
    "reference worlds one": ({"reference_worlds": [0]}, "reference_worlds: got [0]"),
    "reference worlds text": ({"reference_worlds": "0,1,2"}, "reference_worlds: got '0,1,2'"),
    "seeds empty in the file": ({"seeds": []}, "seeds: got []"),
    "name a path": ({"name": "../kl_eta"}, "name: '../kl_eta' must equal the file stem 'kl_eta'"),
    "grid axis without values": ({"grid": {"name": "η={ppo.kl_coef}", "axes": {"ppo.kl_coef": [0.1], "reward.clip": []}}},
                                 "grid.axes.reward.clip: got []; allowed: a list of at least one value"),
    "grid of one axis without values": ({"grid": {"axes": {"reward.clip": []}}}, "grid.axes.reward.clip: got []"),
}


@pytest.mark.parametrize("case", list(FIGURE_CLI))
def test_bad_figure_cli_input_is_refused_naming_flag_or_field(tmp_path, monkeypatch, capsys, case):
    monkeypatch.chdir(tmp_path)
    change, expected = FIGURE_CLI[case]
    args = change if isinstance(change, list) else []
    path = figure_copy(tmp_path, **(change if isinstance(change, dict) else {}))
    assert ablate.main([str(path), "--dry-run", *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("*.db")) and not (tmp_path / "runs").exists()


SWEEP_CLI = {
    "trials 0": (["--trials", "0"], "--trials: got 0; allowed: an integer >= 1"),
    "workers negative": (["--workers", "-1"], "--workers: got -1; allowed: an integer >= 0"),  # 0: in this process
    "seeds empty": (["--set", "sweep.seeds="], "seeds: got None"),
    "seeds text": (["--set", "sweep.seeds=0,0"], "seeds: got '0,0'"),
    "seeds twice": (["--set", "sweep.seeds=[0, 0]"], "seeds: got [0, 0]; allowed: a count >= 1 or a list of distinct"),
    "seeds 22 digits": (["--set", f"sweep.seeds=[{10**22}]"], "seeds.0: got 10000000000000000000000; allowed: an integer >= 0 and <= 2147483647"),
    "seed count 22 digits": (["--set", f"sweep.seeds={10**22}"], "seeds: got 10000000000000000000000; allowed: an"),
    "name a path": (["--set", "sweep.name=.."], "name: got '..'; allowed: a string matching"),
    "unknown sweep field": (["--set", "sweep.trails=3"], "trails: unknown key; did you mean trials?"),
    "unknown train key": (["--set", "ppo.kl_cof=1"], "ppo.kl_cof: unknown key; did you mean ppo.kl_coef?"),
    "set without =": (["--set", "ppo.steps"], "--set 'ppo.steps': expected KEY=VALUE"),
    "axis bound": (["--set", "sweep.search_space.ppo.kl_coef.low=-1"], "search_space.ppo.kl_coef"),
}


@pytest.mark.parametrize("case", list(SWEEP_CLI))
def test_bad_sweep_cli_input_is_refused_naming_flag_or_field(tmp_path, monkeypatch, capsys, case):
    monkeypatch.chdir(tmp_path)
    args, expected = SWEEP_CLI[case]
    data = yaml.safe_load((ABLATIONS_DIR / f"{SWEEP_FILE}.yaml").read_text())
    path = tmp_path / f"{SWEEP_FILE}.yaml"
    path.write_text(yaml.safe_dump({**data, "base": str(ABLATIONS_DIR / data["base"])}, allow_unicode=True))
    assert sweep.main([str(path), "--dry-run", *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("*.db"))


@pytest.mark.parametrize("file", FIGURE_FILES)
def test_the_unchanged_copies_dry_run(tmp_path, monkeypatch, capsys, file):
    """The cases above differ from a valid file only by their mutation."""
    monkeypatch.chdir(tmp_path)
    rc = ablate.main([str(figure_copy(tmp_path, file)), "--dry-run", "--seeds", "0,0"])
    out, err = capsys.readouterr()
    assert "all configs valid" in out and "runs once" in out
    # valid, but a train grid cannot run where no world is built: a dry run says so (rc 2), and only that
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    assert (rc, problems) == (0, []) or (rc == 2 and problems and all(
        NO_WORLD in p or "harness.main" in p for p in problems)), err
