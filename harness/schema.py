"""The one validation engine for every YAML file the project reads: `@section` classes are pydantic
dataclasses with a docstring under every field (the source of `--help`). YAML is read safely
(duplicate keys, non-UTF-8 bytes and non-mapping tops are errors); every problem becomes one line
naming the file (or `--set`), the dotted field, the value and what is allowed, with one hint:

    config.yaml: ppo.kl_cof: unknown key; did you mean ppo.kl_coef?
    --set: ppo.clip_eps: got 5; allowed: a number > 0 and <= 1 or null
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Literal, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, Strict, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as _pydantic_dataclass


def section(cls: type) -> type:
    """Make `cls` a validated config section: unknown keys are errors, docstrings document fields."""
    return _pydantic_dataclass(cls, config=ConfigDict(extra="forbid", use_attribute_docstrings=True,
                                                      validate_assignment=True))


def _integral(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**63 else v


# Value types for fields. Strict: true/false, 1 and "yes" are not interchangeable, and "3" is not
# a number; an integral float (YAML `1e3`) is an integer and an integer is a float.
Int = Annotated[int, Strict(), BeforeValidator(_integral)]
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
Pos = Annotated[Float, Field(gt=0)]
NonNeg = Annotated[Float, Field(ge=0)]
Unit = Annotated[Float, Field(ge=0, le=1)]
Seed = Annotated[Int, Field(ge=0, le=2**31 - 1)]
"""0 .. 2**31-1: what numpy, torch and Python's random all accept."""
MAX_COUNT = 10_000_000
Count = Annotated[Int, Field(ge=0, le=MAX_COUNT)]
"""Steps, warmups, 'every N' intervals and sizes of generated data: large, never absurd."""
PosCount = Annotated[Int, Field(ge=1, le=MAX_COUNT)]
Batch = Annotated[Int, Field(ge=1, le=65536)]


class ConfigError(ValueError):
    """Bad input; the message lists every problem found, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid config:\n  - " + "\n  - ".join(self.problems))


# -- Reading YAML -----------------------------------------------------------------------------------
class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """Safe loader that refuses duplicate keys, reads `1e-5` as a number (YAML 1.1 needs a dot) and,
    as YAML 1.2, only true/false as booleans (`yes`, `no`, `on`, `off` are strings, so a boolean
    field given `yes` is an error rather than a guess). It parses with libyaml where PyYAML was built
    with it (~10x faster than the pure-Python parser; the same safe constructor and resolvers)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)
_Loader.yaml_implicit_resolvers = {  # the class's own copy (add_implicit_resolver made it)
    c: [(tag, rx) for tag, rx in rs if tag != "tag:yaml.org,2002:bool"]
    for c, rs in _Loader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1}); each key may appear once",
                key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def parse_yaml(text: str, source: str) -> Any:
    """YAML text -> Python data; errors name the source and line."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as e:
        raise ConfigError([f"{source}: not valid YAML: {e}"]) from None


def read_yaml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """Read one YAML file whose top level is a mapping; every failure is a ConfigError naming it."""
    p = Path(path)
    src = str(p)
    if not p.is_file():
        raise ConfigError([f"{what} {src!r}: not found" + (" (it is a directory)" if p.is_dir() else "")])
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a UTF-8 byte-order mark is not part of the content
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError([f"{src}: line {line}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}); "
                           "save the file as UTF-8"]) from None
    if "\x00" in text:
        raise ConfigError([f"{src}: contains NUL bytes; allowed: a UTF-8 YAML text file"])
    data = parse_yaml(text, src)
    if data is None:
        raise ConfigError([f"{src}: the file is empty (or only comments); allowed: a mapping of settings"])
    if not isinstance(data, dict):
        raise ConfigError([f"{src}: top level must be a mapping of keys, got {type(data).__name__}"])
    return data


# -- Validation -------------------------------------------------------------------------------------
def closest(word: Any, options: typing.Iterable[str]) -> str | None:
    """The one closest option to a mistyped word, or None when nothing is close."""
    hits = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.5)
    return hits[0] if hits else None


def did_you_mean(word: Any, options: typing.Iterable[str], prefix: str = "") -> str:
    """'; did you mean X?' or '; allowed: a, b, c' when nothing is close."""
    opts = list(options)
    hit = closest(word, opts)
    return f"; did you mean {prefix}{hit}?" if hit else f"; allowed: {', '.join(prefix + o for o in opts)}"


def one_of(options: tuple[str, ...], what: str) -> AfterValidator:
    """A string field's check: one of `options`, else 'not WHAT; did you mean ...?'."""
    def check(value: str) -> str:
        if value not in options:
            raise ValueError(f"not {what}" + did_you_mean(value, options))
        return value
    return AfterValidator(check)


def _fields(cls: Any) -> dict[str, Any]:
    return getattr(cls, "__pydantic_fields__", {})


def _optional(tp: Any) -> tuple[bool, Any]:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) < len(get_args(tp)):
            return True, args[0] if len(args) == 1 else Union[tuple(args)]
    return False, tp


def base_type(tp: Any) -> tuple[bool, Any]:
    """(optional, the type under Optional and Annotated) of a field: `Pos | None` -> (True, float)."""
    opt, inner = _optional(tp)
    return opt, get_args(inner)[0] if get_origin(inner) is typing.Annotated else inner


_BOUNDS = (("gt", "> {}"), ("ge", ">= {}"), ("lt", "< {}"), ("le", "<= {}"), ("min_length", "at least {} long"),
           ("max_length", "at most {} long"), ("pattern", "matching {}"))
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
          list: "a list"}


def describe(tp: Any, metadata: typing.Iterable[Any] = ()) -> str:
    """Human words for what a field allows ('a number > 0 and <= 1 or null')."""
    opt, inner = _optional(tp)
    if get_origin(inner) is typing.Annotated:
        inner, *more = get_args(inner)
        metadata = [*metadata, *more]
    # Field(...) inside Annotated arrives as a FieldInfo whose own metadata holds the bounds
    metadata = [x for m in metadata for x in ([m, *m.metadata] if hasattr(m, "metadata") else [m])]
    bounds = []
    for m in metadata:
        for attr, text in _BOUNDS:
            v = getattr(m, attr, None)
            if v is not None:
                bounds.append(text.format(f"{v:g}" if isinstance(v, float) else v))
    if get_origin(inner) is Literal:
        s = "one of " + ", ".join(repr(a) for a in get_args(inner))
    elif get_origin(inner) in (Union, types.UnionType):
        s = " or ".join(describe(a) for a in get_args(inner))
    elif dataclasses.is_dataclass(inner):
        s = "a section with keys " + ", ".join(_fields(inner))
    else:
        s = _KINDS.get(get_origin(inner) or inner) or getattr(inner, "__name__", str(inner))
    if bounds:
        s += " " + " and ".join(bounds)
    return s + (" or null" if opt else "")


def _walk(cls: Any, loc: tuple) -> tuple[str, Any, list]:
    """Follow an error location through the sections: (dotted field, annotation, metadata)."""
    names: list[str] = []
    tp: Any = cls
    meta: list = []
    for part in loc:
        inner = base_type(tp)[1]
        if isinstance(part, int) and get_origin(inner) in (Union, types.UnionType):  # `int | list[int]`: the list
            inner = next((a for a in get_args(inner) if get_origin(a) in (dict, list)), inner)
        fields = _fields(inner)
        if isinstance(part, str) and part in fields:
            names.append(part)
            tp, meta = fields[part].annotation, list(fields[part].metadata)
        elif isinstance(part, (str, int)) and get_origin(inner) in (dict, list) or isinstance(part, int):
            names.append(str(part))
            args = get_args(inner)
            tp, meta = (args[-1] if args else Any), []
        elif isinstance(part, str) and not fields:
            continue  # a union member's tag ('float', 'function-after[...]'): not a field
        else:
            names.append(str(part))
    return ".".join(names), tp, meta


def _problem(cls: Any, err: dict, prefix: str) -> str:
    loc = tuple(err["loc"])
    if err["type"] in ("unexpected_keyword_argument", "extra_forbidden", "invalid_key"):  # invalid: not text
        path, tp, _ = _walk(cls, loc[:-1])
        head = f"{prefix}{path}." if path else prefix
        return f"{head}{loc[-1]}: unknown key" + did_you_mean(loc[-1], _fields(tp), head)
    path, tp, meta = _walk(cls, loc)
    value = err.get("input")
    name = f"{prefix}{path}" if path else (prefix.rstrip(".") or "config")
    if err["type"] in ("missing", "missing_argument", "missing_keyword_only_argument"):
        # pydantic's input here is the whole section around the field (a whole figure file): not shown
        return f"{name}: missing; allowed: {describe(tp, meta)}"
    if err["type"] in ("value_error", "assertion_error"):
        return f"{name}: got {value!r}; " + str(err.get("ctx", {}).get("error", err["msg"]))
    inner = _optional(tp)[1]
    literal = err["type"] == "literal_error" and get_origin(inner) is Literal
    hit = closest(value, map(str, get_args(inner))) if literal else None
    return f"{name}: got {value!r}; allowed: {describe(tp, meta)}" + (f" (did you mean {hit!r}?)" if hit else "")


def validate(cls: type, data: Any, source: str | None = None, prefix: str = "") -> Any:
    """Validate nested data into the section `cls`; raise ConfigError naming source and fields."""
    try:
        return TypeAdapter(cls).validate_python({} if data is None else data)
    except ValidationError as e:
        head = f"{source}: " if source else ""
        raise ConfigError(list(dict.fromkeys(head + _problem(cls, err, prefix) for err in e.errors()))) from None


to_dict = dataclasses.asdict


# -- Files plus command-line overrides --------------------------------------------------------------
def parse_value(text: str) -> Any:
    """An override's value read the way the YAML file would be (`0.1`, `1e-5`, `true`, `null`, `[a, b]`)."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError:
        return text


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[last] = value


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """['ppo.kl_coef=0.1', ...] -> {'ppo.kl_coef': 0.1}."""
    out: dict[str, Any] = {}
    for item in items or []:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise ConfigError([f"--set {item!r}: expected KEY=VALUE, e.g. ppo.kl_coef=0.1"])
        out[k.strip()] = parse_value(v.strip())
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `over` into a copy of `base`; dotted keys in `over` address nested fields."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if "." in k:
            set_dotted(out, k, v)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def load(cls: type, path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None,
         checks: Callable[[Any], list[str]] | None = None) -> Any:
    """YAML file (optional) + overrides (`["rm.steps=100"]` or `{"rm.steps": 100}`) -> section `cls`.
    `checks(obj)` returns the problems of rules that span fields. Every problem line starts with
    where its value came from: the file, or the overrides (`--set` from the command line)."""
    data = read_yaml(path) if path else {}
    over = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides or {})
    label = "--set" if isinstance(overrides, list) else "overrides"
    try:
        obj = validate(cls, merge(data, over))
        problems = checks(obj) if checks else []
    except ConfigError as e:
        problems = e.problems
    if problems:
        def origin(problem: str) -> str:
            key = problem.split(":", 1)[0]
            if any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in over):
                return label
            return str(path) if path else label if over else "defaults"

        raise ConfigError([f"{origin(p)}: {p}" for p in problems])
    return obj


# -- Documentation from the sections (--help, README tables) ----------------------------------------
def iter_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, Any, str, list]]:
    """(dotted key, annotation, default, docstring, metadata) for every leaf field of a section."""
    for f in dataclasses.fields(cls):
        info = _fields(cls)[f.name]
        tp = info.annotation
        _, inner = _optional(tp)
        if dataclasses.is_dataclass(inner):
            yield from iter_fields(inner, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        yield f"{prefix}{f.name}", tp, default, info.description or "", list(info.metadata)


def leaf_keys(cls: type) -> list[str]:
    return [k for k, *_ in iter_fields(cls)]


def help_text(cls: type, width: int = 100) -> str:
    """Every field as `key = default   (allowed)` with its docstring under it, both wrapped at `width`."""
    lines: list[str] = []
    section_name = None
    for key, tp, default, doc, meta in iter_fields(cls):
        sec = key.rsplit(".", 1)[0] if "." in key else ""
        if sec != section_name:
            section_name = sec
            lines.append(f"\n[{sec or 'top level'}]")
        head = f"{key} = {json.dumps(default, default=str)}   ({describe(tp, meta)})"
        lines += textwrap.wrap(head, width=width, initial_indent="  ", subsequent_indent="      ",
                               break_long_words=False, break_on_hyphens=False)
        if doc:
            lines += textwrap.wrap(doc, width=width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)
