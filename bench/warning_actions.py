"""What acting on the early warning is worth: each `collapse.on_warning` action against doing nothing,
by final gold, on held-out runs the detector was not fit on (issue 35, item 4).

    python -m bench.warning_actions --source sqlite:////work/det/mlflow.db --detector harness/detector_params.json \\
        --store /work/det/actions [--runs 10] [--workers 2] [--out bench/results_warning_actions.json]

The runs: held-out runs of the detector campaign's store (`analysis.detector`'s split, as the
detector file records it) on which the detector warns; on a run it never warns every action is
doing nothing, so only warned runs can differ. Up to `--runs` of them: up to a third false
alarms (gold held; where acting costs), the rest gold falls (where it may save), each in the store's order. Each is trained again from its
own config.yaml (arms already finished in `--store` are read back, not trained again) (same seed, same world: the same run up to the warning), once per action: none,
stop, raise_kl, rollback, with `collapse.stop_on_collapse=false` so "none" runs its whole budget.
Final gold is `harness.summary`'s final (mean of the last 10% of logged steps; for `stop` those of
the run up to the warning). Per action: the mean paired difference against none with its 95%
t-interval (scipy.stats.ttest_rel), n, and how many runs it made better.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ACTIONS = ("none", "stop", "raise_kl", "rollback")


def train_arm(config_yaml: str, store: str, out_dir: str, name: str, action: str, detector: str) -> float | None:
    """One action on one run's config; its final gold (None: the run failed)."""
    from harness import keys as K
    from harness import tracking
    from harness.config import load_config
    from harness.summary import reduce_run
    from harness.train import train

    cfg = load_config(config_yaml, [
        f"logging.tracking_uri={store}", f"logging.output_dir={out_dir}", f"logging.run_name={name}-{action}",
        "logging.parent_run_id=null", "logging.progress=false", "collapse.stop_on_collapse=false",
        f"collapse.on_warning={action}", f"collapse.detector={detector}", "threads=1"])
    res = train(cfg)
    if res.status != "FINISHED":
        return None
    return reduce_run([v for _, v in tracking.metric_history(store, res.run_id, K.GOLD_SCORE)], "final")


def finished_arms(store: str) -> dict[str, float]:
    """{run name: final gold} of the finished arms already in the bench's store."""
    from harness import keys as K
    from harness import tracking
    from harness.summary import reduce_run

    c = tracking.client(store)
    ids = [e.experiment_id for e in c.search_experiments()]
    runs = c.search_runs(ids, "attributes.status = 'FINISHED'", max_results=50000) if ids else []
    return {r.info.run_name: reduce_run([v for _, v in tracking.metric_history(store, r.info.run_id, K.GOLD_SCORE)], "final")
            for r in runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.warning_actions", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True, help="the detector campaign's MLflow store")
    ap.add_argument("--detector", required=True, help="the detector file (its provenance names the fit split)")
    ap.add_argument("--store", required=True, help="a folder for the action runs' store and run folders")
    ap.add_argument("--runs", type=int, default=10, help="warned held-out runs to act on (default 10)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="bench/results_warning_actions.json")
    a = ap.parse_args(argv)
    import numpy as np
    from scipy import stats

    from analysis import detector as D
    from harness import tracking
    from harness.detector import load_params

    params = load_params(a.detector)
    split = D.Split(**params.provenance["split"])
    runs = [r for r in D.assign(D.load_runs(a.source), split) if r.group != "fit" and D.has_features(r, tuple(params.features))]
    every = [r for r in runs if D.warn_step(params, r) is not None]
    # false alarms are where acting costs, falls where it may save: up to a third of the runs from the
    # false alarms, the rest from the falls, each in the store's order
    alarms = [r for r in every if not r.fell][: a.runs // 3]
    falls = [r for r in every if r.fell][: a.runs - len(alarms)]
    warned = [r for i in range(max(len(falls), len(alarms) * 2))  # interleaved: a cut-short bench holds both
              for r in falls[2 * i:2 * i + 2] + alarms[i:i + 1]]
    print(f"{len(runs)} held-out runs, {len(every)} warned; acting on "
          f"{len(warned)} ({sum(r.fell for r in warned)} whose gold fell)", flush=True)
    store_dir = Path(a.store)
    store_dir.mkdir(parents=True, exist_ok=True)
    store = f"sqlite:///{store_dir.resolve() / 'mlflow.db'}"
    tmp = Path(tempfile.mkdtemp())
    jobs, done = {}, finished_arms(store)  # a rerun of the bench into its store trains only the missing arms
    with ProcessPoolExecutor(a.workers) as pool:
        for r in warned:
            (tmp / r.run_id).mkdir()
            cfg_path = tracking.client(a.source).download_artifacts(r.run_id, "config.yaml", str(tmp / r.run_id))
            for action in ACTIONS:
                name = f"{r.variant}-{r.run_id[:6]}"
                if f"{name}-{action}" not in done:
                    jobs[(r.run_id, action)] = pool.submit(train_arm, str(cfg_path), store, str(store_dir / "runs"),
                                                           name, action, str(Path(a.detector).resolve()))
        gold = {k: f.result() for k, f in jobs.items()}
    for r in warned:
        for action in ACTIONS:
            gold.setdefault((r.run_id, action), done.get(f"{r.variant}-{r.run_id[:6]}-{action}"))
    rows = [{"run_id": r.run_id, "ablation": r.ablation, "variant": r.variant, "fell": r.fell,
             "warning": D.warn_step(params, r), "onset": r.onset, **{act: gold[(r.run_id, act)] for act in ACTIONS}}
            for r in warned]
    summary = {}
    for act in ACTIONS[1:]:
        pairs = [(row[act], row["none"]) for row in rows if row[act] is not None and row["none"] is not None]
        x, y = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
        t = stats.ttest_rel(x, y) if len(pairs) >= 2 else None
        ci = t.confidence_interval(0.95) if t is not None else (float("nan"), float("nan"))
        summary[act] = {"n": len(pairs), "mean_diff": float((x - y).mean()) if pairs else float("nan"),
                        "ci": [float(ci[0]), float(ci[1])], "p": float(t.pvalue) if t is not None else float("nan"),
                        "better": int((x > y).sum()), "fell_mean_diff": float(np.mean([
                            row[act] - row["none"] for row in rows if row["fell"] and row[act] is not None] or [np.nan])),
                        "held_mean_diff": float(np.mean([
                            row[act] - row["none"] for row in rows if not row["fell"] and row[act] is not None] or [np.nan]))}
        s = summary[act]
        print(f"{act:<9} final gold minus doing nothing: {s['mean_diff']:+.3f} [{s['ci'][0]:+.3f}, {s['ci'][1]:+.3f}] "
              f"(paired t, n {s['n']}, p {s['p']:.3g}); better on {s['better']} of {s['n']}; on gold falls "
              f"{s['fell_mean_diff']:+.3f}, on false alarms {s['held_mean_diff']:+.3f}")
    from harness.provenance import cpu

    Path(a.out).write_text(json.dumps({"detector": a.detector, "source_runs": len(runs), "rows": rows, "summary": summary,
                                       "cpu": cpu(), "commit": tracking.git_commit()}, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
