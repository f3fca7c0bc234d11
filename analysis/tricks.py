"""Which tricks matter: the analysis of a design study (a sweep file with `objectives:` run by
harness.sweep, e.g. ablations/study_tricks.yaml), read from its Optuna study and MLflow runs,
into results/<name>/ (tables, figures, tricks.json) and the combined report (reports/tricks.py):

    python -m analysis.tricks study_tricks                       # the analysis
    python -m analysis.tricks best study_tricks --world 2        # a figure file: its best configuration vs PPO-max

A configuration's score is the mean over its runs (seeds x worlds) of the study's first objective
(final gold). Per choice value, as Andrychowicz et al. 2021 report it:
- n, the configurations drawn with it (a dependent choice counts only where it was drawn), and the
  score's distribution (violins, analysis.tricks_figures);
- the conditional 95th percentile of the score, with a percentile bootstrap interval over those
  configurations (scipy.stats.bootstrap);
- the collapse rate over their runs (the gold truth), Clopper-Pearson interval;
- the share of the top 5% of configurations that have it, beside its share of all configurations,
  with a bootstrap interval (configurations resampled, the top 5% taken again).
Per choice, its importance and how far it lies above chance, with a bootstrap interval (configurations
resampled) at the Bonferroni level 1 - 0.05/k over the k choices, so that the intervals of every choice
that does not matter hold 0 together with 95% confidence:
- anova (the default): the first-order variance share (the first-order Sobol index of a design whose
  choices are drawn independently), eta^2 = sum_v n_v (mean_v - mean)^2 / sum (y - mean)^2 over the
  configurations where the choice was drawn, above chance: minus its expectation when the values do not
  matter, (k - 1)/(n - 1) (k values, n configurations: the permutation mean of eta^2);
- ped_anova (Optuna's PED-ANOVA: the top 10% against the rest; it handles choices drawn only `when`) or
  fanova (Optuna's fANOVA; it drops them): the evaluator's importance as a share of the total, above
  chance: minus its permutation null (the same evaluator on the same configurations, scores shuffled).
Per pair of choices, the F test of their interaction beyond every choice's main effect (least squares:
the additive model of all choices, then the pair's cells added, where both were drawn); the strongest as
heat maps of the mean score per value pair. Per pair of worlds, the Spearman rank correlation of the
per-value 95th percentiles (and of the importances), the interval by resampling configurations (paired:
each runs on every world). The claims of the one-factor figure files against the design:
analysis.tricks_claims.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.compare import rounded
from analysis.store import STUDY_OPTIONS
from analysis.tricks_data import (  # noqa: F401 - the analysis's parts, one import away
    BOOTSTRAP,
    EVALUATORS,
    IMPORTANCE_BOOTSTRAP,
    LEVEL,
    MIN_CONFIGS,
    NOT_DRAWN,
    QUANTILE,
    TOP,
    StudyData,
    best_config,
    importances,
    interaction,
    interactions,
    load_study,
    on_world,
    pair_table,
    percentile_ci,
    provenance_of,
    throughput,
    top_mask,
    trial_params,
    value_table,
    world_agreement,
)
from harness.schema import ConfigError, read_yaml


def analyse(d: StudyData, *, out_dir: str | Path | None = None, evaluator: str = "anova",
            B: int = BOOTSTRAP, B_importance: int = IMPORTANCE_BOOTSTRAP, seed: int = 0, claims: bool = True,
            figures: bool = True, ablations_dir: str | Path | None = None) -> dict[str, Any]:
    """Every table, the figures and tricks.json into out_dir (default results/<name>/); returns the summary
    (what reports/tricks.py renders): tables as DataFrames, figure paths, notes."""
    out = Path(out_dir or Path("results") / d.name)  # the name was checked by harness.sweep: a safe path component
    out.mkdir(parents=True, exist_ok=True)
    notes = d.notes  # the claims table adds its own
    if len(d.configs) < 2 * MIN_CONFIGS:
        notes.append(f"{len(d.configs)} configurations finished: intervals need at least {2 * MIN_CONFIGS}")
    params = trial_params(d)
    s: dict[str, Any] = {"name": d.name, "title": d.attr.get("title") or _file_title(d) or d.name, "score": d.score, "objectives":
                         d.objectives, "configs": len(d.configs), "runs": len(d.runs), "worlds": d.worlds(),
                         "evaluator": evaluator, "notes": notes, "maximize": d.maximize}
    s["values"] = value_table(d, B=B, seed=seed)
    s["importances"] = importances(d, evaluator=evaluator, B=B_importance, seed=seed, params=params)
    s["interactions"] = interactions(d)
    s["worlds_agreement"] = world_agreement(d, B=min(B, 200), seed=seed, params=params)
    s["throughput"] = throughput(d)
    s["best"] = best_config(d)
    s["provenance"] = provenance_of(d)
    if claims:
        from analysis.tricks_claims import claims_table

        s["claims"] = claims_table(d, ablations_dir=ablations_dir)
    for key in ("values", "importances", "interactions", "worlds_agreement", "claims"):
        if isinstance(s.get(key), pd.DataFrame):
            s[key].to_csv(out / f"tricks_{key}.csv", index=False)
    if figures:
        from analysis.tricks_figures import draw

        s["figures"] = draw(d, s, out)
    # the figures by file name: tricks.json lies beside them (a committed reference folder moves with its checkout)
    (out / "tricks.json").write_text(json.dumps({**compact(s), "figures": [Path(f).name for f in s.get("figures") or []]},
                                                indent=1, default=str, allow_nan=True, sort_keys=True) + "\n")
    s["out"] = str(out)
    return s


def _file_title(d: StudyData) -> str:
    """The sweep file's title, for a study recorded before its attr kept it."""
    try:
        return str(read_yaml(d.attr["sweep_file"]).get("title") or "")
    except (KeyError, ConfigError):
        return ""


def compact(s: dict[str, Any]) -> dict[str, Any]:
    """The summary as plain JSON data (tables as lists of records, floats to 4 significant digits)."""
    def num(x: Any) -> Any:
        if isinstance(x, (float, np.floating)):
            return rounded(float(x))  # reference.json's rounding
        if isinstance(x, (np.integer,)):
            return int(x)
        if isinstance(x, (np.bool_,)):
            return bool(x)
        return x

    out = {}
    for k, v in s.items():
        if isinstance(v, pd.DataFrame):
            out[k] = [{c: num(x) for c, x in r.items()} for r in v.to_dict("records")]
        elif isinstance(v, dict):
            out[k] = {a: num(b) if not isinstance(b, dict) else {x: num(y) for x, y in b.items()} for a, b in v.items()}
        else:
            out[k] = num(v)
    return out


def headline(s: dict[str, Any], rows: int = 8) -> list[str]:
    """The README's table "which tricks matter": choices by importance above chance, with the interval, the
    best value by conditional 95th percentile and its top-5% share."""
    imp, vals = s["importances"], s["values"]
    lines = ["| choice | importance above chance [CI] | best value (95th pct. [CI]) | its share of the top 5% | verdict |",
             "| --- | --- | --- | --- | --- |"]
    for r in imp.head(rows).itertuples():
        v = vals[(vals["choice"] == r.choice) & (vals["value"] != NOT_DRAWN)].dropna(subset=["percentile"])
        best = v.loc[v["percentile"].idxmax() if s["maximize"] else v["percentile"].idxmin()] if len(v) else None
        verdict = "matters" if r.ci_low > 0 else "no effect found"
        lines.append(f"| {r.choice} | {_f(r.above_chance)} [{_f(r.ci_low)}, {_f(r.ci_high)}] | "
                     + (f"{best.value} ({_f(best.percentile)} [{_f(best.ci_low)}, {_f(best.ci_high)}]) | "
                        f"{_f(best.top_share)} (of all: {_f(best.share)})" if best is not None else "– | –")
                     + f" | {verdict} |")
    return lines


def _f(x: Any) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.3g}"


# ------------------------------------------------------------------ the command line
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["best"]:
        from analysis.tricks_best import main as best_main

        return best_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m analysis.tricks", description=__doc__, parents=[STUDY_OPTIONS],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="python -m analysis.tricks best --help: the best configuration against PPO-max")
    p.add_argument("study", help="the study's name (its Optuna study) or its sweep YAML")
    p.add_argument("--out-dir", help="where tables and figures go (default: results/<name>/)")
    p.add_argument("--evaluator", choices=EVALUATORS, default="anova", help="importance: anova (default: the "
                   "first-order variance share), ped_anova or fanova (Optuna's evaluators; module doc)")
    p.add_argument("--bootstrap", type=int, default=BOOTSTRAP, metavar="B", help=f"resamples (default {BOOTSTRAP})")
    p.add_argument("--importance-bootstrap", type=int, default=IMPORTANCE_BOOTSTRAP, metavar="B",
                   help=f"resamples for importances (default {IMPORTANCE_BOOTSTRAP}; ped_anova and fanova fit the "
                   "evaluator twice per resample)")
    p.add_argument("--no-claims", action="store_true", help="skip the table against the figure files' claims")
    p.add_argument("--ablations-dir", help="figure-file folder for the claims (default: ./ablations, else the repo's)")
    args = p.parse_args(argv)
    for flag, v in (("--bootstrap", args.bootstrap), ("--importance-bootstrap", args.importance_bootstrap)):
        if v < 0:
            p.error(f"{flag}: got {v}; allowed: an integer >= 0")
    try:
        d = load_study(args.study, args.tracking_uri, args.storage)
    except (KeyError, ValueError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    s = analyse(d, out_dir=args.out_dir, evaluator=args.evaluator, B=args.bootstrap,
                B_importance=args.importance_bootstrap, claims=not args.no_claims, ablations_dir=args.ablations_dir)
    print(f"== {d.name}: {s['configs']} configurations, {s['runs']} runs, worlds {s['worlds'] or '-'}; "
          f"score = {d.score} (mean over a configuration's runs) ==")
    t = s["throughput"]
    if math.isfinite(t.get("runs_per_hour", math.nan)):
        print(f"throughput: {t['runs']} runs in {t['hours']:.2f} h = {t['runs_per_hour']:.0f} runs/h "
              f"(mean run {t['mean_run_s']:.0f} s)")
    print("\nwhich tricks matter:\n" + "\n".join(headline(s)))
    for note in s["notes"]:
        print(f"note: {note}")
    print(f"\ntables, figures, tricks.json: {s['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
