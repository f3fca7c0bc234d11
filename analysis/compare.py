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
Exit status 0 when the comparison ran (agreement is information, not an error), 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from analysis.claims import check_claims
from analysis.store import STORE_OPTIONS, AblationData, ablations_in_store, default_tracking_uri, load_ablation
from harness import keys as K
from harness.registry import REPO_ROOT, UnknownAblation
from harness.summary import describe

REFERENCE = REPO_ROOT / "reports" / "reference.json"
BASE_METRICS = {"train": [(K.RM_SCORE, "final"), (K.GOLD_SCORE, "final"), (K.KL, "final")],
                "world": [(K.RM_EVAL_ACC, "final")]}
"""Summary numbers kept for every figure of a kind, beside those its claims use."""
CLAIM_FIELDS = ["claim", "source", "verdict", "n", "statistic", "estimate", "ci_low", "ci_high", "level", "p_value",
                "effect_size", "min_detectable", "reason"]


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
    per claim its test (`claims`: analysis.claims.check_claims of `data`, when already computed)."""
    variants: dict[str, dict] = {}
    for v in data.variants:
        runs = data.runs[data.runs["variant"] == v]
        variants[v] = {"n": len(runs), "seeds": sorted(map(int, runs["seed"])), "metrics": {},
                       "collapsed": int(runs["collapsed"].sum()), "best_step": [int(s) for s in runs["best_step"] if s == s]}
    for metric, stat in _metrics(data):
        per_run = data.per_run(metric, stat)
        for v, group in per_run.groupby("variant"):
            if v in variants:
                variants[v]["metrics"][f"{stat} {metric}"] = [rounded(x) for x in group.sort_values("seed")["value"]]
    claims = [{k: rounded(r[k]) for k in CLAIM_FIELDS if rounded(r[k]) not in (None, "")}
              for r in (check_claims(data) if claims is None else claims).to_dict("records")]
    return {"figure": data.spec.figure, "title": data.spec.title, "inferred": list(data.spec.inferred),
            "run_commits": sorted({c for c in data.runs["git_commit"] if c}), "variants": variants, "claims": claims}


def band(values: list[float]) -> tuple[float, float]:
    """[min - se, max + se] of the reference's per-seed values, se = sd / sqrt(n) (0 for one seed)."""
    d = describe(values)
    se = d["sd"] / math.sqrt(d["n"]) if d["n"] > 1 else 0.0
    return d["min"] - se, d["max"] + se


def agreement(ref: dict, user: dict) -> tuple[list[dict], list[dict]]:
    """Rows per claim (reference and user verdict) and per variant x metric in both (band, user mean)."""
    mine = {c["claim"]: c for c in user["claims"]}
    claims = [{"claim": c["claim"], "reference": c["verdict"], "user": mine[c["claim"]]["verdict"],
               "agree": c["verdict"] == mine[c["claim"]]["verdict"]} for c in ref["claims"] if c["claim"] in mine]
    metrics = []
    for v, rv in ref["variants"].items():
        for m, values in rv["metrics"].items():
            got = [x for x in user["variants"].get(v, {}).get("metrics", {}).get(m, []) if x is not None]
            ref_values = [x for x in values if x is not None]
            if got and ref_values:
                lo, hi = band(ref_values)
                mean = float(np.mean(got))
                metrics.append({"variant": v, "metric": m, "low": lo, "high": hi, "user": mean, "n": len(got),
                                "in_band": lo <= mean <= hi})
    return claims, metrics


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


MACHINE_KEYS = ("cpu.model", "cpu.flags", "world.hash", "world.rm/eval_acc", "world.rm/eval_acc_gold",
                "version.torch")
"""Provenance that decides whether runs can match the reference number for number: the world is
built on the user's CPU, and another CPU model's float rounding gives another world (other weights,
another RM, other runs), harness.provenance."""


def provenance_values(frames: Iterable[pd.DataFrame]) -> dict[str, set[str]]:
    """Each `provenance.*` tag of the runs (the "provenance" column of analysis.store's run tables,
    prefix dropped) -> its distinct values."""
    seen: dict[str, set[str]] = {}
    for runs in frames:
        for tags in runs["provenance"]:
            for k, v in tags.items():
                seen.setdefault(k, set()).add(v)
    return seen


def machine_differences(reference: dict, runs: pd.DataFrame) -> list[str]:
    """'key: reference X, yours Y' for each of MACHINE_KEYS on which the runs' provenance tags and
    the reference's (one value, or a list of them) differ; keys that either side lacks are skipped
    (older stores)."""
    mine = provenance_values([runs])
    out = []
    for k in MACHINE_KEYS:
        ref = reference.get(k)
        ref_values = set(ref) if isinstance(ref, list) else {ref} if ref is not None else set()
        if mine.get(k) and ref_values and mine[k] != ref_values:
            out.append(f"{k}: reference {' | '.join(sorted(ref_values))}, yours {' | '.join(sorted(mine[k]))}")
    return out


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
    ap = argparse.ArgumentParser(prog="python -m analysis.compare", parents=[STORE_OPTIONS], description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ablations", nargs="*", metavar="ABLATION",
                    help="figure files to compare (default: every one in both the store and the reference)")
    ap.add_argument("--reference", default=str(REFERENCE), help=f"reference summary (default {REFERENCE})")
    args = ap.parse_args(argv)
    uri = args.tracking_uri or default_tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
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
    total_c, total_m, differ = [], [], {}
    for name, d in data.items():
        if d.runs.empty:
            print(f"{name}: no runs in the store; not compared")
            continue
        differ.update(dict.fromkeys(machine_differences(doc.get("provenance") or {}, d.runs)))
        claims, metrics = agreement(ref[name], summarize(d))
        total_c += claims
        total_m += metrics
        print(f"\n{name} (Fig. {ref[name]['figure']}): {len(d.runs)} runs")
        for c in claims:
            print(f"  [{'same' if c['agree'] else 'DIFFERS'}] {c['claim']} — reference {c['reference']}, "
                  f"yours {c['user']}")
        for m in metrics:
            print(f"  [{'in band' if m['in_band'] else 'OUTSIDE'}] {m['variant']} / {m['metric']}: yours "
                  f"{m['user']:.4g} (n = {m['n']}), reference band [{m['low']:.4g}, {m['high']:.4g}]")
    if differ:
        print("\nyour runs come from another machine or world than the reference's:")
        for line in differ:
            print(f"  {line}")
        print("  the world is built on your CPU, and another CPU model's float rounding builds another world\n"
              "  (another RM, other runs): bands can miss and some verdicts can differ for that reason alone\n"
              "  (README: Check your results against the reference).")
    print(f"\n{sum(c['agree'] for c in total_c)} of {len(total_c)} claims agree, "
          f"{sum(m['in_band'] for m in total_m)} of {len(total_m)} metrics in band")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
