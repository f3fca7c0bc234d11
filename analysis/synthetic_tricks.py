"""A synthetic design study written straight into an Optuna storage and an MLflow store, in the formats
harness.sweep writes (the study's ATTR_SWEEP attr, each trial's `runs` attr, child runs tagged as sweep
runs with gold and KL curves and study/<objective> metrics), for the tests of analysis.tricks and for
previews (`python -m analysis.synthetic_tricks --tracking-uri sqlite:///demo.db` writes the study of
ablations/study_tricks.yaml's search space with `algorithm` planted to matter).

The design is the sweep file's own (its sampler asked trial by trial, harness.design.suggest); a run's
numbers come from `model(params, world, rng)`: its final gold and final KL; it collapsed when its final
gold is below `collapse_below` (default COLLAPSE_BELOW).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

import numpy as np
import optuna

from harness import design, tracking
from harness import keys as K
from harness.sweepfile import SweepSpec, load_sweep, make_sampler
from harness.sweepstore import ATTR_SWEEP

COLLAPSE_BELOW = -1.0
Model = Callable[[dict[str, Any], Any, np.random.Generator], tuple[float, float]]


def planted(choice: str, value: Any, effect: float = 1.0, noise: float = 0.3) -> Model:
    """Final gold = effect where `choice` took `value`, else 0, plus world offset and noise; final KL =
    1 - 5 eta (ppo.kl_coef) plus noise: one choice planted to matter for gold, one for KL."""
    def model(params: dict[str, Any], world: Any, rng: np.random.Generator) -> tuple[float, float]:
        gold = effect * design.same(params.get(choice), value) + 0.1 * (world or 0) + rng.normal(0, noise)
        kl = 1.0 - 5.0 * float(params.get("ppo.kl_coef", 0.0) or 0.0) + rng.normal(0, 0.05)
        return float(gold), float(kl)
    return model


def write_study(spec: SweepSpec, tracking_uri: str, storage_url: str, model: Model, *, trials: int | None = None,
                seed: int = 0, steps: int = 10, collapse_below: float = COLLAPSE_BELOW) -> optuna.Study:
    """The study of `spec` (its name, sampler and search space), `trials` COMPLETE trials, one MLflow run
    per seed x world of each (collapsed when its final gold is below `collapse_below`); returns the study."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=storage_url, study_name=spec.name, direction=spec.direction,
                                sampler=make_sampler(spec))
    study.set_user_attr(ATTR_SWEEP, spec.to_attr())
    parent = tracking.start_run(tracking_uri, spec.name, f"sweep {spec.name}",
                                tags={K.TAG_ROLE: "parent", K.TAG_SWEEP: spec.name})
    rng = np.random.default_rng(seed)
    for _ in range(trials or spec.trials):
        trial = study.ask()
        params = design.suggest(spec.space, trial)
        runs = []
        for s, w in spec.units:
            gold, kl = model(params, w, rng)
            collapsed = gold < collapse_below
            tags = {K.TAG_ROLE: "train", K.TAG_SWEEP: spec.name, K.TAG_TRIAL: str(trial.number), K.TAG_SEED: str(s),
                    K.TAG_COLLAPSED: str(collapsed).lower(), **({} if w is None else {K.TAG_WORLD_SEED: str(w)})}
            rid = tracking.start_run(tracking_uri, spec.name, f"{spec.name}-t{trial.number}-s{s}-w{w}", tags=tags,
                                     parent_run_id=parent)
            curve = np.linspace(0, 1, steps)
            points = [(K.GOLD_SCORE, float(gold * c), i + 1) for i, c in enumerate(curve)]
            points += [(K.KL, float(kl * c), i + 1) for i, c in enumerate(curve)]
            values = {"final_gold": float(np.mean([v for _, v, _ in points[:steps][-max(1, steps // 10):]])),
                      "gold_auc": float(np.mean([v for _, v, _ in points[:steps]])), "collapsed": float(collapsed),
                      "final_kl": float(np.mean([v for _, v, _ in points[steps:][-max(1, steps // 10):]]))}
            points += [(f"{K.STUDY_PREFIX}{k}", v, steps) for k, v in values.items()]
            tracking.MetricLogger(tracking_uri, rid).log_points(points)
            tracking.end_run(tracking_uri, rid)
            runs.append({"run_id": rid, "seed": s, "world": w, "collapsed": collapsed,
                         **{o.name: values[o.name] for o in spec.objectives if o.name in values}})
        trial.set_user_attr("runs", runs)
        trial.set_user_attr("outcome", "complete")
        study.tell(trial, float(np.mean([r[spec.objectives[0].name] for r in runs])))
    tracking.end_run(tracking_uri, parent)
    return study


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.synthetic_tricks", description=__doc__)
    ap.add_argument("--tracking-uri", required=True, help="MLflow store to write to, e.g. sqlite:///demo.db")
    ap.add_argument("--storage", help="Optuna storage (default: optuna.db next to the MLflow sqlite file)")
    ap.add_argument("--file", default=str(Path(__file__).resolve().parents[1] / "ablations" / "study_tricks.yaml"),
                    help="the sweep file whose design is written (default: ablations/study_tricks.yaml)")
    ap.add_argument("--trials", type=int, default=64)
    args = ap.parse_args(argv)
    from harness.sweepstore import default_storage_url

    spec = load_sweep(args.file, tracking_uri=args.tracking_uri)
    write_study(spec, args.tracking_uri, args.storage or default_storage_url(args.tracking_uri),
                planted("algorithm", "ppo"), trials=args.trials)
    print(f"wrote study {spec.name} ({args.trials} trials) to {args.tracking_uri}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
