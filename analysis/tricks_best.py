"""Beyond PPO-max: a design study's best configuration against PPO-max on a world it was not selected on.

    python -m analysis.tricks best study_tricks --world 2          # writes ablations/study_tricks_best.yaml
    python -m harness.ablate ablations/study_tricks_best.yaml --workers 2
    python -m analysis.claims study_tricks_best

The best configuration (the best score, analysis.tricks.best_config) was selected among many on the
study's own worlds and seeds, so its score there is biased upward (the winner's curse). This writes a
figure file with two variants, PPO-max (bases/ppo_max.yaml) and that configuration (every computed
setting in which it differs from PPO-max), both at 5 seeds the study did not use, on a world it did not
run on, with the study's own steps and settings; its claims ask whether the best configuration reaches a
higher final gold reward than PPO-max there, and whether it does not collapse.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import optuna
import yaml

from analysis.store import STUDY_OPTIONS
from analysis.tricks_data import best_config, load_study
from harness.config import computed_fields, from_dict, merge
from harness.registry import ABLATIONS_DIR, RegistryError, load_registry, parse_seeds
from harness.schema import ConfigError, read_yaml
from harness.sweepfile import load_sweep, trial_config
from harness.tracking import redact

PPO_MAX = "bases/ppo_max.yaml"
SEEDS = 5  # the fewest a verdict accepts (analysis.stats.MIN_SEEDS)
SKIPPED = ("seed", "data.world_dir")


def best_figure(d: Any, *, world: int, seeds: list[int] | None = None, out: str | Path | None = None,
                study_file: str | Path | None = None) -> Path:
    """Write the figure file (module doc) and return its path; ConfigError for a world or seed the study used."""
    spec = load_sweep(study_file or d.attr["sweep_file"], tracking_uri=d.tracking_uri)
    problems = []
    if world in spec.worlds or (not spec.worlds and world == 0):
        problems.append(f"--world {world}: the study ran on world(s) {sorted(spec.worlds) or [0]}; allowed: another")
    seeds = seeds or [max(spec.seeds) + 1 + i for i in range(SEEDS)]
    if set(seeds) & set(spec.seeds):
        problems.append(f"--seeds {seeds}: the study used seeds {spec.seeds}; allowed: fresh ones")
    best = best_config(d)
    if not best:
        problems.append(f"study {d.name!r}: no configuration has a score yet")
    if problems:
        raise ConfigError(problems)
    trial = optuna.load_study(study_name=d.name, storage=d.storage_url).trials[best["number"]]
    study_set = {**spec.file.set, "ppo.steps": spec.steps}
    mine = computed_fields(from_dict(trial_config(spec, trial.params)))
    base = read_yaml(ABLATIONS_DIR / PPO_MAX)
    theirs = computed_fields(from_dict(functools.reduce(merge, [study_set], base)))
    changes = {k: v for k, v in mine.items() if theirs.get(k) != v and k not in SKIPPED}
    out = Path(out or ABLATIONS_DIR / f"{d.name}_best.yaml")
    name = f"best of {d.name} (trial {best['number']})"
    fig = {
        "name": out.stem, "figure": "tricks", "order": 99,
        "title": f"Beyond PPO-max: the best configuration of {d.name} against PPO-max on world {world}",
        "description": (f"The configuration with the best {d.score} among the {len(d.configs)} of design study "
                        f"{d.name} (worlds {sorted(spec.worlds) or [0]}, seeds {spec.seeds}; its score there "
                        f"{best['score']:.4g}), rerun at {len(seeds)} fresh seeds on world {world}, which it was not "
                        f"selected on, against PPO-max with the study's steps and settings."),
        "inferred": ["The best configuration's values: " + ", ".join(f"{k}={v}" for k, v in best["values"].items())],
        "kind": "train", "base": PPO_MAX, "set": study_set, "seeds": seeds, "worlds": [world],
        **({"world_set": spec.file.world_set} if spec.file.world_set else {}),
        "variants": [{"name": "PPO-max"}, {"name": name, "set": changes}],
        "panels": ["objective/gold_score", "objective/rm_score", "objective/kl", "response/length_mean"],
        "claims": [
            {"statement": "The design's best configuration reaches a higher final gold reward than PPO-max on a world "
                          "it was not selected on.", "source": "ours",
             "rule": {"kind": "compare", "metric": "objective/gold_score", "lower": "PPO-max", "higher": name}},
            {"statement": "The design's best configuration does not collapse there.", "source": "ours",
             "rule": {"kind": "collapses", "variant": name, "expected": False}},
        ],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    try:  # the run command as a checkout's user types it
        shown = out.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        shown = out
    head = (f"# Written by `python -m analysis.tricks best {d.name} --world {world}` from the study in "
            f"{redact(d.storage_url)} (trial {best['number']}); run: python -m harness.ablate {shown}\n")
    out.write_text(head + yaml.safe_dump(fig, sort_keys=False, allow_unicode=True, width=110))
    try:
        load_registry(out)
    except RegistryError as e:
        raise ConfigError([f"the written {out} does not load: {p}" for p in e.problems]) from None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.tricks best", description=__doc__, parents=[STUDY_OPTIONS],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", help="the design study's name (or its sweep YAML)")
    p.add_argument("--world", type=int, required=True, help="a world seed the study did not run on, e.g. 2")
    p.add_argument("--seeds", help=f"seeds, e.g. 10-14 (default: the {SEEDS} after the study's largest)")
    p.add_argument("--out", help="the figure file to write (default: ablations/<study>_best.yaml)")
    p.add_argument("--study-file", help="the study's sweep file (default: the one the study was run from)")
    args = p.parse_args(argv)
    try:
        d = load_study(args.study, args.tracking_uri, args.storage)
        path = best_figure(d, world=args.world, seeds=parse_seeds(args.seeds) if args.seeds else None,
                           out=args.out, study_file=args.study_file)
    except (KeyError, ValueError) as e:  # ConfigError is a ValueError
        print(f"error: {e.args[0] if e.args and not isinstance(e, ConfigError) else e}", file=sys.stderr)
        return 2
    print(f"wrote {path}\nrun it:  python -m harness.ablate {path} --workers 2\n"
          f"judge:   python -m analysis.claims {path.stem if path.parent.resolve() == ABLATIONS_DIR.resolve() else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
