"""One ablation's runs read back from the MLflow store alone, as pandas.

- `find_runs`      one row per run: variant, seed, status, collapse, tags
- `load_metrics`   tidy step metrics: run_id, variant, seed, metric, step, value
- `last_samples`   sample responses of each run's last sampled step
- `load_eval_scores`, `load_rm_score_diff`   the Fig. 13 and Fig. 2 artifacts
- `load_ablation`  all of the above behind one object, metrics loaded lazily per key

Which runs belong to an ablation: the runs of the experiment named after it (CONTRACTS.md) that
carry a `harness.variant` tag and are not the parent. Reruns leave several runs per
(variant, seed); the newest FINISHED one wins (else the newest), so a half-done rerun does not
hide a finished run. World ablations (Fig. 2/3) whose runs are missing fall back to the world
runs (tag harness.role=world) of the `world` experiment, one variant per run name.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from harness import keys as K
from harness import tracking
from harness.registry import (
    STANDARD_PANELS, Registry, UnknownAblation, Variant, ablation_names, find_ablation, load_registry,
)
from harness.schema import did_you_mean

WORLD_EXPERIMENT = "world"  # harness.world.build_world's default experiment
RUN_COLUMNS = [
    "run_id", "run_name", "variant", "seed", "status", "role", "collapsed", "collapse_step",
    "start_time", "end_time", "figure", "git_commit", "failure_reason", "stopped_by", "experiment",
]


def default_tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else the trainer's default (logging.tracking_uri)."""
    from harness.config import LoggingConfig

    return os.environ.get("MLFLOW_TRACKING_URI") or LoggingConfig().tracking_uri


def _experiment_id(tracking_uri: str, name: str) -> str | None:
    exp = tracking.client(tracking_uri).get_experiment_by_name(name)
    return None if exp is None or exp.lifecycle_stage == "deleted" else exp.experiment_id


def _search(tracking_uri: str, experiment_id: str, filter_string: str = "") -> list:
    c = tracking.client(tracking_uri)
    runs, token = [], None
    while True:
        page = c.search_runs([experiment_id], filter_string=filter_string, max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            return runs


def _seed(tag: str | None) -> int:
    try:
        return int(tag)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


def _run_row(run, experiment: str, variant: str | None = None) -> dict[str, Any]:
    tags = run.data.tags
    collapse_step = run.data.metrics.get(K.COLLAPSE_STEP)
    collapsed = tags.get(K.TAG_COLLAPSED, "").lower() == "true" or collapse_step is not None
    return {
        "run_id": run.info.run_id,
        "run_name": run.info.run_name,
        "variant": variant if variant is not None else tags.get(K.TAG_VARIANT, run.info.run_name),
        "seed": _seed(tags.get(K.TAG_SEED)),
        "status": run.info.status,
        "role": tags.get(K.TAG_ROLE, ""),
        "collapsed": bool(collapsed),
        "collapse_step": float(collapse_step) if collapse_step is not None else float("nan"),
        "start_time": run.info.start_time,
        "end_time": run.info.end_time,
        "figure": tags.get(K.TAG_FIGURE, ""),
        "git_commit": tags.get(K.TAG_COMMIT, ""),
        "failure_reason": tags.get(K.TAG_FAILURE, ""),
        "stopped_by": tags.get(K.TAG_STOPPED, ""),
        "experiment": experiment,
        "tags": dict(tags),
    }


def _dedupe(runs: pd.DataFrame) -> pd.DataFrame:
    """Newest FINISHED run per (variant, seed), else the newest run."""
    if runs.empty:
        return runs
    ranked = runs.assign(_finished=runs["status"].eq("FINISHED")).sort_values(
        ["_finished", "start_time"], ascending=False
    )
    kept = ranked.drop_duplicates(["variant", "seed"]).drop(columns="_finished")
    return kept.sort_values(["variant", "seed"]).reset_index(drop=True)


def _frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=RUN_COLUMNS + ["tags"])


def find_runs(tracking_uri: str, ablation: str, *, world_fallback: bool = False, dedupe: bool = True) -> pd.DataFrame:
    """One row per child run of the ablation (columns RUN_COLUMNS + `tags`), sorted by variant
    and seed. Empty (with the columns) when the store has none."""
    rows: list[dict[str, Any]] = []
    exp_id = _experiment_id(tracking_uri, ablation)
    if exp_id is not None:
        for run in _search(tracking_uri, exp_id):
            tags = run.data.tags
            if tags.get(K.TAG_ROLE) == "parent" or K.TAG_VARIANT not in tags:
                continue
            if tags.get(K.TAG_ABLATION, ablation) != ablation:
                continue
            rows.append(_run_row(run, ablation))
    if not rows and world_fallback and ablation != WORLD_EXPERIMENT:
        rows = world_runs(tracking_uri)
    frame = _frame(rows)
    return _dedupe(frame) if dedupe else frame.reset_index(drop=True)


def world_runs(tracking_uri: str) -> list[dict[str, Any]]:
    """Runs tagged harness.role=world in the `world` experiment, variant = run name."""
    exp_id = _experiment_id(tracking_uri, WORLD_EXPERIMENT)
    if exp_id is None:
        return []
    runs = _search(tracking_uri, exp_id, f"tags.`{K.TAG_ROLE}` = 'world'")
    return [_run_row(r, WORLD_EXPERIMENT, variant=r.data.tags.get(K.TAG_VARIANT, r.info.run_name)) for r in runs]


def newest_parent_run(tracking_uri: str, ablation: str) -> str | None:
    """Id of the newest run tagged harness.role=parent in the ablation's experiment."""
    exp_id = _experiment_id(tracking_uri, ablation)
    if exp_id is None:
        return None
    runs = _search(tracking_uri, exp_id, f"tags.`{K.TAG_ROLE}` = 'parent'")
    if not runs:
        return None
    return max(runs, key=lambda r: r.info.start_time or 0).info.run_id


def ablations_in_store(tracking_uri: str) -> list[str]:
    """Experiment names that hold runs with a harness.variant tag (what `find_runs` can read)."""
    c = tracking.client(tracking_uri)
    names = []
    for exp in c.search_experiments():
        page = c.search_runs([exp.experiment_id], filter_string=f"tags.`{K.TAG_VARIANT}` != ''", max_results=1)
        if len(page):
            names.append(exp.name)
    return sorted(names)


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------
METRIC_COLUMNS = ["run_id", "variant", "seed", "metric", "step", "value"]


def _history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return tracking.metric_history(tracking_uri, run_id, key)


def load_metrics(tracking_uri: str, runs: pd.DataFrame, keys: list[str] | None = None) -> pd.DataFrame:
    """Tidy step metrics of `runs` (columns METRIC_COLUMNS), one row per (run, metric, step).

    `keys=None` loads every metric each run has. A step logged twice (a resumed run) keeps the
    last value. Histories are fetched on a few threads: the sqlite store costs a call per key.
    """
    c = tracking.client(tracking_uri)
    jobs: list[tuple[pd.Series, str]] = []
    for _, r in runs.iterrows():
        have = set(c.get_run(r.run_id).data.metrics) if keys is None else None
        for key in sorted(have) if have is not None else keys:
            jobs.append((r, key))
    if not jobs:
        return pd.DataFrame(columns=METRIC_COLUMNS)
    with ThreadPoolExecutor(max_workers=min(8, len(jobs))) as pool:
        histories = list(pool.map(lambda job: _history(tracking_uri, job[0].run_id, job[1]), jobs))
    frames = []
    for (r, key), hist in zip(jobs, histories):
        if hist:
            steps, values = zip(*hist)
            frames.append(pd.DataFrame({
                "run_id": r.run_id, "variant": r.variant, "seed": r.seed, "metric": key,
                "step": list(steps), "value": list(values),
            }))
    if not frames:
        return pd.DataFrame(columns=METRIC_COLUMNS)
    out = pd.concat(frames, ignore_index=True)
    out = out.drop_duplicates(["run_id", "metric", "step"], keep="last")
    return out.sort_values(["variant", "seed", "metric", "step"]).reset_index(drop=True)


# --------------------------------------------------------------------------------------------
# Artifacts
# --------------------------------------------------------------------------------------------
def _list_artifacts(tracking_uri: str, run_id: str, path: str) -> list[str]:
    try:
        return [a.path for a in tracking.client(tracking_uri).list_artifacts(run_id, path) if not a.is_dir]
    except Exception:  # an artifact store that lost the folder reads as no artifacts
        return []


def _step_of(artifact_path: str) -> int | None:
    stem = Path(artifact_path).stem  # step_000050 / rm_scores_step_000050
    tail = stem.rsplit("step_", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _load_json(tracking_uri: str, run_id: str, artifact_path: str) -> Any:
    try:
        return tracking.load_json_artifact(tracking_uri, run_id, artifact_path)
    except Exception:
        return None


def sample_steps(tracking_uri: str, run_id: str) -> dict[int, str]:
    """Step -> artifact path of the run's samples/step_XXXXXX.json files."""
    out = {}
    for p in _list_artifacts(tracking_uri, run_id, K.SAMPLES_DIR):
        s = _step_of(p)
        if s is not None and p.endswith(".json"):
            out[s] = p
    return dict(sorted(out.items()))


def load_samples(tracking_uri: str, run_id: str, step: int | None = None) -> dict[str, Any] | None:
    """{"step", "rows": [{prompt, response, rm_score, gold_score, length}]} at `step` (None = the
    last sampled step), or None when the run logged no samples."""
    steps = sample_steps(tracking_uri, run_id)
    if not steps:
        return None
    s = max(steps) if step is None else step
    if s not in steps:
        return None
    data = _load_json(tracking_uri, run_id, steps[s])
    if not isinstance(data, dict):
        return None
    data.setdefault("step", s)
    data.setdefault("rows", [])
    return data


SAMPLE_COLUMNS = ["variant", "seed", "run_id", "step", "collapsed", "prompt", "response", "rm_score", "gold_score", "length"]


def last_samples(tracking_uri: str, runs: pd.DataFrame, per_run: int | None = None) -> pd.DataFrame:
    """Rows of each run's last sample table (columns SAMPLE_COLUMNS); `per_run` caps the rows."""
    rows = []
    for _, r in runs.iterrows():
        data = load_samples(tracking_uri, r.run_id)
        if not data:
            continue
        for row in data["rows"][:per_run]:
            rows.append({
                "variant": r.variant, "seed": r.seed, "run_id": r.run_id, "step": data["step"],
                "collapsed": r.collapsed, "prompt": row.get("prompt", ""), "response": row.get("response", ""),
                "rm_score": row.get("rm_score"), "gold_score": row.get("gold_score"), "length": row.get("length"),
            })
    return pd.DataFrame(rows, columns=SAMPLE_COLUMNS)


def load_eval_scores(tracking_uri: str, run_id: str) -> dict[int, dict[str, list[float]]]:
    """Step -> {"rm": [...], "gold": [...]} from the run's eval/rm_scores_step_XXXXXX.json."""
    out: dict[int, dict[str, list[float]]] = {}
    for p in _list_artifacts(tracking_uri, run_id, K.EVAL_SCORES_DIR):
        step = _step_of(p)
        if step is None or "rm_scores" not in Path(p).name:
            continue
        data = _load_json(tracking_uri, run_id, p)
        if isinstance(data, dict):
            out[step] = {"rm": list(data.get("rm") or []), "gold": list(data.get("gold") or [])}
    return dict(sorted(out.items()))


def load_rm_score_diff(tracking_uri: str, run_id: str) -> list[float]:
    """Chosen-minus-rejected RM scores on held-out pairs (world run artifact rm_score_diff.json)."""
    data = _load_json(tracking_uri, run_id, K.RM_SCORE_DIFF)
    return list(data.get("diff") or []) if isinstance(data, dict) else []


# --------------------------------------------------------------------------------------------
# One ablation
# --------------------------------------------------------------------------------------------
@dataclass
class AblationData:
    """An ablation's spec and runs; step metrics and artifacts are read on first use and cached."""

    spec: Registry
    tracking_uri: str
    runs: pd.DataFrame
    parent_run_id: str | None
    _metrics: dict[str, pd.DataFrame] = field(default_factory=dict, repr=False)
    _eval: dict[str, dict] = field(default_factory=dict, repr=False)
    _diff: dict[str, list] = field(default_factory=dict, repr=False)
    _run_keys: list[set[str]] | None = field(default=None, repr=False)

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
        have = set(self.runs["variant"])
        return [v for v in self.spec.variant_names if v not in have]

    def _metric_keys_per_run(self) -> list[set[str]]:
        if self._run_keys is None:
            c = tracking.client(self.tracking_uri)
            self._run_keys = [set(c.get_run(rid).data.metrics) for rid in self.runs["run_id"]]
        return self._run_keys

    def available_metrics(self) -> set[str]:
        """Metric keys logged by at least one run."""
        return set().union(*self._metric_keys_per_run())

    def logged_by_every_run(self, key: str) -> bool:
        """True when every run logged `key` (runs from before a metric existed lack it)."""
        keys = self._metric_keys_per_run()
        return bool(keys) and all(key in k for k in keys)

    def shown_metric(self, key: str) -> str:
        """The key that figures, tables and claims read for `key`: the token-pooled perplexity
        stands in for the per-sample one (which spikes on single unlikely responses) when every
        run logged it, so one figure never mixes the two."""
        if key == K.PPL and self.logged_by_every_run(K.PPL_TOKENS):
            return K.PPL_TOKENS
        return key

    def metrics(self, keys: list[str] | str) -> pd.DataFrame:
        """Tidy frame (METRIC_COLUMNS) of the given metric keys over all runs."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        todo = [k for k in keys if k not in self._metrics]
        if todo:
            loaded = load_metrics(self.tracking_uri, self.runs, todo)
            for k in todo:
                self._metrics[k] = loaded[loaded["metric"] == k]
        parts = [self._metrics[k] for k in keys if not self._metrics[k].empty]
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=METRIC_COLUMNS)

    def eval_scores(self, run_id: str) -> dict[int, dict[str, list[float]]]:
        if run_id not in self._eval:
            self._eval[run_id] = load_eval_scores(self.tracking_uri, run_id)
        return self._eval[run_id]

    def rm_score_diff(self, run_id: str) -> list[float]:
        if run_id not in self._diff:
            self._diff[run_id] = load_rm_score_diff(self.tracking_uri, run_id)
        return self._diff[run_id]

    def samples(self, per_run: int | None = None) -> pd.DataFrame:
        return last_samples(self.tracking_uri, self.runs, per_run)


def resolve_spec(ablation: str | Path, tracking_uri: str, ablations_dir: str | Path | None = None) -> Registry:
    """The registry entry for `ablation` (name or YAML path), read without resolving train
    configs. A name the registry lacks but the store holds (runs logged before the YAML existed,
    or by hand) gets a spec read off the runs' tags; otherwise UnknownAblation names the closest
    of the registry's and the store's ablations."""
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
    if spec.kind == "world" and len(spec.variants) == 1 and not runs.empty and set(runs["experiment"]) == {WORLD_EXPERIMENT}:
        # The fallback world runs of a one-RM figure (Fig. 3): the newest world is that RM.
        runs = runs.sort_values("start_time").tail(1).assign(variant=spec.variants[0].name).reset_index(drop=True)
    return AblationData(spec=spec, tracking_uri=uri, runs=runs, parent_run_id=newest_parent_run(uri, spec.name))


__all__ = [
    "default_tracking_uri", "find_runs", "world_runs", "newest_parent_run", "ablations_in_store",
    "load_metrics", "sample_steps", "load_samples", "last_samples", "load_eval_scores",
    "load_rm_score_diff", "AblationData", "resolve_spec", "load_ablation",
]
