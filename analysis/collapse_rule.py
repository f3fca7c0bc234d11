"""The collapse rule (harness.metrics) scored against the gold reward over every train run of a store
(`score_store`; printed by reports.build: the combined report's last page, reports/README.md).

- Gold fell (the truth the world knows): harness.metrics.GoldTruth with the run's own collapse
  settings, replayed over its per-step gold (objective/gold_score): the trailing mean falls more
  than collapse.margin below the mean of the first collapse.baseline_steps steps and stays there
  for collapse.confirm steps (the eval gold at step 0 is on other prompts: another level).
- The rule fired: harness.metrics.replay of the indicator rule at its paper-scale defaults over the
  run's logged rows: the indicators alone (KL, perplexity, length at the cap). Once with the
  per-sample perplexity and once with the token-pooled one (objective/ppl_tokens) in its place.
- Lead time = gold-fall step - rule step (> 0: the rule warned first); a miss: gold fell and the
  rule never fired; a false alarm: the rule fired and gold never fell.
Only runs that log gold and both perplexities count, so both rules are scored on the same runs.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd

from harness import keys as K
from harness import tracking
from harness.config import CollapseConfig, from_dict
from harness.metrics import IndicatorThresholds, gold_onset, replay
from harness.schema import parse_value
from harness.summary import fmt, reduce_run

RULES = {"per-sample perplexity (current)": K.PPL, "token-pooled perplexity": K.PPL_TOKENS}
"""Each scored rule: its perplexity indicator."""
NEEDED = [K.KL, K.PPL, K.PPL_TOKENS, K.FRAC_AT_CAP, K.GOLD_SCORE]


def _run_row(uri: str, run) -> dict | None:
    rows: dict[int, dict[str, float]] = {}
    for k in NEEDED:
        for step, v in tracking.metric_history(uri, run.info.run_id, k):
            rows.setdefault(step, {})[k] = v
    rows = {s: m for s, m in sorted(rows.items()) if len(m) == len(NEEDED)}
    if not rows:
        return None
    known = {f.name for f in dataclasses.fields(CollapseConfig)}  # a store of older code may hold other keys
    params = {k.split(".", 1)[1]: parse_value(v) for k, v in run.data.params.items()
              if k.startswith("collapse.") and k.split(".", 1)[1] in known}
    cfg = from_dict(params, CollapseConfig)
    gold = [(s, m[K.GOLD_SCORE]) for s, m in rows.items()]
    sft = reduce_run([g for _, g in gold[:cfg.baseline_steps]], "mean")
    tags = run.data.tags
    out = {"run_id": run.info.run_id, "ablation": tags.get(K.TAG_ABLATION, ""), "variant": tags.get(K.TAG_VARIANT, ""),
           "seed": tags.get(K.TAG_SEED, ""), "sft_gold": sft, "gold_fell": gold_onset(cfg, gold)}
    indicators = [(s, {k: v for k, v in m.items() if k != K.GOLD_SCORE}) for s, m in rows.items()]
    for name, ppl in RULES.items():
        event = replay(IndicatorThresholds(), indicators, ppl)
        out[name] = None if event is None else event.step
    return out


def run_table(tracking_uri: str) -> pd.DataFrame:
    """Per finished train run of the store with gold and both perplexities: the gold-fall step and each
    rule's step (runs in flight or failed are not scored)."""
    c = tracking.client(tracking_uri)
    runs = [r for e in c.search_experiments() for r in c.search_runs(
        [e.experiment_id], f"tags.`{K.TAG_ROLE}` = 'train' and attributes.status = 'FINISHED'", max_results=50000)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        rows = [r for r in pool.map(lambda r: _run_row(tracking_uri, r), runs) if r is not None]
    return pd.DataFrame(rows, columns=["run_id", "ablation", "variant", "seed", "sft_gold", "gold_fell", *RULES])


def score(table: pd.DataFrame) -> dict[str, dict]:
    """Per rule: runs, hits (both), lead time (median, min, max over hits), misses, false alarms."""
    out = {}
    for rule in RULES:
        fell, fired = table["gold_fell"].notna(), table[rule].notna()
        lead = (table["gold_fell"] - table[rule])[fell & fired].to_numpy(dtype=float)
        out[rule] = {"runs": len(table), "gold fell": int(fell.sum()), "hits": int((fell & fired).sum()),
                     "misses": int((fell & ~fired).sum()), "false alarms": int((fired & ~fell).sum()),
                     **{f"lead {s}": float(f(lead)) if lead.size else None
                        for s, f in (("median", np.median), ("min", np.min), ("max", np.max))}}
    return out


def better(scores: dict[str, dict]) -> str | None:
    """The rule with fewer misses + false alarms, then the longer median lead (None: no runs, or a tie)."""
    def cost(rule: str) -> tuple[int, float]:
        s = scores[rule]
        return s["misses"] + s["false alarms"], -(s["lead median"] if s["lead median"] is not None else -np.inf)

    a, b = sorted(scores, key=cost)
    return a if scores[a]["runs"] and cost(a) != cost(b) else None


def score_store(tracking_uri: str) -> dict:
    """`score` of every run in the store (4 significant digits), and `better`'s choice."""
    s = score(run_table(tracking_uri))
    return {"rules": {r: {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in x.items()}
                      for r, x in s.items()}, "better": better(s)}


def table_rows(scores: dict) -> list[list[str]]:
    """`score_store`'s numbers as a table (header first) for the reports."""
    rows = [["rule", "runs with gold", "gold fell", "hits", "lead median (range), steps", "misses", "false alarms"]]
    for rule, s in scores["rules"].items():
        lead = "–" if s["lead median"] is None else f"{fmt(s['lead median'])} ({fmt(s['lead min'])} to {fmt(s['lead max'])})"
        rows.append([rule, *(str(s[k]) for k in ("runs", "gold fell", "hits")), lead, str(s["misses"]),
                     str(s["false alarms"])])
    return rows


CHOICE = ("the indicator rule is no longer the trainer's warning (harness.detector is, scored by analysis.detector); "
          "on the embedded world's reference runs the two perplexities differ by a run or two, and both rarely fire on "
          "indicators alone (two signals seldom hold at once at the paper-scale thresholds)")
