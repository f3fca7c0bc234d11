"""The ablation registry: one YAML per paper figure under `ablations/`, read by one loader (the
file's format, and the order in which its settings apply: docs/CONTRACTS.md).

    reg = load_registry("ablations/score_reparam.yaml")  # one validated RunSpec per variant x seed
    spec = load_registry(path, resolve=False)             # figures/reports: no train config built
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import unicodedata
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import Field

from . import keys as K
from .config import Name, TrainConfig, config_hash, flatten, from_dict
from .rules import Claim, check_claims
from .schema import (
    ConfigError,
    Int,
    Seed,
    did_you_mean,
    leaf_keys,
    merge,
    one_of,
    read_yaml,
    section,
    to_dict,
    validate,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
ABLATIONS_DIR = REPO_ROOT / "ablations"


def default_ablations_dir() -> Path:
    """./ablations when the working directory has one (an installed package has no repo beside it),
    else the checkout's own ablations/."""
    here = Path.cwd() / "ablations"
    return here if here.is_dir() else ABLATIONS_DIR

MAX_SEEDS = 1000  # more seeds per variant than any verdict needs: a typo for a smaller range
DEFAULT_SCALE = "world"  # no profile: the file's own settings (the embedded world on CPU)

# Panels beside metric keys: Fig. 2's score-difference histogram, Fig. 3's accuracy curves,
# Fig. 13's per-step score distributions.
RM_SCORE_DIFF_HIST, RM_ACCURACY, EVAL_RM_SCORE_HIST = "rm_score_diff_hist", "rm_accuracy", "eval_rm_score_hist"
SPECIAL_PANELS = (RM_SCORE_DIFF_HIST, RM_ACCURACY, EVAL_RM_SCORE_HIST)
STANDARD_PANELS = [K.RM_SCORE, K.LENGTH, K.KL, K.PPL]  # the paper's usual four; drawn when `panels` is absent
KNOWN_METRICS = tuple(K.KNOWN_METRICS)


class RegistryError(ConfigError):
    """A registry file that cannot be expanded; lists every problem found, one per line."""

    def __str__(self) -> str:
        return "invalid ablation registry:\n  - " + "\n  - ".join(self.problems)


class UnknownAblation(LookupError):
    """An ablation name or path the registry does not hold; the message names the closest one."""


Panel = Annotated[str, one_of(KNOWN_METRICS + SPECIAL_PANELS, "a metric key (harness/keys.py) or a special panel")]


@section
class VariantEntry:
    name: Name
    """The legend text; also the MLflow tag harness.variant and (slugged) the run name."""
    inherit: str | None = None
    """An earlier variant whose settings this one starts from."""
    set: dict[str, Any] = Field(default_factory=dict)
    """Config overrides (dotted or nested keys)."""
    description: str = ""
    """Free text for readers."""


@section
class Grid:
    axes: Annotated[dict[str, list[Any]], Field(min_length=1)]
    """Config key -> values; one variant per point of the product."""
    name: str | None = None
    """Legend template with {axis key} fields, e.g. "η={ppo.kl_coef}"."""


@section
class Profile:
    description: str = ""
    """What this scale is for."""
    overlay: str | None = None
    """A config file laid over the base (e.g. bases/paper.yaml)."""
    set: dict[str, Any] = Field(default_factory=dict)
    """Overrides for every run at this scale."""
    seeds: Annotated[list[Seed], Field(min_length=1)] | None = None
    """Seeds at this scale (default: the file's)."""
    variant_set: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Variant name -> overrides for that variant at this scale."""


@section
class FigureFile:
    name: str
    """The MLflow experiment and the report folder; equals the file stem."""
    figure: Annotated[str, Field(min_length=1)]
    """The paper figure id, e.g. "6" (or "apa")."""
    order: Int | None = None
    """Position in the combined report (the paper's order); files without one go last."""
    panels: Annotated[list[Panel], Field(min_length=1)] = Field(default_factory=lambda: list(STANDARD_PANELS))
    """What the figure draws, in order: metric keys (harness/keys.py) or special panels."""
    x: Literal["step", "sampled_tokens"] = "step"
    """The metric panels' x axis: step, or the response tokens sampled so far (for a comparison at equal
    sampled tokens, e.g. of estimators that spend their samples differently; analysis/figures.py)."""
    title: str = ""
    """The figure's heading (default: the name)."""
    description: str = ""
    """What the grid shows, for readers."""
    inferred: list[str] = Field(default_factory=list)
    """Settings the paper does not state that this file assumes; printed in the report."""
    kind: Literal["train", "world"] = "train"
    """train: PPO runs; world: embedded-world builds (reward models)."""
    base: str | None = None
    """The train config every run starts from (relative to this file or ablations/)."""
    set: dict[str, Any] = Field(default_factory=dict)
    """Overrides shared by every run."""
    seeds: list[Seed] = Field(default_factory=lambda: [0], min_length=1)
    """Seeds of every variant."""
    worlds: Annotated[list[Seed], Field(min_length=1)] | None = None
    """World seeds (the embedded world's `seed`) every variant x seed runs on: each world is built once by
    the runner, cached by its config hash under .harness/worlds/, and its runs are tagged harness.world_seed;
    null: the one world at the base's data.world_dir."""
    world_set: dict[str, Any] = Field(default_factory=dict)
    """WorldConfig overrides for every world of `worlds` (e.g. {model.n_layer: 4} for a bigger world)."""
    reference_worlds: Annotated[list[Seed], Field(min_length=2)] | None = None
    """World seeds the committed reference runs this file on (`python -m reports.rerun` passes them as
    --worlds), so its verdicts say on how many worlds they hold; a plain run uses `worlds`, else the one
    world. null: the reference runs it on the default world only."""
    variants: list[VariantEntry] = Field(default_factory=list)
    """Named variants (a bare string: a variant with no settings)."""
    grid: Grid | None = None
    """A product of axes (after the named variants)."""
    profiles: dict[str, Profile] = Field(default_factory=dict)
    """Other scales, e.g. paper."""
    claims: list[Claim] = Field(default_factory=list)
    """Claims checked against the runs."""


@dataclasses.dataclass
class Variant:
    name: str
    settings: dict[str, Any]
    """Dotted config key -> value (inherit chain resolved, grid point included)."""


@dataclasses.dataclass
class RunSpec:
    """One run of the grid: a variant at a seed, with its resolved and validated config."""

    variant: str
    seed: int
    cfg: Any
    """TrainConfig (kind train) or WorldConfig (kind world)."""
    config_hash: str
    changed: dict[str, Any]
    """Flat key -> value where this run differs from the registry's common config (seed excluded)."""
    world: int | None = None
    """The world seed of a grid over worlds (`worlds:`), else None."""

    @property
    def run_name(self) -> str:
        """Deterministic MLflow run name and run-folder name: same variant x seed (x world), same name."""
        return f"{slug(self.variant)}-s{self.seed}" + ("" if self.world is None else f"-w{self.world}")

    @property
    def label(self) -> str:
        """How progress lines name it: 'vanilla PPO · seed 0 (world 1)'."""
        return f"{self.variant} · seed {self.seed}" + ("" if self.world is None else f" (world {self.world})")


@dataclasses.dataclass
class Registry:
    name: str
    figure: str = ""
    title: str = ""
    kind: str = "train"
    """train | world | sweep (a sweep file read for its report: harness.sweep validates the rest)."""
    path: Path | None = None
    base: str | None = None
    """The base file as the YAML names it."""
    seeds: list[int] = dataclasses.field(default_factory=list)
    variants: list[Variant] = dataclasses.field(default_factory=list)
    panels: list[str] = dataclasses.field(default_factory=list)
    x: str = "step"
    """The metric panels' x axis: step | sampled_tokens."""
    claims: list[Claim] = dataclasses.field(default_factory=list)
    order: int | None = None
    inferred: list[str] = dataclasses.field(default_factory=list)
    description: str = ""
    reference_worlds: list[int] | None = None
    """The world seeds of the committed reference's runs of this file (reports.rerun), or None."""
    shared: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The top-level `set`, flat: overrides every variant shares."""
    profiles: list[str] = dataclasses.field(default_factory=list)
    scale: str = DEFAULT_SCALE
    common: Any = None
    """The config every variant starts from (base + overlay + set + profile set + --set), seed 0;
    None when read with resolve=False."""
    common_changes: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Flat key -> value where `common` differs from the bare base file."""
    runs: list[RunSpec] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    worlds: dict[int, tuple[Any, Path]] = dataclasses.field(default_factory=dict)
    """A grid over worlds: world seed -> (its WorldConfig, the folder its runs read); empty otherwise."""

    @property
    def variant_names(self) -> list[str]:
        return [v.name for v in self.variants]

    @property
    def is_sweep(self) -> bool:
        return self.kind == "sweep"


_GREEK = {"δ": "delta", "η": "eta", "λ": "lambda", "ε": "eps", "β": "beta"}


def slug(name: str) -> str:
    """'reward normalize, δ=0.3' -> 'reward-normalize-delta=0.3' (safe as a folder name)."""
    s = unicodedata.normalize("NFKC", str(name))
    for g, word in _GREEK.items():
        s = s.replace(g, word)
    s = re.sub(r"[^A-Za-z0-9.=+_-]+", "-", s).strip("-").lower()
    return s or "variant"


def format_axis_value(v: Any) -> str:
    """How a value appears in a variant name (the join key between runs and figures) and in
    printed settings: true/false/null as YAML writes them."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


def parse_seeds(text: str, flag: str = "--seeds") -> list[int]:
    """'0,1,2' or '0-2' -> [0, 1, 2] (for --seeds, --worlds): at most MAX_SEEDS seeds, each a valid config seed."""
    out: list[int] = []
    for part in (p.strip() for p in str(text).split(",")) if str(text).strip() else []:
        a, dash, b = part.partition("-")
        if not (a.isdigit() and (b.isdigit() or not dash)):
            what = "an empty item between commas; " if not part else ""
            raise RegistryError([f"{flag} {text!r}: {what}expected integers like 0,1,2 or a range like 0-4"])
        lo, hi = int(a), int(b or a)
        if not 0 <= lo <= hi < 2**31 or hi - lo >= MAX_SEEDS:
            raise RegistryError([f"{flag} {text!r}: {part!r}: allowed: seeds in 0..{2**31 - 1}, a range low-high "
                                 f"with low <= high, at most {MAX_SEEDS} seeds"])
        out += range(lo, hi + 1)
    if not out or len(out) > MAX_SEEDS:
        raise RegistryError([f"{flag} {text!r}: allowed: 1 to {MAX_SEEDS} seeds"])
    return out


def config_kind(kind: str) -> tuple[type, Callable[[dict[str, Any]], Any], Callable[[Any], str]]:
    """(config class, validator, hash) of a grid's runs: harness.config's for train runs, the
    world's (its cache key as the hash; imported here, as it imports torch) for kind world."""
    if kind == "train":
        return TrainConfig, from_dict, config_hash
    from .world.config import WorldConfig, world_config_from_dict, world_config_hash

    return WorldConfig, world_config_from_dict, world_config_hash


def flat_settings(data: dict[str, Any], leaves: list[str] | None, where: str, problems: list[str]) -> dict[str, Any]:
    """Nested or dotted overrides -> {dotted leaf key: value}. With `leaves` (the config's keys), a
    leaf whose value is a mapping (logging.tags) stays whole and unknown keys become problems."""
    leafset = set(leaves or ())
    sections = {k.rsplit(".", i)[0] for k in leafset for i in range(1, k.count(".") + 1)}
    out: dict[str, Any] = {}

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            path = f"{prefix}{k}"
            if path in leafset or (leaves is None and not (isinstance(v, dict) and v)):
                out[path] = v
            elif (leaves is None or path in sections) and isinstance(v, dict):
                walk(v, path + ".")
            else:
                problems.append(f"{where}: {path}: unknown config key" + did_you_mean(path, leafset))

    walk(data or {}, "")
    return out


def resolve_file(ref: str | None, reg_path: Path, what: str, problems: list[str]) -> dict[str, Any]:
    """The YAML at `ref` (a figure or sweep file's `base:`, a profile's overlay), relative to the file's
    folder, else to ./ablations, else to the repo's ablations/ (so a file written elsewhere, a test's tmp
    dir, a user's own ablations/ folder, can still say `base: bases/vanilla.yaml`); problems name `what`."""
    if not ref:
        return {}
    p = Path(ref).expanduser()
    candidates = [p] if p.is_absolute() else list(dict.fromkeys(
        [reg_path.parent / p, default_ablations_dir() / p, ABLATIONS_DIR / p]))
    for c in filter(Path.is_file, candidates):
        try:
            return read_yaml(c)
        except ConfigError as e:
            problems += [f"{what}: {x}" for x in e.problems]
            return {}
    problems.append(f"{what}: {ref!r}: file not found (looked in {', '.join(str(c.parent) for c in candidates)})")
    return {}


def _expand_variants(fs: FigureFile, leaves: list[str] | None, where: str, problems: list[str]) -> list[Variant]:
    by_name: dict[str, Variant] = {}
    for i, item in enumerate(fs.variants):
        settings = dict(by_name[item.inherit].settings) if item.inherit in by_name else {}
        if item.inherit is not None and item.inherit not in by_name:
            problems.append(f"{where}variants.{i}.inherit: got {item.inherit!r}; no variant of that name above "
                            f"this one" + (did_you_mean(item.inherit, by_name) if by_name else ""))
        settings.update(flat_settings(item.set, leaves, f"{where}variant {item.name!r}: set", problems))
        if item.name in by_name:
            problems.append(f"{where}variants.{i}.name: {item.name!r} is listed twice; variant names must be distinct")
        by_name[item.name] = Variant(item.name, settings)
    variants = list(by_name.values())
    if fs.grid is not None:
        axes = flat_settings(fs.grid.axes, leaves, f"{where}grid.axes", problems)
        for k, v in axes.items():
            if not (isinstance(v, list) and v):  # no value: the product would silently have no points
                problems.append(f"{where}grid.axes.{k}: got {v!r}; allowed: a list of at least one value")
        axes = {k: v for k, v in axes.items() if isinstance(v, list) and v}
        template = fs.grid.name or " ".join(f"{k}={{{k}}}" for k in axes)
        for field_name in re.findall(r"\{([^{}]+)\}", template):
            if field_name not in axes:
                problems.append(f"{where}grid.name: {{{field_name}}} is not an axis"
                                + (did_you_mean(field_name, axes) if axes else ""))
        for point in itertools.product(*axes.values()):
            values = dict(zip(axes, point))
            name = re.sub(r"\{([^{}]+)\}", lambda m: format_axis_value(values.get(m.group(1), m.group(0))), template)
            variants.append(Variant(name, values))
    if not variants:
        problems.append(f"{where}no variants: give `variants:` (a list of named settings) or `grid:` (axes)")
    seen: dict[str, str] = {}
    for v in variants:
        s = slug(v.name)
        if seen.setdefault(s, v.name) != v.name:
            problems.append(f"{where}variant {v.name!r} has the same folder name as {seen[s]!r} ({s}); "
                            "names must differ")
    return variants


def load_registry(
    path: str | Path,
    *,
    scale: str | None = None,
    seeds: list[int] | None = None,
    overrides: dict[str, Any] | None = None,
    only: list[str] | None = None,
    worlds: list[int] | None = None,
    resolve: bool = True,
) -> Registry:
    """Read, expand and validate a registry file; raises RegistryError listing every problem.

    scale: a profile name (`paper`) or None/'world' for the file's own settings.
    seeds: replaces the file's seeds. overrides: dotted key -> value, applied to every run last.
    worlds: replaces the file's `worlds` (world seeds; every run on each).
    only: keep just these variant names. resolve=False: the file alone (no base, no train
    config): what figures and reports need; a sweep file then reads as kind "sweep".
    """
    path, src = Path(path), str(path)
    try:
        raw = read_yaml(path, "ablation file")
        if worlds is not None:
            raw["worlds"] = worlds
        if "search_space" in raw:
            if resolve:
                raise RegistryError([f"{src}: this is a sweep (it has search_space); run it with "
                                     f"`python -m harness.sweep {path}`"])
            return Registry(name=str(raw.get("name") or path.stem), title=str(raw.get("title") or path.stem),
                            kind="sweep", path=path, description=str(raw.get("description") or ""),
                            base=raw.get("base"))
        if isinstance(raw.get("variants"), list):  # a bare string is a variant with no settings
            raw["variants"] = [{"name": v} if isinstance(v, str) else v for v in raw["variants"]]
        fs = validate(FigureFile, raw, src)
    except ConfigError as e:
        raise RegistryError(e.problems) from None

    where = f"{src}: "
    problems: list[str] = []
    if fs.name != path.stem:
        problems.append(f"{where}name: {fs.name!r} must equal the file stem {path.stem!r} "
                        "(the name is the MLflow experiment and the report folder)")
    if len(set(fs.seeds)) != len(fs.seeds):
        problems.append(f"{where}seeds: got {fs.seeds}; a seed is listed twice")
    leaves = leaf_keys(config_kind(fs.kind)[0]) if resolve else None
    variants = _expand_variants(fs, leaves, where, problems)
    reg = Registry(
        name=fs.name, figure=fs.figure, title=fs.title or fs.name, kind=fs.kind, path=path, base=fs.base,
        seeds=list(seeds or fs.seeds), variants=variants, panels=list(fs.panels), x=fs.x,
        claims=check_claims(fs.claims, variants, src, problems), order=fs.order, inferred=list(fs.inferred),
        description=" ".join(fs.description.split()), shared=flat_settings(fs.set, leaves, f"{where}set", problems),
        profiles=list(fs.profiles), scale=scale or DEFAULT_SCALE, reference_worlds=fs.reference_worlds,
    )
    if resolve:
        _resolve_runs(reg, fs, leaves, bool(seeds), overrides or {}, only, problems)
    if problems:
        raise RegistryError(problems)
    return reg


def _resolve_runs(reg: Registry, fs: FigureFile, leaves: list[str], seeds_given: bool, overrides: dict[str, Any],
                  only: list[str] | None, problems: list[str]) -> None:
    """Fill reg.runs (one validated config per variant x seed), reg.common and reg.warnings."""
    where, scale = f"{reg.path}: ", reg.scale
    _, validator, hasher = config_kind(fs.kind)
    profile = fs.profiles.get(scale, Profile())
    if scale != DEFAULT_SCALE and scale not in fs.profiles:
        problems.append(f"{where}--scale {scale}: this file has no profiles.{scale}; available scales: "
                        + ", ".join([DEFAULT_SCALE, *fs.profiles]))
    for key in ("worlds", "reference_worlds"):
        if getattr(fs, key) is not None and fs.kind != "train":
            problems.append(f"{where}{key}: got {getattr(fs, key)}; allowed: only in a train grid (kind: train)")
    if fs.reference_worlds and len(set(fs.reference_worlds)) < len(fs.reference_worlds):
        problems.append(f"{where}reference_worlds: got {fs.reference_worlds}; a world seed is listed twice")
    problems += world_problems(fs, where)
    if fs.kind == "train" and fs.base is None:
        problems.append(f"{where}base: missing; name a train config, e.g. bases/vanilla.yaml")
    base_data = resolve_file(fs.base, reg.path, f"{where}base", problems)
    overlay_data = resolve_file(profile.overlay, reg.path, f"{where}profiles.{scale}.overlay", problems)
    profile_set = flat_settings(profile.set, leaves, f"{where}profiles.{scale}.set", problems)
    cli_set = flat_settings(merge({}, overrides), leaves, "--set", problems)
    if not seeds_given and profile.seeds:
        reg.seeds = list(profile.seeds)
    if len(set(reg.seeds)) < len(reg.seeds):
        reg.warnings.append(f"seeds {reg.seeds}: a seed listed more than once runs once")
        reg.seeds = list(dict.fromkeys(reg.seeds))
    names = reg.variant_names
    problems += [f"{where}profiles.{scale}.variant_set: {n!r} is not a variant" + did_you_mean(n, names)
                 for n in profile.variant_set if n not in names]
    variant_sets = {n: flat_settings(s, leaves, f"{where}profiles.{scale}.variant_set[{n!r}]", problems)
                    for n, s in profile.variant_set.items()}
    problems += [f"--variant {o!r}: not in {reg.path.name}" + did_you_mean(o, names)
                 for o in only or [] if o not in names]
    reg.variants = [v for v in reg.variants if not only or v.name in only]
    if problems:
        return

    # A --set on a key that the variants vary makes them identical: say so, loudly.
    varied = {k for v in reg.variants for k in v.settings}
    reg.warnings += [f"--set {k} overrides a setting the variants differ in; those variants now share {k}={x!r}"
                     for k, x in cli_set.items() if k in varied]

    def resolved(layers: list[dict[str, Any]], label: str) -> Any:
        try:
            return validator(functools.reduce(merge, layers, base_data))
        except ConfigError as e:
            problems.extend(f"{where}{label}: {p}" for p in e.problems)
            return None

    if fs.worlds is not None and not problems:
        reg.worlds = world_dirs(fs, where, problems)
    base_cfg = resolved([], f"base {fs.base}")
    reg.common = resolved([overlay_data, reg.shared, profile_set, cli_set], "common settings (base + set)")
    if reg.common is None:
        return
    common_flat = flatten(to_dict(reg.common))
    for v in reg.variants:
        for world in reg.worlds or [None]:
            on_world = {} if world is None else {"data.world_dir": str(reg.worlds[world][1])}
            for seed in reg.seeds:
                layers = [overlay_data, reg.shared, profile_set, v.settings, variant_sets.get(v.name, {}), cli_set]
                at = f"variant {v.name!r} seed {seed}" + ("" if world is None else f" world {world}")
                cfg = resolved([*layers, on_world, {"seed": seed}], at)
                if cfg is not None:
                    flat = flatten(to_dict(cfg))
                    changed = {k: x for k, x in flat.items() if common_flat.get(k, object()) != x
                               and k not in ("seed", "data.world_dir")}
                    reg.runs.append(RunSpec(v.name, seed, cfg, hasher(cfg), changed, world))
    if base_cfg is not None:
        base_flat = flatten(to_dict(base_cfg))
        reg.common_changes = {k: x for k, x in common_flat.items() if base_flat.get(k, object()) != x}

    # Two variants that resolve to the same config would be one run logged twice: warn.
    first: dict[str, str] = {}
    for r in reg.runs:
        other = first.setdefault(r.config_hash, r.variant)
        msg = f"variants {other!r} and {r.variant!r} resolve to the same config (they would be one run logged twice)"
        if other != r.variant and msg not in reg.warnings:
            reg.warnings.append(msg)


WORLDS_DIR = Path(".harness") / "worlds"
"""Where a grid over worlds keeps its worlds, one folder per world config hash (relative to the working
directory, as data.world_dir's default .harness/world)."""


def world_problems(fs: Any, where: str) -> list[str]:
    """What is wrong with the `worlds` and `world_set` of a file that has them (a figure file, a sweep file)."""
    problems = []
    if len(set(fs.worlds or [])) < len(fs.worlds or []):
        problems.append(f"{where}worlds: got {fs.worlds}; a world seed is listed twice")
    if fs.world_set and fs.worlds is None and getattr(fs, "reference_worlds", None) is None:
        problems.append(f"{where}world_set: given without `worlds`; allowed: world_set with a list of world seeds"
                        + (" (`worlds` or `reference_worlds`)" if hasattr(fs, "reference_worlds") else ""))
    return problems


def world_dirs(fs: Any, where: str, problems: list[str]) -> dict[int, tuple[Any, Path]]:
    """World seed -> (WorldConfig: the default world with `world_set` and that seed, its cache folder), of a
    file with `worlds` and `world_set` (a figure file, a sweep file)."""
    from .world.config import WorldConfig, world_config_from_dict, world_config_hash

    leaves = leaf_keys(WorldConfig)
    over = flat_settings(fs.world_set, leaves, f"{where}world_set", problems)
    if "seed" in over:
        problems.append(f"{where}world_set.seed: the worlds' seeds are `worlds`; allowed: other WorldConfig keys")
    out = {}
    for w in fs.worlds or []:
        try:
            cfg = world_config_from_dict(merge({}, {**over, "seed": w}))
        except ConfigError as e:
            problems.extend(f"{where}world_set: {p}" for p in e.problems)
            return {}
        out[w] = (cfg, WORLDS_DIR / world_config_hash(cfg))
    return out


def paper_key(order: Any, name: str) -> tuple[bool, int, str]:
    """Sort key of the paper's order, for the combined report and reports.rerun alike: files with an
    integer `order` by it, the others after them by name."""
    known = isinstance(order, int)
    return not known, order if known else 0, name


def registry_files(ablations_dir: str | Path | None = None, sweeps: bool = False) -> list[Path]:
    """Every registry YAML directly under ablations/ (bases/ are not registries; sweep files
    only with sweeps=True)."""
    def is_sweep(p: Path) -> bool:
        try:
            return "search_space" in read_yaml(p)
        except ConfigError:
            return False  # load_registry says what is wrong with it

    folder = Path(ablations_dir or default_ablations_dir())
    return [p for p in sorted(folder.glob("*.y*ml")) if sweeps or not is_sweep(p)]


def ablation_names(ablations_dir: str | Path | None = None) -> list[str]:
    """Names of every registry and sweep file (a registry's name is its file stem)."""
    return [p.stem for p in registry_files(ablations_dir, sweeps=True)]


def find_ablation(name_or_path: str | Path, ablations_dir: str | Path | None = None) -> Path:
    """The YAML of an ablation given by path or name; UnknownAblation names the closest one."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    known = {q.stem: q for q in registry_files(ablations_dir, sweeps=True)}
    if p.suffix not in (".yaml", ".yml") and str(name_or_path) in known:
        return known[str(name_or_path)]
    raise UnknownAblation(f"unknown ablation {str(name_or_path)!r}" + did_you_mean(p.stem, sorted(known)))
