"""The ablation registry: one YAML per paper figure under `ablations/` (format in docs/CONTRACTS.md).

A registry file names a figure, a base config (`ablations/bases/*.yaml`), overrides shared by every
run (`set`), the seeds, and the grid: a list of named `variants` (each optionally `inherit`ing an
earlier one) and/or a product over `grid.axes`. `profiles` hold other scales (`--scale paper`).

    reg = load_registry("ablations/score_reparam.yaml")
    for run in reg.runs:          # one RunSpec per variant x seed, config resolved and validated
        print(run.variant, run.seed, run.config_hash, run.changed)

Everything is resolved and validated here, before anything runs: every top-level / variant /
grid / profile key is checked (unknown ones name the closest valid key), and every variant x seed
config goes through `harness.config.from_dict` (or the world's `WorldConfig` for `kind: world`).
Problems from all variants are reported together, each prefixed with the file and variant.

Order in which settings apply (later wins):
  base file -> profile overlay file -> `set` -> profile `set` -> variant (`inherit` chain, then its
  own `set`, or its grid point) -> profile `variant_set[variant]` -> command-line `--set` -> seed.
"""
from __future__ import annotations

import dataclasses
import difflib
import itertools
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import keys as K
from .config import ConfigError, TrainConfig, config_hash, flatten, from_dict, iter_fields, merge, read_yaml, to_dict

REPO_ROOT = Path(__file__).resolve().parents[1]
ABLATIONS_DIR = REPO_ROOT / "ablations"

KINDS = ("train", "world")
TOP_KEYS = ("name", "figure", "title", "description", "kind", "base", "set", "seeds", "variants", "grid", "panels", "profiles")
VARIANT_KEYS = ("name", "inherit", "set", "description")
GRID_KEYS = ("name", "axes")
PROFILE_KEYS = ("description", "overlay", "set", "seeds", "variant_set")
DEFAULT_SCALE = "world"  # no profile: the file's own settings (the embedded world on CPU)

# Panels beside metric keys (docs/CONTRACTS.md).
SPECIAL_PANELS = ("rm_score_diff_hist", "rm_accuracy", "eval_rm_score_hist")
KNOWN_METRICS = tuple(
    K.STEP_METRICS + K.GOLD_METRICS + K.EVAL_METRICS
    + [K.COLLAPSE_STEP, K.COLLAPSE_SIGNALS, K.RM_TRAIN_ACC, K.RM_EVAL_ACC, K.RM_TRAIN_LOSS]
)


class RegistryError(ConfigError):
    """A registry file that cannot be expanded; lists every problem found, one per line."""

    def __init__(self, problems: list[str]):
        super().__init__(problems)
        self.args = ("invalid ablation registry:\n  - " + "\n  - ".join(problems),)

    def __str__(self) -> str:
        return self.args[0]


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------
@dataclass
class Variant:
    name: str
    settings: dict[str, Any]
    """Dotted config key -> value (inherit chain resolved, grid point included)."""


@dataclass
class RunSpec:
    """One run of the grid: a variant at a seed, with its resolved and validated config."""

    variant: str
    seed: int
    cfg: Any
    """TrainConfig (kind train) or WorldConfig (kind world)."""
    config_hash: str
    changed: dict[str, Any]
    """Flat key -> value where this run differs from the registry's common config (seed excluded)."""

    @property
    def run_name(self) -> str:
        """Deterministic MLflow run name and run-folder name: same variant x seed, same name."""
        return f"{slug(self.variant)}-s{self.seed}"


@dataclass
class Registry:
    path: Path
    name: str
    figure: str
    title: str
    kind: str
    base: Path | None
    seeds: list[int]
    variants: list[Variant]
    panels: list[str]
    profiles: list[str]
    scale: str
    common: Any
    """The config every variant starts from (base + overlay + set + profile set + --set), seed 0."""
    common_changes: dict[str, Any]
    """Flat key -> value where `common` differs from the bare base file."""
    runs: list[RunSpec] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    description: str = ""

    @property
    def steps(self) -> int:
        return int(getattr(getattr(self.common, "ppo", None), "steps", 0) or 0)


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------
_GREEK = {"δ": "delta", "η": "eta", "λ": "lambda", "ε": "eps", "β": "beta"}


def slug(name: str) -> str:
    """'reward normalize, δ=0.3' -> 'reward-normalize-delta=0.3' (safe as a folder name)."""
    s = unicodedata.normalize("NFKC", str(name))
    for g, word in _GREEK.items():
        s = s.replace(g, word)
    s = re.sub(r"[^A-Za-z0-9.=+_-]+", "-", s).strip("-").lower()
    return s or "variant"


def format_axis_value(v: Any) -> str:
    """How a grid axis value appears in a variant name; analysis.spec uses the same function, since
    variant names are the join key between runs and figures."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    return str(v)


def closest(word: str, options: list[str] | tuple[str, ...], n: int = 1) -> list[str]:
    return difflib.get_close_matches(str(word), list(options), n=n, cutoff=0.5)


def _did_you_mean(word: str, options: list[str] | tuple[str, ...]) -> str:
    c = closest(word, options)
    return f"did you mean {c[0]!r}?" if c else f"valid: {', '.join(options)}"


# --------------------------------------------------------------------------------------------
# Config keys
# --------------------------------------------------------------------------------------------
def _world_module():
    try:
        from .world import config as world_config
    except ImportError as e:  # pragma: no cover - only while the world package is missing
        raise RegistryError([f"kind: world needs harness.world (the embedded world builder), which cannot be imported: {e}"]) from None
    return world_config


def validate_config(data: dict[str, Any], cls: type) -> Any:
    """from_dict for TrainConfig; the world's own validator (with its cross-checks) for WorldConfig."""
    if cls is TrainConfig:
        return from_dict(data, cls)
    return _world_module().world_config_from_dict(data)


def run_config_hash(cfg: Any) -> str:
    """harness.config_hash for train runs; the world's cache key for world runs."""
    if isinstance(cfg, TrainConfig):
        return config_hash(cfg)
    return _world_module().world_config_hash(cfg)


def _config_class(kind: str):
    return _world_module().WorldConfig if kind == "world" else TrainConfig


def _leaf_keys(cls: type) -> list[str]:
    return [k for k, *_ in iter_fields(cls)]


def _key_problem(key: str, leaves: list[str]) -> str:
    """'ppo.kl_cof' -> "unknown config key; did you mean 'ppo.kl_coef'?" (also finds 'kl_coef')."""
    close = difflib.get_close_matches(key, leaves, n=1, cutoff=0.6)
    if not close:  # a bare or misplaced field name: match on the last part
        last = key.split(".")[-1]
        by_last = {k.split(".")[-1]: k for k in leaves}
        c = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.6)
        close = [by_last[c[0]]] if c else []
    hint = f"did you mean {close[0]!r}?" if close else "every key is listed in harness/config.py"
    return f"unknown config key; {hint}"


def flat_settings(data: Any, leaves: list[str], where: str, problems: list[str]) -> dict[str, Any]:
    """Nested or dotted overrides -> {dotted leaf key: value}; unknown keys become problems.

    Dotted (`ppo.kl_coef: 0.1`) and nested (`ppo: {kl_coef: 0.1}`) spellings both work; a leaf
    whose value is itself a mapping (logging.tags) is kept whole.
    """
    if data is None:
        return {}
    if not isinstance(data, dict):
        problems.append(f"{where}: expected a mapping of config keys to values, got {data!r}")
        return {}
    leafset = set(leaves)
    sections = {k.rsplit(".", i)[0] for k in leaves for i in range(1, k.count(".") + 1)}
    out: dict[str, Any] = {}

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            path = f"{prefix}{k}"
            if path in leafset:
                out[path] = v
            elif path in sections and isinstance(v, dict):
                walk(v, path + ".")
            else:
                problems.append(f"{where}: {path}: {_key_problem(path, leaves)}")

    walk(data, "")
    return out


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    return merge({}, flat)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
def _resolve_file(ref: Any, reg_path: Path, what: str, problems: list[str]) -> Path | None:
    """A path relative to the registry file's folder; falls back to the repo's ablations/ so a
    registry written elsewhere (a test's tmp dir) can still say `base: bases/vanilla.yaml`."""
    if ref in (None, ""):
        return None
    if not isinstance(ref, str):
        problems.append(f"{what}: expected a file path, got {ref!r}")
        return None
    p = Path(ref).expanduser()
    candidates = [p] if p.is_absolute() else [reg_path.parent / p, ABLATIONS_DIR / p]
    for c in candidates:
        if c.is_file():
            return c
    problems.append(f"{what}: {ref!r}: file not found (looked in {', '.join(str(c.parent) for c in candidates)})")
    return None


def _check_keys(d: dict[str, Any], allowed: tuple[str, ...], where: str, problems: list[str]) -> None:
    for k in d:
        if k not in allowed:
            problems.append(f"{where}{k}: unknown key; {_did_you_mean(str(k), allowed)}")


def _seed_list(raw: Any, where: str, problems: list[str]) -> list[int]:
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, list) or not raw or not all(isinstance(s, int) and not isinstance(s, bool) for s in raw):
        problems.append(f"{where}: expected a non-empty list of integer seeds, e.g. [0, 1, 2]; got {raw!r}")
        return [0]
    if len(set(raw)) != len(raw):
        problems.append(f"{where}: seed listed twice in {raw}")
    return list(raw)


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' or '0-2' -> [0, 1, 2] (for --seeds)."""
    out: list[int] = []
    try:
        for part in str(text).split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                out += list(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise RegistryError([f"--seeds {text!r}: expected integers like 0,1,2 or a range like 0-4"]) from None
    if not out:
        raise RegistryError([f"--seeds {text!r}: no seeds given"])
    return out


def _expand_variants(raw: dict[str, Any], leaves: list[str], where: str, problems: list[str]) -> list[Variant]:
    variants: list[Variant] = []
    by_name: dict[str, Variant] = {}
    items = raw.get("variants")
    if items is not None and not isinstance(items, list):
        problems.append(f"{where}variants: expected a list of {{name, set, inherit}} entries, got {type(items).__name__}")
        items = []
    for i, item in enumerate(items or []):
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict):
            problems.append(f"{where}variants[{i}]: expected a mapping with a name, got {item!r}")
            continue
        _check_keys(item, VARIANT_KEYS, f"{where}variants[{i}].", problems)
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            problems.append(f"{where}variants[{i}]: needs a `name` (the paper's legend text)")
            continue
        settings: dict[str, Any] = {}
        parent = item.get("inherit")
        if parent is not None:
            if parent not in by_name:
                hint = _did_you_mean(str(parent), list(by_name)) if by_name else "none is listed above it"
                problems.append(f"{where}variant {name!r}: inherit {parent!r}: no variant of that name above this one ({hint})")
            else:
                settings.update(by_name[parent].settings)
        settings.update(flat_settings(item.get("set"), leaves, f"{where}variant {name!r}: set", problems))
        v = Variant(name, settings)
        variants.append(v)
        by_name[name] = v

    grid = raw.get("grid")
    if grid is not None:
        if not isinstance(grid, dict):
            problems.append(f"{where}grid: expected {{name: TEMPLATE, axes: {{key: [values]}}}}, got {grid!r}")
        else:
            _check_keys(grid, GRID_KEYS, f"{where}grid.", problems)
            axes_raw = grid.get("axes")
            if not isinstance(axes_raw, dict) or not axes_raw:
                problems.append(f"{where}grid.axes: expected a mapping of config keys to lists of values, got {axes_raw!r}")
                axes_raw = {}
            axes = flat_settings(axes_raw, leaves, f"{where}grid.axes", problems)
            for k, vals in axes.items():
                if not isinstance(vals, list) or not vals:
                    problems.append(f"{where}grid.axes.{k}: expected a non-empty list of values, got {vals!r}")
            axes = {k: v for k, v in axes.items() if isinstance(v, list) and v}
            # The raw axis keys (as spelled) name the template fields, as analysis.spec does.
            template = grid.get("name") or " ".join(f"{k}={{{k}}}" for k in axes)
            for field_name in re.findall(r"\{([^{}]+)\}", str(template)):
                if field_name not in axes:
                    problems.append(f"{where}grid.name: {{{field_name}}} is not an axis; axes: {', '.join(axes) or '(none)'}")
            names = list(axes)
            for point in itertools.product(*(axes[k] for k in names)):
                values = dict(zip(names, point))
                vname = re.sub(r"\{([^{}]+)\}", lambda m: format_axis_value(values.get(m.group(1), m.group(0))), str(template))
                v = Variant(vname, dict(values))
                variants.append(v)
                by_name[vname] = v

    if not variants:
        problems.append(f"{where}no variants: give `variants:` (a list of named settings) or `grid:` (axes)")
    seen: dict[str, str] = {}
    for v in variants:
        s = slug(v.name)
        if s in seen:
            what = "listed twice" if seen[s] == v.name else f"has the same folder name as {seen[s]!r} ({s})"
            problems.append(f"{where}variant {v.name!r} {what}; variant names must be distinct")
        seen[s] = v.name
    return variants


def _diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Flat keys whose value in `a` differs from `b`."""
    return {k: v for k, v in a.items() if b.get(k, object()) != v}


def load_registry(
    path: str | Path,
    *,
    scale: str | None = None,
    seeds: list[int] | None = None,
    overrides: dict[str, Any] | None = None,
    only: list[str] | None = None,
) -> Registry:
    """Read, expand and validate a registry file; raises RegistryError listing every problem.

    scale: a profile name (`paper`) or None/'world' for the file's own settings.
    seeds: replaces the file's seeds. overrides: dotted key -> value, applied to every run last.
    only: keep just these variant names.
    """
    path = Path(path)
    where = f"{path}: "
    if not path.is_file():
        known = sorted(p.name for p in ABLATIONS_DIR.glob("*.yaml"))
        hint = _did_you_mean(path.name, known) if known else ""
        raise RegistryError([f"{path}: registry file not found. {hint}".strip()])
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RegistryError([f"{where}not valid YAML: {e}"]) from None
    if not isinstance(raw, dict):
        raise RegistryError([f"{where}top level must be a mapping (name, figure, base, variants, ...)"])
    if "search_space" in raw:
        raise RegistryError([f"{where}this is a sweep (it has search_space); run it with `python -m harness.sweep {path}`"])

    problems: list[str] = []
    _check_keys(raw, TOP_KEYS, where, problems)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        problems.append(f"{where}name: missing; it is the MLflow experiment and reports/<name>/, and must equal the file stem {path.stem!r}")
        name = path.stem
    elif name != path.stem:
        problems.append(f"{where}name: {name!r} must equal the file stem {path.stem!r} (the name is the MLflow experiment and reports/<name>/)")
    figure = raw.get("figure")
    if figure is None or str(figure).strip() == "":
        problems.append(f"{where}figure: missing; the paper figure id, e.g. \"6\" (or \"apa\")")
    figure = str(figure if figure is not None else "")
    kind = raw.get("kind", "train")
    if kind not in KINDS:
        problems.append(f"{where}kind: got {kind!r}; allowed: {', '.join(KINDS)} ({_did_you_mean(str(kind), KINDS)})")
        kind = "train"

    cls = _config_class(kind)
    leaves = _leaf_keys(cls)
    has_seed = "seed" in leaves

    # -- profile ---------------------------------------------------------------------------
    profiles_raw = raw.get("profiles") or {}
    if not isinstance(profiles_raw, dict):
        problems.append(f"{where}profiles: expected a mapping of profile name -> {{set, overlay, seeds, variant_set}}")
        profiles_raw = {}
    for pname, prof in profiles_raw.items():
        if not isinstance(prof, dict):
            problems.append(f"{where}profiles.{pname}: expected a mapping with keys {', '.join(PROFILE_KEYS)}")
        else:
            _check_keys(prof, PROFILE_KEYS, f"{where}profiles.{pname}.", problems)
    scale = scale or DEFAULT_SCALE
    profile: dict[str, Any] = {}
    if scale != DEFAULT_SCALE:
        if scale not in profiles_raw:
            avail = ", ".join([DEFAULT_SCALE] + list(profiles_raw))
            problems.append(f"{where}--scale {scale}: this file has no profiles.{scale}; available scales: {avail}")
        elif isinstance(profiles_raw[scale], dict):
            profile = profiles_raw[scale]

    # -- common settings ---------------------------------------------------------------------
    base_path = _resolve_file(raw.get("base"), path, f"{where}base", problems)
    if kind == "train" and raw.get("base") is None:
        problems.append(f"{where}base: missing; name a train config, e.g. bases/vanilla.yaml")
    base_data: dict[str, Any] = {}
    if base_path is not None:
        try:
            base_data = read_yaml(base_path)
        except ConfigError as e:
            problems += [f"{where}base: {p}" for p in e.problems]
    overlay_data: dict[str, Any] = {}
    if profile.get("overlay"):
        ov = _resolve_file(profile["overlay"], path, f"{where}profiles.{scale}.overlay", problems)
        if ov is not None:
            try:
                overlay_data = read_yaml(ov)
            except ConfigError as e:
                problems += [f"{where}profiles.{scale}.overlay: {p}" for p in e.problems]
    common_set = flat_settings(raw.get("set"), leaves, f"{where}set", problems)
    profile_set = flat_settings(profile.get("set"), leaves, f"{where}profiles.{scale}.set", problems)
    cli_set = flat_settings(_nested(overrides or {}), leaves, "--set", problems)

    file_seeds = _seed_list(raw.get("seeds", [0]), f"{where}seeds", problems)
    if profile.get("seeds") is not None:
        file_seeds = _seed_list(profile["seeds"], f"{where}profiles.{scale}.seeds", problems)
    run_seeds = seeds if seeds else file_seeds
    if kind == "world" and not has_seed and len(run_seeds) > 1:
        problems.append(f"{where}seeds: {cls.__name__} has no seed field, so give one seed")

    variants = _expand_variants(raw, leaves, where, problems)
    variant_set_raw = profile.get("variant_set") or {}
    variant_sets: dict[str, dict[str, Any]] = {}
    if not isinstance(variant_set_raw, dict):
        problems.append(f"{where}profiles.{scale}.variant_set: expected a mapping of variant name -> settings")
        variant_set_raw = {}
    names = [v.name for v in variants]
    for vname, vset in variant_set_raw.items():
        if vname not in names:
            problems.append(f"{where}profiles.{scale}.variant_set: {vname!r} is not a variant; {_did_you_mean(str(vname), names)}")
        variant_sets[vname] = flat_settings(vset, leaves, f"{where}profiles.{scale}.variant_set[{vname!r}]", problems)
    if only:
        for o in only:
            if o not in names:
                problems.append(f"--variant {o!r}: not in {path.name}; {_did_you_mean(o, names)}")
        variants = [v for v in variants if v.name in only]

    panels = raw.get("panels") or []
    if not isinstance(panels, list):
        problems.append(f"{where}panels: expected a list of metric keys, got {panels!r}")
        panels = []
    for p in panels:
        if p not in KNOWN_METRICS and p not in SPECIAL_PANELS:
            problems.append(f"{where}panels: {p!r} is not a metric key (harness/keys.py) or a special panel; "
                            f"{_did_you_mean(str(p), list(KNOWN_METRICS) + list(SPECIAL_PANELS))}")
    if problems:
        raise RegistryError(problems)

    # A --set on a key that the variants vary makes them identical: say so, loudly.
    warnings = []
    varied = {k for v in variants for k in v.settings}
    for k in cli_set:
        if k in varied:
            warnings.append(f"--set {k} overrides a setting the variants differ in; those variants now share {k}={cli_set[k]!r}")

    # -- resolve every run ---------------------------------------------------------------------
    def resolve(extra: list[dict[str, Any]], seed: int | None) -> dict[str, Any]:
        data = merge(base_data, overlay_data)
        for layer in [common_set, profile_set, *extra, cli_set]:
            data = merge(data, layer)
        if seed is not None and has_seed:
            data = merge(data, {"seed": seed})
        return data

    def validated(data: dict[str, Any], label: str) -> Any:
        try:
            return validate_config(data, cls)
        except ConfigError as e:
            problems.extend(f"{where}{label}: {p}" for p in e.problems)
            return None

    base_cfg = validated(merge(base_data, {}), f"base {raw.get('base')}")
    common_cfg = validated(resolve([], None), "common settings (base + set)")
    runs: list[RunSpec] = []
    for v in variants:
        for seed in run_seeds:
            cfg = validated(resolve([v.settings, variant_sets.get(v.name, {})], seed), f"variant {v.name!r} seed {seed}")
            if cfg is None or common_cfg is None:
                continue
            flat = flatten(to_dict(cfg))
            changed = {k: x for k, x in _diff(flat, flatten(to_dict(common_cfg))).items() if k != "seed"}
            runs.append(RunSpec(v.name, seed, cfg, run_config_hash(cfg), changed))
    if problems:
        raise RegistryError(problems)

    # Two variants that resolve to the same config would be one run logged twice: warn.
    by_hash: dict[str, RunSpec] = {}
    for r in runs:
        first = by_hash.setdefault(r.config_hash, r)
        msg = f"variants {first.variant!r} and {r.variant!r} resolve to the same config (they would be one run logged twice)"
        if first.variant != r.variant and msg not in warnings:
            warnings.append(msg)

    common_changes = _diff(flatten(to_dict(common_cfg)), flatten(to_dict(base_cfg))) if base_cfg is not None else {}
    return Registry(
        path=path, name=name, figure=figure, title=str(raw.get("title") or name), kind=kind, base=base_path,
        seeds=list(run_seeds), variants=variants, panels=[str(p) for p in panels], profiles=list(profiles_raw),
        scale=scale, common=common_cfg, common_changes=common_changes, runs=runs, warnings=warnings,
        description=str(raw.get("description") or ""),
    )


def registry_files(ablations_dir: str | Path | None = None) -> list[Path]:
    """Every registry YAML directly under ablations/ (bases/ and sweeps are not registries)."""
    root = Path(ablations_dir) if ablations_dir else ABLATIONS_DIR
    out = []
    for p in sorted(root.glob("*.y*ml")):
        try:
            data = yaml.safe_load(p.read_text())
        except (OSError, yaml.YAMLError):
            out.append(p)  # let load_registry say what is wrong with it
            continue
        if isinstance(data, dict) and "search_space" in data:
            continue
        out.append(p)
    return out


def with_runner_settings(cfg: Any, settings: dict[str, Any]) -> Any:
    """cfg with dotted `settings` applied, validated again (the runner's logging fields)."""
    return validate_config(merge(to_dict(cfg), settings), type(cfg))


__all__ = [
    "Registry", "RunSpec", "Variant", "RegistryError", "load_registry", "registry_files", "parse_seeds",
    "slug", "with_runner_settings", "ABLATIONS_DIR", "SPECIAL_PANELS", "KNOWN_METRICS",
]
