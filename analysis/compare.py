"""A user's runs against the committed reference results (reports/reference.json, written by
`python -m reports.build --reference` with `summarize`):

    python -m analysis.compare                         # every figure in both the store and the reference
    python -m analysis.compare score_reparam --tracking-uri sqlite:///mlflow.db

Per claim: the reference verdict, the user's verdict (the same claims and tests, analysis.claims),
same or not. Per variant and metric (each run's number as the claims use it, harness.summary's
reduce_run): the user's mean over seeds inside the reference band or not. The band is the
reference's per-seed range widened by its standard error on each side, [min - se, max + se],
se = sd / sqrt(n): a user's seed mean lands outside it only when it lies beyond every reference
seed by more than the reference mean's own uncertainty. Curves differ across CPUs (float rounding,
harness.provenance), and on another CPU model the world itself differs, so the verdicts can too:
the comparison names the CPU and world numbers where the runs' provenance differs from the
reference's.

A reference run on several worlds (analysis.claims: per-world verdicts and a pooled one) judges a
reproduction by the world it ran on. Your world is one of the reference's (the same hash and the
same measured world properties, WORLD_FINGERPRINT: the same CPU builds the same world): your
verdicts are compared with that world's, your means with that world's seed band. Your world is
another (another CPU builds another world from the same config): your verdicts are compared with
the pooled ones (and named when one of the reference's worlds gave them), your means with the
reference's world-to-world band (`world_band`: a 95% prediction interval for one more world's seed
mean), beside the seed band of the reference's first world; the totals say which band was used.
Exit status 0 when the comparison ran (agreement is information, not an error), 1 when it had
nothing to compare (a figure named that the store holds no runs of, or none in both), 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd
from scipy.stats import t as student_t

from analysis.claims import check_claims, on_worlds
from analysis.stats import ALPHA
from analysis.store import (
    RUN_COLUMNS,
    STORE_OPTIONS,
    AblationData,
    ablations_in_store,
    default_tracking_uri,
    distinct_values,
    load_ablation,
    store_missing,
    world_name,
)
from harness import keys as K
from harness import tracking
from harness.registry import REPO_ROOT, Registry, UnknownAblation
from harness.summary import describe

REFERENCE = REPO_ROOT / "reports" / "reference.json"
BASE_METRICS = {"train": [(K.RM_SCORE, "final"), (K.GOLD_SCORE, "final"), (K.KL, "final")],
                "world": [(K.RM_EVAL_ACC, "final")]}
"""Summary numbers kept for every figure of a kind, beside those its claims use."""
CLAIM_FIELDS = ["claim", "source", "verdict", "n", "statistic", "estimate", "ci_low", "ci_high", "level", "margin",
                "p_value", "effect_size", "min_detectable", "reason", "world_verdicts", "pooled_verdict"]
WORLD_FINGERPRINT = ("world.content", "world.rm/eval_acc", "world.rm/eval_acc_gold", "world.world/sft_gold_mean")
"""What tells two builds of one world config apart (provenance tags): its content hash (the bytes),
and measured properties, as another CPU's float rounding trains another RM from one config hash."""


def rounded(x: Any, digits: int = 4) -> Any:
    """Floats to `digits` significant digits (NaN: None), so the summary is small and stable."""
    if isinstance(x, (float, np.floating)):
        return None if not math.isfinite(x) else float(f"{x:.{digits}g}")
    return x


def _metrics(data: AblationData) -> list[tuple[str, str]]:
    """(metric, stat) pairs behind the claims' per-run numbers, then the kind's base ones."""
    used = [(c.rule.metric, c.rule.stat) for c in data.spec.claims if getattr(c.rule, "stat", None)]
    return list(dict.fromkeys([p for p in used if p[0] != K.COLLAPSE_STEP] + BASE_METRICS.get(data.spec.kind, [])))


def summarize(data: AblationData, claims: pd.DataFrame | None = None) -> dict[str, Any]:
    """One figure: per variant n, seeds, collapsed, best eval steps and per-seed numbers (seed order);
    per claim its test (`claims`: analysis.claims.check_claims of `data`, when already computed).
    Runs with a world hash add "worlds" (`world_entries`); runs on several worlds add, per variant,
    "world" (each run's index into "worlds"; seeds and every metric list in that run order, null
    where a run lacks the metric) and per claim "world_verdicts" (in "worlds" order) and
    "pooled_verdict". One world: as before, besides "worlds"."""
    worlds = data.worlds
    several = len(worlds) > 1
    where = {w: i for i, w in enumerate(worlds)}
    variants: dict[str, dict] = {}
    order: dict[str, list[str]] = {}  # run ids per variant, in (world, seed) order
    for v in data.variants:
        runs = data.runs[data.runs["variant"] == v]
        runs = runs.assign(at=runs["world"].map(where)).sort_values(["at", "seed"])
        order[v] = list(runs["run_id"])
        variants[v] = {"n": len(runs), "seeds": list(map(int, runs["seed"])), "metrics": {},
                       "collapsed": int(runs["collapsed"].sum()), "best_step": [int(s) for s in runs["best_step"] if s == s]}
        if several:
            variants[v]["world"] = list(map(int, runs["at"]))
    for metric, stat in _metrics(data):
        per_run = data.per_run(metric, stat)
        for v, group in per_run.groupby("variant"):
            if v not in variants:
                continue
            if several:
                value = dict(zip(group["run_id"], group["value"]))
                variants[v]["metrics"][f"{stat} {metric}"] = [rounded(value.get(r, math.nan)) for r in order[v]]
            else:
                variants[v]["metrics"][f"{stat} {metric}"] = [rounded(x) for x in group.sort_values("seed")["value"]]
    claims = [claim_entry(r) for r in (check_claims(data) if claims is None else claims).to_dict("records")]
    out = {"figure": data.spec.figure, "title": data.spec.title, "inferred": list(data.spec.inferred),
           "run_commits": sorted({c for c in data.runs["git_commit"] if c}), "variants": variants, "claims": claims}
    if any(worlds):
        out["worlds"] = world_entries(data)
    return out


def claim_entry(row: dict[str, Any]) -> dict[str, Any]:
    """A claims row (analysis.claims.check_claims) as a summary keeps it: CLAIM_FIELDS, rounded, empty ones left out."""
    return {k: rounded(row[k]) for k in CLAIM_FIELDS if rounded(row[k]) not in (None, "")}


@dataclass
class SummaryData(AblationData):
    """A figure of a reference summary read back as the claims read a store: its runs (variant, seed, world)
    with the per-run numbers `summarize` kept ("STAT METRIC" lists, 4 significant digits) in place of the
    step metrics. Judges the rules on those numbers alone (compare, trend, threshold, similar on a kept
    metric and stat); a rule on anything else finds no values (analysis.claims: no verdict)."""

    numbers: pd.DataFrame = field(default_factory=pd.DataFrame)
    """One row per run and kept number: run_id, variant, seed, key ("STAT METRIC"), value."""

    def per_run(self, key: str, stat: str) -> pd.DataFrame:
        n = self.numbers
        n = n[(n["key"] == f"{stat} {key}") & n["run_id"].isin(self.runs["run_id"])].dropna(subset=["value"])
        return n[["run_id", "variant", "seed", "value"]].reset_index(drop=True)

    def in_world(self, world: str) -> "SummaryData":
        one = super().in_world(world)
        return SummaryData(one.spec, one.tracking_uri, one.runs, one.parent_run_id, self._cache, self.numbers)


def from_summary(spec: Registry, figure: dict[str, Any]) -> SummaryData:
    """`figure` (a summary's figure, `summarize`) as data for `spec`'s claims: each run's world from the
    variant's "world" indices into the figure's "worlds" (one world: the figure's only one)."""
    worlds = figure.get("worlds") or [{}]
    runs, numbers = [], []
    for v, d in figure["variants"].items():
        at = d.get("world") or [0] * len(d["seeds"])
        for i, (seed, w) in enumerate(zip(d["seeds"], at)):
            run_id = f"{v}/{w}/{seed}"
            runs.append({"run_id": run_id, "variant": v, "seed": seed, "status": "FINISHED", "metric_keys": set(),
                         "world": worlds[w].get("hash", ""), "world_seed": str(worlds[w].get("seed", "")),
                         "provenance": {}, "git_commit": ""})
            numbers += [{"run_id": run_id, "variant": v, "seed": seed, "key": key,
                         "value": math.nan if values[i] is None else float(values[i])}
                        for key, values in d["metrics"].items()]
    return SummaryData(spec, "", pd.DataFrame(runs, columns=RUN_COLUMNS), None,
                       numbers=pd.DataFrame(numbers, columns=["run_id", "variant", "seed", "key", "value"]))


def world_entries(data: AblationData) -> list[dict[str, Any]]:
    """Per world of the runs (data.worlds order): its hash, world seed (when tagged) and the
    WORLD_FINGERPRINT values its runs agree on (prefix "world." dropped)."""
    out = []
    for w in data.worlds:
        runs = data.runs[data.runs["world"] == w]
        entry: dict[str, Any] = {"hash": w}
        if seed := data.world_seed(w):
            entry["seed"] = int(seed) if seed.lstrip("-").isdigit() else seed
        for key in WORLD_FINGERPRINT:
            values = {tags[key.removeprefix("provenance.")] for tags in runs["provenance"] if key in tags}
            if len(values) == 1:
                entry[key.removeprefix("world.")] = values.pop()
        out.append(entry)
    return out


def same_world(mine: dict, theirs: dict) -> bool:
    """One built world: the same hash and the same values of the fingerprint keys both record."""
    shared = (mine.keys() & theirs.keys()) - {"hash", "seed"}
    return bool(mine.get("hash")) and mine["hash"] == theirs.get("hash") and all(mine[k] == theirs[k] for k in shared)


def world_entry_label(entry: dict) -> str:
    """A world of a summary's "worlds" as reports name it (analysis.store.world_name)."""
    return world_name(entry.get("hash", ""), entry.get("seed", ""))


def band(values: list[float]) -> tuple[float, float]:
    """[min - se, max + se] of the reference's per-seed values, se = sd / sqrt(n) (0 for one seed)."""
    d = describe(values)
    se = d["sd"] / math.sqrt(d["n"]) if d["n"] > 1 else 0.0
    return d["min"] - se, d["max"] + se


def world_band(per_world: list[list[float]], alpha: float = ALPHA) -> tuple[float, float]:
    """Where one more world's seed mean lies with probability 1 - alpha: the prediction interval
    m ± t_{1-alpha/2, K-1} s_m sqrt(1 + 1/K) over the K worlds' seed means (mean m, sd s_m; normal
    world and seed effects, as many seeds per world). Wide with few worlds, as it should be: two
    worlds say little about a third (t_{0.975, 1} = 12.7)."""
    means = [float(np.mean(v)) for v in per_world if len(v)]
    if len(means) < 2:
        return band([x for v in per_world for x in v])
    k, m, s = len(means), float(np.mean(means)), float(np.std(means, ddof=1))
    half = float(student_t.ppf(1 - alpha / 2, k - 1)) * s * math.sqrt(1 + 1 / k)
    return m - half, m + half


def _by_world(values: list, index: list[int] | None, k: int = 1) -> list[list[float]]:
    """A variant's per-run values split by world (`index`: the summary's "world" list), Nones dropped."""
    if index is None or len(index) != len(values):
        return [[x for x in values if x is not None]]
    out: list[list[float]] = [[] for _ in range(max(k, max(index, default=-1) + 1))]
    for i, x in zip(index, values):
        if x is not None:
            out[i].append(x)
    return out


def agreement(ref: dict, user: dict) -> tuple[list[dict], list[dict]]:
    """Rows per claim (reference and user verdict) and per variant x metric in both (band, user mean);
    several reference worlds: per claim also its "worlds" and whether yours is "within_worlds"
    (a verdict one of them gave), per metric the band used ("band": "seed" or "world") beside
    the one-world seed band (module docstring); several user worlds: rows per user world."""
    ref_worlds, user_worlds = ref.get("worlds") or [], user.get("worlds") or []
    several = len(ref_worlds) > 1
    match = [next((j for j, r in enumerate(ref_worlds) if same_world(u, r)), None) for u in user_worlds] or [None]
    mine = {c["claim"]: c for c in user["claims"]}
    claims = [_claim_row(c, mine[c["claim"]], match, ref_worlds) for c in ref["claims"] if c["claim"] in mine]
    metrics = []
    for v, rv in ref["variants"].items():
        uv = user["variants"].get(v, {})
        for m, values in rv["metrics"].items():
            refs = _by_world(values, rv.get("world"), len(ref_worlds))
            for ui, got in enumerate(_by_world(uv.get("metrics", {}).get(m, []), uv.get("world"), len(user_worlds))):
                if not got or not any(refs):
                    continue
                j = match[ui] if ui < len(match) else None
                own = refs[j] if several and j is not None and j < len(refs) and refs[j] else None
                seed_values = own or (refs[0] if several and refs[0] else [x for r in refs for x in r])
                row = {"variant": v, "metric": m, "user": float(np.mean(got)), "n": len(got),
                       "world": world_entry_label(user_worlds[ui]) if len(user_worlds) > 1 else ""}
                row["seed_low"], row["seed_high"] = band(seed_values)
                row["seed_world"] = world_entry_label(ref_worlds[j if own else 0]) if several else ""
                row["band"] = "world" if several and own is None else "seed"
                row["low"], row["high"] = world_band(refs) if row["band"] == "world" else (row["seed_low"],
                                                                                           row["seed_high"])
                row["in_band"] = row["low"] <= row["user"] <= row["high"]
                row["in_seed_band"] = row["seed_low"] <= row["user"] <= row["seed_high"]
                metrics.append(row)
    return claims, metrics


def _claim_row(ref_c: dict, user_c: dict, match: list[int | None], ref_worlds: list[dict]) -> dict:
    """One claim: the reference verdict your world is compared with (its own world's when the
    reference holds your one world, else the pooled one) and yours."""
    per, j = ref_c.get("world_verdicts"), match[0] if len(match) == 1 else None
    own = per is not None and j is not None and j < len(per)
    reference = per[j] if own else ref_c["verdict"]
    row = {"claim": ref_c["claim"], "reference": reference, "user": user_c["verdict"],
           "agree": reference == user_c["verdict"]}
    if per:
        row |= {"worlds": on_worlds(per), "within_worlds": user_c["verdict"] in per,
                "against": world_entry_label(ref_worlds[j]) if own else ""}
    return row


def load_reference(path: str | Path) -> dict:
    """The whole reference summary: "figures" (per figure, `summarize`), "provenance" (of its runs)."""
    try:
        doc = json.loads(Path(path).read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("figures"), dict):
            raise KeyError("figures")
        return doc
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: not a reference summary ({type(e).__name__}: {e}); "
                         "it is written by `python -m reports.build --reference`") from None


MACHINE_KEYS = ("cpu.model", "cpu.flags", "world.hash", "world.content", "world.rm/eval_acc",
                "world.rm/eval_acc_gold", "version.torch")
"""Provenance that decides whether runs can match the reference number for number: a world built on
the user's CPU (not the shipped one) differs from the reference's by float rounding (other weights,
another RM, other runs), and another CPU trains other runs on one world, harness.provenance."""


def provenance_values(frames: Iterable[pd.DataFrame]) -> dict[str, set[str]]:
    """Each `provenance.*` tag of the runs (the "provenance" column of analysis.store's run tables,
    prefix dropped) -> its distinct values."""
    return distinct_values(tags for runs in frames for tags in runs["provenance"])


def machine_differences(reference: dict, runs: pd.DataFrame) -> list[str]:
    """'key: reference X, yours Y' for each of MACHINE_KEYS on which the runs' provenance tags and
    the reference's (one value, or a list of them) differ: yours are not among the reference's
    (a reference over several worlds holds several); keys that either side lacks are skipped
    (older stores)."""
    mine = provenance_values([runs])
    out = []
    for k in MACHINE_KEYS:
        ref = reference.get(k)
        ref_values = set(ref) if isinstance(ref, list) else {ref} if ref is not None else set()
        if mine.get(k) and ref_values and not mine[k] <= ref_values:
            out.append(f"{k}: reference {' | '.join(sorted(ref_values))}, yours {' | '.join(sorted(mine[k]))}")
    return out


def claim_line(c: dict) -> str:
    """One claim of `agreement`, for the terminal."""
    line = f"  [{'same' if c['agree'] else 'DIFFERS'}] {c['claim']} — reference {c['reference']}"
    if c.get("against"):
        line += f" on your world ({c['against']})"
    elif c.get("worlds"):
        line += f" ({c['worlds']})"
    line += f", yours {c['user']}"
    if c.get("worlds") and not c["agree"] and not c.get("against") and c["within_worlds"]:
        line += " — a verdict one of the reference's worlds gives"
    return line


def metric_line(m: dict) -> str:
    """One variant x metric of `agreement`, for the terminal: the band used, and beside a world band the seed band."""
    where = f" on {m['world']}" if m["world"] else ""
    head = (f"  [{'in band' if m['in_band'] else 'OUTSIDE'}] {m['variant']} / {m['metric']}{where}: "
            f"yours {m['user']:.4g} (n = {m['n']}), ")
    if m["band"] == "world":
        inside = "inside" if m["in_seed_band"] else "outside"
        return head + (f"world-to-world band [{m['low']:.4g}, {m['high']:.4g}]; seed band of {m['seed_world']} "
                       f"[{m['seed_low']:.4g}, {m['seed_high']:.4g}]: {inside}")
    if m["seed_world"]:
        return head + f"seed band of your world in the reference, {m['seed_world']}, [{m['low']:.4g}, {m['high']:.4g}]"
    return head + f"reference band [{m['low']:.4g}, {m['high']:.4g}]"


def totals(claims: list[dict], metrics: list[dict]) -> str:
    """The last line: claims that agree, metrics in band, and (a reference over several worlds) which band."""
    line = (f"{sum(c['agree'] for c in claims)} of {len(claims)} claims agree, "
            f"{sum(m['in_band'] for m in metrics)} of {len(metrics)} metrics in band")
    differ = [c for c in claims if not c["agree"] and c.get("worlds") and not c.get("against")]
    world = [m for m in metrics if m["band"] == "world"]
    own = [m for m in metrics if m["seed_world"] and m["band"] == "seed"]
    used = ([f"{len(world)} against the reference's world-to-world band (your world is none of its worlds; "
             f"{sum(m['in_seed_band'] for m in world)} of them in the seed band of one world)"] if world else []) + (
        [f"{len(own)} against the seed band of your own world in the reference"] if own else [])
    if differ:
        used.append(f"{sum(c['within_worlds'] for c in differ)} of the {len(differ)} differing verdicts are one a "
                    "reference world gives")
    return line + (f" ({'; '.join(used)})" if used else "")


def after_run(name: str, tracking_uri: str) -> None:
    """The main job's last step: compare the figure just run when the reference holds it."""
    try:
        held = name in load_reference(REFERENCE)["figures"]
    except ValueError:
        held = False
    if held:
        main([name, "--tracking-uri", tracking_uri])
    else:
        print(f"{REFERENCE} holds no reference results for {name}: nothing to compare")


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    ap = argparse.ArgumentParser(prog="python -m analysis.compare", parents=[STORE_OPTIONS], description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ablations", nargs="*", metavar="ABLATION",
                    help="figure files to compare (default: every one in both the store and the reference)")
    ap.add_argument("--reference", default=str(REFERENCE), help=f"reference summary (default {REFERENCE})")
    args = ap.parse_args(argv)
    uri = args.tracking_uri or default_tracking_uri()
    if store_missing(uri):
        print(f"error: --tracking-uri {uri}: no such MLflow store (run `make run` first, or name the store)",
              file=sys.stderr)
        return 2
    try:
        doc = load_reference(args.reference)
        ref = doc["figures"]
        in_store = [] if args.ablations else ablations_in_store(uri)
        names = args.ablations or [n for n in in_store if n in ref]
        unknown = [n for n in names if n not in ref]
        if unknown:
            raise ValueError(f"{args.reference}: no figure {', '.join(map(repr, unknown))} in the reference "
                             f"(it holds: {', '.join(sorted(ref))})")
        data = {n: load_ablation(n, uri, args.ablations_dir) for n in names}
    except (ValueError, UnknownAblation) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name in (n for n in in_store if n not in ref):  # say what was read, so an empty comparison is not a riddle
        print(f"{name}: not in the reference (it holds the committed figures only); not compared")
    total_c, total_m, differ, empty = [], [], {}, []
    for name, d in data.items():
        if d.runs.empty:
            empty.append(name)
            print(f"{name}: no runs in the store; not compared")
            continue
        differ.update(dict.fromkeys(machine_differences(doc.get("provenance") or {}, d.runs)))
        claims, metrics = agreement(ref[name], summarize(d))
        total_c += claims
        total_m += metrics
        print(f"\n{name} (Fig. {ref[name]['figure']}): {len(d.runs)} runs")
        for c in claims:
            print(claim_line(c))
        for m in metrics:
            print(metric_line(m))
    if differ:
        print("\nyour runs come from another machine or world than the reference's:")
        for line in differ:
            print(f"  {line}")
        print("  the world is built on your CPU, and another CPU model's float rounding builds another world\n"
              "  (another RM, other runs): bands can miss and some verdicts can differ for that reason alone\n"
              "  (README: Check your results against the reference).")
    if len(empty) == len(data):  # asked for a comparison and compared nothing
        print(f"error: nothing to compare: the store {tracking.redact(uri)} holds no runs of "
              + (", ".join(empty) if empty else f"any figure in {args.reference} ({', '.join(sorted(ref))})"),
              file=sys.stderr)
        return 1
    print(f"\n{totals(total_c, total_m)}")
    if empty and args.ablations:
        print(f"error: {', '.join(empty)}: the store {tracking.redact(uri)} holds no runs of "
              f"{'them' if len(empty) > 1 else 'it'}; not compared", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
