"""The runs a collapse detector is fit and scored on (analysis.detector): read from an MLflow store
(`load_runs`), or from a runs file that keeps them without the store (`save_runs` / `read_runs`).

A runs file (`python -m analysis.detector export --tracking-uri STORE --to FILE.npz`) holds, for each
finished train run, what the detector's fit and scoring read and nothing else: the per-step signals
(harness.detector.SIGNALS, the gold reward, KL and perplexity), the gold onset and where the run belongs
(figure file, variant, seed, world, config hash, trial, estimator, commit, provenance tags). It is a
NumPy `.npz` (compressed, read with allow_pickle=False): a JSON header `meta`, then one long table, a
row per (run, step): `run` (index into meta's runs), `step`, and one column per signal (NaN where that
run did not log it; meta names each run's own signals, so a NaN it logged stays a NaN). Columns are
float32 where every value is a float32 exactly (what torch logs), else float64: a file scores exactly
as its store does. A detector campaign's file is committed beside its evaluation, so a later fit needs
no store and no retraining.
"""
from __future__ import annotations

import dataclasses
import io
import json
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from analysis.store import provenance_tags
from harness import keys as K
from harness import statefile, tracking
from harness.config import CollapseConfig, from_dict
from harness.detector import BASE_SIGNALS, SIGNALS
from harness.metrics import gold_onset
from harness.schema import ConfigError, parse_value

NEEDED = sorted(set(BASE_SIGNALS.values()) | {K.GOLD_SCORE, K.KL, K.PPL, K.APPROX_KL})
OPTIONAL = sorted(set(SIGNALS.values()) - set(NEEDED))
"""Signals of the newer families (diversity, audit RMs): read where a run logged them at every step."""


@dataclasses.dataclass
class RunData:
    """One finished train run of the store: its logged rows, its truth and where it belongs."""

    run_id: str
    ablation: str
    variant: str
    seed: int
    world: str
    """The world's hash (tag provenance.world.hash)."""
    config_hash: str
    rows: list[tuple[int, dict[str, float]]]
    onset: int | None
    """The gold onset (None: the gold never fell)."""
    last_step: int
    cap: int
    """generation.max_new_tokens."""
    group: str = ""
    commit: str = "?"
    """The code it ran (tag harness.git_commit)."""
    provenance: dict[str, str] = dataclasses.field(default_factory=dict)
    """Its `provenance.*` tags, prefix dropped (analysis.store.provenance_tags)."""
    trial: int | None = None
    """Its trial number, for a run of a design study (tag harness.trial); None for a figure file's run."""
    estimator: str = "gae"
    """ppo.adv_estimator: with a critic (gae) or one of the critic-free estimators."""

    @property
    def fell(self) -> bool:
        return self.onset is not None


def _collapse_cfg(params: dict[str, str]) -> CollapseConfig:
    known = {f.name for f in dataclasses.fields(CollapseConfig)}  # a store of older code may hold other keys
    return from_dict({k.split(".", 1)[1]: parse_value(v) for k, v in params.items()
                      if k.startswith("collapse.") and k.split(".", 1)[1] in known}, CollapseConfig)


def _load_run(uri: str, run: Any) -> RunData | None:
    rows: dict[int, dict[str, float]] = {}
    for k in NEEDED + [k for k in OPTIONAL if k in run.data.metrics]:
        for step, v in tracking.metric_history(uri, run.info.run_id, k):
            rows.setdefault(step, {})[k] = v
    rows = {s: m for s, m in sorted(rows.items()) if set(NEEDED) <= set(m)}
    extra = [k for k in OPTIONAL if all(k in m for m in rows.values())]  # logged at every step, or not used
    rows = {s: {k: v for k, v in m.items() if k in NEEDED or k in extra} for s, m in rows.items()}
    if len(rows) < 20:
        return None
    p, t = run.data.params, run.data.tags
    steps = sorted(rows)
    return RunData(run.info.run_id, t.get(K.TAG_ABLATION) or t.get(K.TAG_SWEEP, ""),  # a trial: its sweep file
                   t.get(K.TAG_VARIANT) or t.get(K.TAG_TRIAL, ""), int(t.get(K.TAG_SEED, 0)),
                   t.get("provenance.world.hash", "?"), t.get(K.TAG_CONFIG_HASH, ""), list(rows.items()),
                   gold_onset(_collapse_cfg(p), [(s, rows[s][K.GOLD_SCORE]) for s in steps]), steps[-1],
                   int(parse_value(p.get("generation.max_new_tokens", "0")) or 0),
                   commit=t.get(K.TAG_COMMIT, "?"), provenance=provenance_tags(t),
                   trial=int(t[K.TAG_TRIAL]) if t.get(K.TAG_TRIAL, "").isdigit() else None,
                   estimator=str(parse_value(p.get("ppo.adv_estimator", "gae"))))


def load_runs(uri: str) -> list[RunData]:
    """Every FINISHED train run of the store that logged gold and every signal the detector reads."""
    c = tracking.client(uri)
    runs = [r for e in c.search_experiments() for r in c.search_runs(
        [e.experiment_id], f"tags.`{K.TAG_ROLE}` = 'train' and attributes.status = 'FINISHED'", max_results=50000)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        return [r for r in pool.map(lambda r: _load_run(uri, r), runs) if r is not None]


# ------------------------------------------------------------------ a runs file
FORMAT = "harness.detector.runs"
VERSION = 1
_META_FIELDS = ("run_id", "ablation", "variant", "seed", "world", "config_hash", "onset", "last_step", "cap",
                "commit", "provenance", "trial", "estimator")


def save_runs(runs: list[RunData], path: str | Path, provenance: dict[str, Any]) -> Path:
    """Write `runs` to a runs file (the module docstring); `provenance` (the store, the exporting commit)
    goes into its header. Written at once (harness.statefile.write_atomic): a killed export leaves no half file."""
    path = Path(path)
    if path.suffix != ".npz":
        raise ConfigError([f"--to: got {str(path)!r}; allowed: a file name ending in .npz"])
    names = sorted({k for r in runs for _, m in r.rows for k in m})
    col = {k: i for i, k in enumerate(names)}
    n = sum(len(r.rows) for r in runs)
    run_ix, steps = np.empty(n, np.int32), np.empty(n, np.int64)
    values = np.full((n, len(names)), np.nan)
    i = 0
    for j, r in enumerate(runs):
        for step, m in r.rows:
            run_ix[i], steps[i] = j, step
            for k, v in m.items():
                values[i, col[k]] = v
            i += 1
    columns = {}
    for k, c in col.items():  # float32 where that loses nothing (torch logs float32 values), else float64
        x = values[:, c]
        x32 = x.astype(np.float32)
        columns[f"c{c}"] = x32 if np.array_equal(x32.astype(np.float64), x, equal_nan=True) else x
    meta = {"format": FORMAT, "version": VERSION, "signals": names,
            "provenance": {**provenance, "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "runs": len(runs), "fell": sum(r.fell for r in runs)},
            "runs": [{**{f: getattr(r, f) for f in _META_FIELDS}, "signals": sorted(r.rows[0][1]) if r.rows else []}
                     for r in runs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.array(json.dumps(meta, sort_keys=True)), run=run_ix, step=steps, **columns)
    statefile.write_atomic(path, buf.getvalue())
    return path


def read_runs(path: str | Path) -> tuple[list[RunData], dict[str, Any]]:
    """(the runs, the file's provenance) of a runs file written by `save_runs`; a clear error for a file
    that is missing or not one."""
    path = Path(path)
    allowed = "a runs file written by `python -m analysis.detector export --to FILE.npz`"
    if not path.is_file():
        raise ConfigError([f"--runs: got {str(path)!r}: no such file; allowed: {allowed}"])
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                raise ValueError(f"format {meta.get('format')!r} version {meta.get('version')!r}")
            run_ix, steps = z["run"], z["step"]
            columns = {k: z[f"c{i}"].astype(np.float64) for i, k in enumerate(meta["signals"])}
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError([f"--runs: {str(path)!r} is not a runs file ({type(e).__name__}: {e}); allowed: {allowed}"]) \
            from None
    order = np.argsort(run_ix, kind="stable")
    bounds = np.searchsorted(run_ix[order], np.arange(len(meta["runs"]) + 1))
    runs = []
    for j, m in enumerate(meta["runs"]):
        idx = order[bounds[j]:bounds[j + 1]]
        own = m["signals"]
        rows = [(int(steps[i]), {k: float(columns[k][i]) for k in own}) for i in idx]
        runs.append(RunData(**{f: m[f] for f in _META_FIELDS}, rows=rows))
    return runs, meta["provenance"]
