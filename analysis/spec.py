"""The ablation registry (`ablations/*.yaml`, format in docs/CONTRACTS.md) as analysis needs it.

Only name/figure/title/kind/variants/grid/panels (plus base/set/seeds for the report's grid
table) are read; training configs are never resolved here, so figures and reports can be drawn
from an old store even when the trainer's config schema has moved on. A YAML with a
`search_space` key is a sweep (kind "sweep").
"""
from __future__ import annotations

import difflib
import itertools
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness import keys as K

REPO_ROOT = Path(__file__).resolve().parents[1]
ABLATIONS_DIR = REPO_ROOT / "ablations"

# Special panel names (beside metric keys) from docs/CONTRACTS.md.
RM_SCORE_DIFF_HIST = "rm_score_diff_hist"  # Fig. 2
RM_ACCURACY = "rm_accuracy"  # Fig. 3
EVAL_RM_SCORE_HIST = "eval_rm_score_hist"  # Fig. 13
SPECIAL_PANELS = (RM_SCORE_DIFF_HIST, RM_ACCURACY, EVAL_RM_SCORE_HIST)

_CURVES = [K.RM_SCORE, K.LENGTH, K.KL, K.PPL]
# Panels per paper figure, in the paper's order (paper-notes section 3); used when the YAML
# names no `panels`.
DEFAULT_PANELS: dict[str, list[str]] = {
    "2": [RM_SCORE_DIFF_HIST],
    "3": [RM_ACCURACY],
    "4": [K.RM_SCORE, K.PG_LOSS, K.VF_LOSS, K.KL, K.PPL, K.LENGTH],
    "6": _CURVES,
    "7": _CURVES,
    "8": _CURVES + [K.PG_LOSS, K.VF_LOSS, K.ADV_MEAN, K.RETURNS],
    "9": _CURVES,
    "13": [EVAL_RM_SCORE_HIST],
    "14": _CURVES,
    "15": _CURVES,
    "16": _CURVES,
    "17": [K.RM_SCORE, K.PPL, K.VALUES, K.ADV_MEAN],
    "18": [K.RM_SCORE, K.PPL, K.VALUES, K.ADV_MEAN],
    "19": [K.RM_SCORE, K.PPL, K.VALUES, K.ADV_MEAN],
    "apa": [K.RM_SCORE, K.KL],
}


class UnknownAblation(LookupError):
    """An ablation name or path that the registry does not hold; the message lists the known ones."""


@dataclass
class Variant:
    name: str
    settings: dict[str, Any]
    """Dotted config key -> value this variant sets (inherit resolved, grid axes included)."""


@dataclass
class AblationSpec:
    name: str
    figure: str
    title: str
    kind: str  # train | world | sweep
    variants: list[Variant] = field(default_factory=list)
    panels: list[str] = field(default_factory=list)
    common: dict[str, Any] = field(default_factory=dict)
    """The top-level `set`: overrides shared by every variant."""
    base: str | None = None
    seeds: list[int] = field(default_factory=list)
    path: Path | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def variant_names(self) -> list[str]:
        return [v.name for v in self.variants]

    @property
    def is_sweep(self) -> bool:
        return self.kind == "sweep"


# --------------------------------------------------------------------------------------------
# Variant names
# --------------------------------------------------------------------------------------------
_GREEK = {"δ": "delta", "η": "eta", "λ": "lambda", "ε": "eps", "β": "beta"}


def normalize_name(name: str) -> str:
    """Key for matching variant names that differ only in case, spacing, punctuation or
    Greek-vs-spelled-out letters ("reward normalize, δ=0.8" == "Reward normalize delta = 0.8")."""
    s = unicodedata.normalize("NFKC", str(name)).lower()
    for g, word in _GREEK.items():
        s = s.replace(g, word)
    return re.sub(r"[^a-z0-9.]+", "", s)


def match_variant(wanted: str | list[str] | tuple[str, ...], available: list[str]) -> str | None:
    """The name in `available` that is `wanted` (or one of its aliases), exactly or up to
    `normalize_name`; None when there is none. Never fuzzy: a claim about the wrong variant is
    worse than an inconclusive one."""
    options = [wanted] if isinstance(wanted, str) else list(wanted)
    for w in options:
        if w in available:
            return w
    norm = {normalize_name(a): a for a in available}
    for w in options:
        if normalize_name(w) in norm:
            return norm[normalize_name(w)]
    return None


def order_variants(spec_names: list[str], run_names: list[str]) -> list[str]:
    """Variant names as the runs spell them, in the registry's order; names that only the runs
    know go last (sorted), so a renamed variant is still drawn."""
    remaining = list(dict.fromkeys(run_names))
    ordered = []
    for s in spec_names:
        m = match_variant(s, remaining)
        if m is not None:
            ordered.append(m)
            remaining.remove(m)
    return ordered + sorted(remaining)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
def _flatten(d: dict[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


from harness.registry import format_axis_value as _fmt_value  # noqa: E402  (one naming rule for runner and analysis)


def _expand_grid(grid: dict[str, Any]) -> list[Variant]:
    """`grid: {name: "η={ppo.kl_coef}", axes: {ppo.kl_coef: [...]}}` -> one variant per point."""
    axes = grid.get("axes") or {}
    template = grid.get("name") or " ".join(f"{k}={{{k}}}" for k in axes)
    keys_ = list(axes)
    out = []
    for point in itertools.product(*(axes[k] for k in keys_)):
        values = dict(zip(keys_, point))
        name = re.sub(r"\{([^{}]+)\}", lambda m: _fmt_value(values.get(m.group(1), m.group(0))), template)
        out.append(Variant(name, dict(values)))
    return out


def _variants(raw: dict[str, Any]) -> list[Variant]:
    out: list[Variant] = []
    by_name: dict[str, Variant] = {}
    for item in raw.get("variants") or []:
        if isinstance(item, str):
            item = {"name": item}
        settings: dict[str, Any] = {}
        parent = item.get("inherit")
        if parent is not None and parent in by_name:
            settings.update(by_name[parent].settings)
        settings.update(_flatten(item.get("set")))
        v = Variant(str(item.get("name")), settings)
        by_name[v.name] = v
        out.append(v)
    if isinstance(raw.get("grid"), dict):
        out += _expand_grid(raw["grid"])
    return out


def spec_from_dict(raw: dict[str, Any], path: Path | None = None) -> AblationSpec:
    name = str(raw.get("name") or (path.stem if path else "ablation"))
    is_sweep = "search_space" in raw
    figure = str(raw.get("figure", "")).strip()
    kind = "sweep" if is_sweep else str(raw.get("kind") or "train")
    panels = list(raw.get("panels") or DEFAULT_PANELS.get(figure, _CURVES if kind == "train" else []))
    return AblationSpec(
        name=name,
        figure=figure,
        title=str(raw.get("title") or (f"Fig. {figure}: {name}" if figure and figure != "apa" else name)),
        kind=kind,
        variants=_variants(raw),
        panels=panels,
        common=_flatten(raw.get("set")),
        base=raw.get("base"),
        seeds=[int(s) for s in raw.get("seeds") or []],
        path=path,
        raw=raw,
    )


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def _is_registry_entry(data: dict[str, Any]) -> bool:
    return "name" in data and any(k in data for k in ("variants", "grid", "search_space"))


def known_ablations(ablations_dir: str | Path | None = None) -> dict[str, Path]:
    """Registry name -> YAML path for every ablation or sweep file under `ablations_dir`
    (recursively; train-config bases are skipped: they have no variants/grid/search_space)."""
    root = Path(ablations_dir) if ablations_dir else ABLATIONS_DIR
    found: dict[str, Path] = {}
    if not root.is_dir():
        return found
    for p in sorted(root.rglob("*.y*ml")):
        data = _read(p)
        if data and _is_registry_entry(data):
            found.setdefault(str(data["name"]), p)
    return found


def load_spec(name_or_path: str | Path, ablations_dir: str | Path | None = None) -> AblationSpec:
    """An ablation by YAML path or registry name; UnknownAblation lists the known names and the
    closest one."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise UnknownAblation(f"ablation file {str(p)!r}: not found")
        data = _read(p)
        if data is None:
            raise UnknownAblation(f"ablation file {str(p)!r}: not a YAML mapping")
        return spec_from_dict(data, p)
    known = known_ablations(ablations_dir)
    name = str(name_or_path)
    if name in known:
        return spec_from_dict(_read(known[name]) or {}, known[name])
    by_stem = {path.stem: path for path in known.values()}
    if name in by_stem:
        return spec_from_dict(_read(by_stem[name]) or {}, by_stem[name])
    raise UnknownAblation(unknown_message(name, list(known)))


def unknown_message(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    msg = f"unknown ablation {name!r}"
    msg += f"; did you mean {close[0]!r}?" if close else ""
    msg += f"\nknown ablations: {', '.join(sorted(known)) if known else '(none: the registry is empty)'}"
    return msg
