"""One ablation's runs read back from the MLflow store alone, as pandas (`load_ablation`).

Which runs belong to an ablation: the runs of the experiment named after it (CONTRACTS.md) that
carry a `harness.variant` tag and are not the parent. Reruns leave several runs per
(variant, seed); the newest FINISHED one wins (else the newest), so a half-done rerun does not
hide a finished run. World ablations (Fig. 2/3) whose runs are missing fall back to the world
runs (tag harness.role=world) of the `world` experiment, one variant per run name.

Worlds: a grid run over several worlds (the runner's `--worlds 0,1,2`) holds one run per
(variant, world, seed); a run's world is its tag `provenance.world.hash` (harness.provenance; ''
for runs without it, which form one world of their own) and its world seed the tag
harness.world_seed where the runner set it. `AblationData.worlds` lists them,
`AblationData.in_world` is one world's runs (what analysis.claims judges per world).
"""
from __future__ import annotations

import argparse
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import pandas as pd

from harness import keys as K
from harness import tracking
from harness.registry import (
    STANDARD_PANELS,
    Registry,
    UnknownAblation,
    Variant,
    ablation_names,
    find_ablation,
    load_registry,
)
from harness.schema import did_you_mean
from harness.summary import reduce_run

WORLD_EXPERIMENT = "world"  # harness.world.build_world's default experiment
WORLD_HASH_TAG = "provenance.world.hash"  # harness.provenance.record: the world a run trained on
WORLD_SEED_TAG = K.TAG_WORLD_SEED  # set by the runner on grids over several worlds
RUN_COLUMNS = ["run_id", "variant", "seed", "status", "collapsed", "collapse_step", "gold_onset", "warning_step",
               "best_step", "start_time", "figure", "git_commit", "experiment", "metric_keys", "provenance", "world",
               "world_seed"]
METRIC_COLUMNS = ["run_id", "variant", "seed", "metric", "step", "value"]
SAMPLE_COLUMNS = ["variant", "seed", "run_id", "step", "collapsed", "prompt", "response", "rm_score", "gold_score",
                  "length"]
def smoothing(text: str) -> int:
    """argparse type of --smooth (analysis.figures, reports.build): a rolling mean over K >= 1 logged steps
    (0 or less would draw nothing, silently)."""
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: an integer >= 1 (1 = raw, K = a rolling mean over K "
                                         "logged steps)")
    return k


STORE_OPTIONS = argparse.ArgumentParser(add_help=False)
"""The options of every CLI that reads ablations (argparse `parents=[STORE_OPTIONS]`)."""
STORE_OPTIONS.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
STORE_OPTIONS.add_argument("--ablations-dir", help="registry folder (default: the repo's ablations/)")
STUDY_OPTIONS = argparse.ArgumentParser(add_help=False)
"""The options of every CLI that reads an Optuna study (sweep plots, the design study's analysis and best)."""
STUDY_OPTIONS.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
STUDY_OPTIONS.add_argument("--storage", help="Optuna storage URL (default: optuna.db next to MLflow's sqlite)")


def world_name(world: str, seed: str | int = "") -> str:
    """How reports name a world: 'world seed 1 (4bde1a81)', 'world 4bde1a81', or 'runs without a world hash'."""
    if not world:
        return "runs without a world hash" + (f" (world seed {seed})" if seed != "" else "")
    return f"world seed {seed} ({world[:8]})" if seed != "" else f"world {world[:8]}"


def default_tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else sqlite:///mlflow.db (harness.tracking.resolve_uri, as every writer)."""
    return tracking.resolve_uri()


def store_missing(tracking_uri: str) -> bool:
    """A sqlite store whose file is not there (a mistyped path): readers report it, never create it."""
    db = tracking.sqlite_path(tracking_uri)
    return db is not None and not db.is_file()


def _search(tracking_uri: str, experiment: str, filter_string: str = "") -> list:
    """Every run of the experiment matching the filter ([] when the experiment does not exist, or the
    sqlite file is not there: a reader never creates a store, so a mistyped path leaves no empty
    database or folder behind and says "holds no runs")."""
    if store_missing(tracking_uri):
        return []
    c = tracking.client(tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None or exp.lifecycle_stage == "deleted":
        return []
    return list(c.search_runs([exp.experiment_id], filter_string, max_results=50000))  # MLflow's largest page


def _run_row(run, experiment: str) -> dict[str, Any]:
    tags = run.data.tags
    step, best = run.data.metrics.get(K.COLLAPSE_STEP), tags.get(K.TAG_BEST_STEP, "")
    seed = tags.get(K.TAG_SEED, "")
    return {
        "run_id": run.info.run_id, "variant": tags.get(K.TAG_VARIANT, run.info.run_name),
        "seed": int(seed) if seed.lstrip("-").isdigit() else 0, "status": run.info.status,
        "collapsed": tags.get(K.TAG_COLLAPSED, "").lower() == "true" or step is not None,
        "collapse_step": float("nan") if step is None else float(step),
        **{col: float(run.data.metrics.get(key, float("nan"))) for col, key in (("gold_onset", K.GOLD_ONSET),
                                                                               ("warning_step", K.WARNING_STEP))},
        "best_step": float(best) if best else float("nan"), "start_time": run.info.start_time,
        "figure": tags.get(K.TAG_FIGURE, ""), "git_commit": tags.get(K.TAG_COMMIT, ""), "experiment": experiment,
        "metric_keys": set(run.data.metrics),
        "provenance": provenance_tags(tags),
        "world": tags.get(WORLD_HASH_TAG, ""), "world_seed": tags.get(WORLD_SEED_TAG, ""),
    }


def provenance_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """A run's `provenance.*` tags (harness.provenance.record), the prefix dropped."""
    return {k.removeprefix("provenance."): v for k, v in tags.items() if k.startswith("provenance.")}


def distinct_values(dicts: Iterable[Mapping[str, str]]) -> dict[str, set[str]]:
    """Each key of the dicts (runs' provenance tags) -> its distinct values."""
    seen: dict[str, set[str]] = {}
    for d in dicts:
        for k, v in d.items():
            seen.setdefault(k, set()).add(v)
    return seen


def one_or_sorted(seen: Mapping[str, Iterable[str]]) -> dict[str, str | list[str]]:
    """Each key, in order, -> its one value, or its distinct values sorted: provenance as the reference
    summaries keep it."""
    out: dict[str, str | list[str]] = {}
    for k in sorted(seen):
        values = sorted(set(seen[k]))
        out[k] = values[0] if len(values) == 1 else values
    return out


def find_runs(tracking_uri: str, ablation: str, *, world_fallback: bool = False, dedupe: bool = True) -> pd.DataFrame:
    """One row per child run of the ablation (RUN_COLUMNS), sorted by variant, world and seed; dedupe
    keeps the newest FINISHED run per (variant, world, seed), else the newest."""
    rows = [_run_row(r, ablation) for r in _search(tracking_uri, ablation, f"tags.`{K.TAG_VARIANT}` != ''")
            if r.data.tags.get(K.TAG_ROLE) != "parent" and r.data.tags.get(K.TAG_ABLATION, ablation) == ablation]
    if not rows and world_fallback and ablation != WORLD_EXPERIMENT:
        world = _search(tracking_uri, WORLD_EXPERIMENT, f"tags.`{K.TAG_ROLE}` = 'world'")
        rows = [_run_row(r, WORLD_EXPERIMENT) for r in world]
    runs = pd.DataFrame(rows, columns=RUN_COLUMNS)
    if dedupe:
        runs = runs.assign(finished=runs["status"].eq("FINISHED"))
        runs = runs.sort_values(["finished", "start_time"], ascending=False)
        key = ["variant", "world", "seed"]  # one seed on two worlds: two runs, not a rerun
        runs = runs.drop_duplicates(key).drop(columns="finished").sort_values(key)
    return runs.reset_index(drop=True)


def ablations_in_store(tracking_uri: str) -> list[str]:
    """Experiment names that hold runs with a harness.variant tag (what `find_runs` can read)."""
    c, tagged = tracking.client(tracking_uri), f"tags.`{K.TAG_VARIANT}` != ''"
    return sorted(e.name for e in c.search_experiments()
                  if len(c.search_runs([e.experiment_id], tagged, max_results=1)))


def _by_step(tracking_uri: str, run_id: str, folder: str, stem: str) -> dict[int, str]:
    """Step -> path of the run's `folder/{stem}XXXXXX.json` artifacts (a lost folder: none)."""
    try:
        artifacts = tracking.client(tracking_uri).list_artifacts(run_id, folder)
    except Exception:
        return {}
    name = re.compile(rf"{stem}(\d+)\.json")
    return dict(sorted((int(m[1]), a.path) for a in artifacts if (m := name.fullmatch(Path(a.path).name))))


def _json(tracking_uri: str, run_id: str, path: str) -> Any:
    try:
        return tracking.load_json_artifact(tracking_uri, run_id, path)
    except Exception:
        return None


@dataclass
class AblationData:
    """An ablation's spec and runs; step metrics and artifacts are read on first use and cached."""

    spec: Registry
    tracking_uri: str
    runs: pd.DataFrame
    parent_run_id: str | None
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    def _cached(self, key: Any, load) -> Any:
        if key not in self._cache:
            self._cache[key] = load()
        return self._cache[key]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def variants(self) -> list[str]:
        """Variants with runs, in the registry's order; names only the runs know go last (sorted)."""
        have = set(self.runs["variant"])
        return [v for v in self.spec.variant_names if v in have] + sorted(have - set(self.spec.variant_names))

    @property
    def missing_variants(self) -> list[str]:
        """Registry variants that no run carries."""
        return [v for v in self.spec.variant_names if v not in set(self.runs["variant"])]

    @property
    def worlds(self) -> list[str]:
        """The runs' worlds (tag provenance.world.hash, '' where a run lacks it), by world seed
        (tag harness.world_seed; untagged last), then hash."""
        seeds = {w: self.world_seed(w) for w in set(self.runs["world"])}
        number = lambda s: (0, int(s)) if s.lstrip("-").isdigit() else (1, 0)  # noqa: E731
        return sorted(seeds, key=lambda w: (*number(seeds[w]), w))

    def world_seed(self, world: str) -> str:
        """The world seed its runs carry ('' when none does; several: joined with '/')."""
        return "/".join(sorted({s for s in self.runs.loc[self.runs["world"] == world, "world_seed"] if s}))

    def world_label(self, world: str) -> str:
        return world_name(world, self.world_seed(world))

    def in_world(self, world: str) -> "AblationData":
        """The runs of one world, sharing this object's cache (the same spec and store)."""
        runs = self.runs[self.runs["world"] == world].reset_index(drop=True)
        return AblationData(self.spec, self.tracking_uri, runs, self.parent_run_id, self._cache)

    def run_ids(self, variant: str) -> list[str]:
        return list(self.runs.loc[self.runs["variant"] == variant, "run_id"])

    def shown_metric(self, key: str) -> str:
        """What figures, tables and claims read for `key`: the token-pooled perplexity stands in for the
        per-sample one (spiky) when every run logged it, so no figure mixes the two."""
        every = not self.runs.empty and all(K.PPL_TOKENS in k for k in self.runs["metric_keys"])
        return K.PPL_TOKENS if key == K.PPL and every else key

    def metrics(self, keys: list[str] | str) -> pd.DataFrame:
        """Tidy step metrics (METRIC_COLUMNS) of the keys over all runs; a step logged twice (a resumed
        run) keeps the last value. Fetched on a few threads (the sqlite store costs a call per key)."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        # cached per run, so that a world's view (in_world, sharing the cache) and the whole read each other's
        jobs = [(r, k) for k in keys for r in self.runs.itertuples() if ("metric", k, r.run_id) not in self._cache]
        with ThreadPoolExecutor(max_workers=8) as pool:
            histories = pool.map(lambda job: tracking.metric_history(self.tracking_uri, job[0].run_id, job[1]), jobs)
            for (r, k), hist in zip(jobs, histories):
                self._cache[("metric", k, r.run_id)] = pd.DataFrame(hist, columns=["step", "value"]).assign(
                    run_id=r.run_id, variant=r.variant, seed=r.seed, metric=k)
        frames = [f for k in keys for rid in self.runs["run_id"] if not (f := self._cache[("metric", k, rid)]).empty]
        if not frames:
            return pd.DataFrame(columns=METRIC_COLUMNS)
        out = pd.concat(frames, ignore_index=True).drop_duplicates(["run_id", "metric", "step"], keep="last")
        return out[METRIC_COLUMNS].sort_values(["variant", "seed", "metric", "step"]).reset_index(drop=True)

    def per_run(self, key: str, stat: str) -> pd.DataFrame:
        """Per run: run_id, variant, seed, value = `stat` (harness.summary.reduce_run) of the shown `key`."""
        metric = self.shown_metric(key)
        m = self.metrics(metric).sort_values("step")
        per_run = m.groupby(["run_id", "variant", "seed"])["value"].agg(lambda v: reduce_run(v.to_numpy(), stat))
        return per_run.reset_index()

    def rm_score_diffs(self, variant: str) -> np.ndarray:
        """Chosen-minus-rejected RM scores on held-out pairs (world artifact rm_score_diff.json), seeds pooled."""
        loaded = [self._cached(("diff", rid), lambda: _json(self.tracking_uri, rid, K.RM_SCORE_DIFF))
                  for rid in self.run_ids(variant)]
        return np.asarray([x for d in loaded if isinstance(d, dict) for x in d.get("diff") or []], dtype=float)

    def eval_rm_scores(self, variant: str) -> dict[int, np.ndarray]:
        """Eval step -> held-out RM scores (eval/rm_scores_step_XXXXXX.json), seeds pooled."""
        pooled: dict[int, list[float]] = {}
        for rid in self.run_ids(variant):
            for step, path in _by_step(self.tracking_uri, rid, K.EVAL_SCORES_DIR, "rm_scores_step_").items():
                d = self._cached(("eval", rid, step), lambda: _json(self.tracking_uri, rid, path))
                pooled.setdefault(step, []).extend((d.get("rm") or []) if isinstance(d, dict) else [])
        return {s: np.asarray(x, dtype=float) for s, x in pooled.items() if x}

    def samples(self, per_run: int | None = None) -> pd.DataFrame:
        """Rows of each run's last sample table (SAMPLE_COLUMNS); `per_run` caps the rows."""
        rows = []
        for r in self.runs.itertuples():
            steps = _by_step(self.tracking_uri, r.run_id, K.SAMPLES_DIR, "step_")
            last = _json(self.tracking_uri, r.run_id, steps[max(steps)]) if steps else None
            for row in (last.get("rows") or [])[:per_run] if isinstance(last, dict) else []:
                rows.append({"variant": r.variant, "seed": r.seed, "run_id": r.run_id, "step": max(steps),
                             "collapsed": r.collapsed, **{k: row.get(k) for k in SAMPLE_COLUMNS[5:]}})
        return pd.DataFrame(rows, columns=SAMPLE_COLUMNS)


def resolve_spec(ablation: str | Path, tracking_uri: str, ablations_dir: str | Path | None = None) -> Registry:
    """The registry entry for `ablation` (name or YAML path; train configs not resolved); a name only
    the store holds gets a spec from the runs' tags; else UnknownAblation names the closest known."""
    try:
        return load_registry(find_ablation(ablation, ablations_dir), resolve=False)
    except UnknownAblation:
        name = str(ablation)
        runs = pd.DataFrame() if Path(name).suffix in (".yaml", ".yml") else find_runs(tracking_uri, name)
        if runs.empty:
            known = sorted(set(ablation_names(ablations_dir)) | set(ablations_in_store(tracking_uri)))
            raise UnknownAblation(f"unknown ablation {name!r}" + (did_you_mean(name, known) if known else
                                                                  "; the registry and the store hold none")) from None
        return Registry(name=name, figure=next((f for f in runs["figure"] if f), ""), title=name,
                        variants=[Variant(v, {}) for v in sorted(set(runs["variant"]))], panels=list(STANDARD_PANELS))


def load_ablation(ablation: str | Path | Registry, tracking_uri: str | None = None,
                  ablations_dir: str | Path | None = None) -> AblationData:
    """Spec + runs + newest parent run of one ablation; metrics load lazily via `.metrics(keys)`."""
    uri = tracking_uri or default_tracking_uri()
    spec = ablation if isinstance(ablation, Registry) else resolve_spec(ablation, uri, ablations_dir)
    runs = find_runs(uri, spec.name, world_fallback=spec.kind == "world")
    fallback = not runs.empty and set(runs["experiment"]) == {WORLD_EXPERIMENT}
    if spec.kind == "world" and len(spec.variants) == 1 and fallback:
        # The fallback world runs of a one-RM figure (Fig. 3): the newest world is that RM.
        runs = runs.sort_values("start_time").tail(1).assign(variant=spec.variants[0].name).reset_index(drop=True)
    parents = _search(uri, spec.name, f"tags.`{K.TAG_ROLE}` = 'parent'")
    parent = max(parents, key=lambda r: r.info.start_time or 0).info.run_id if parents else None
    return AblationData(spec=spec, tracking_uri=uri, runs=runs, parent_run_id=parent)
