"""What "collapsed" means, defined once for the trainer, the figures and the claims.

- `GoldTruth`: the truth, where a gold reward exists (the embedded world). The start level is the
  mean per-step gold of the run's first `baseline_steps` steps (the policy is still the SFT model
  there, on the same training prompts). The gold has fallen at step t when the trailing mean of
  the per-step gold over `window` steps lies more than `margin` below the start level; the onset is
  the first step of the first `confirm`-long run of such steps, so it is known `confirm - 1` steps
  after it happened. An early dip that recovers within `confirm` steps is no collapse, and a run
  whose gold rose first is judged against where it started, not against its peak.
- `IndicatorRule`: the paper-scale rule over the indicators alone (KL, perplexity, share at the
  length cap), all a run without gold has: at least two of them out of bounds for `patience`
  steps in a row (EMA-smoothed), the event at the first of them.

Both replay offline over logged rows (`gold_onset`, `replay`) exactly as the trainer ran them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Iterable

from . import keys
from .config import CollapseConfig


@dataclass
class CollapseEvent:
    step: int
    reason: str


class GoldTruth:
    """The gold onset, step by step (`update` returns the event on the step it is confirmed)."""

    def __init__(self, cfg: CollapseConfig):
        self.cfg = cfg
        self.start: list[float] = []  # the first baseline_steps values
        self.recent: deque[float] = deque(maxlen=cfg.window)
        self.below: list[int] = []  # the current run of steps below start - margin
        self.event: CollapseEvent | None = None

    @property
    def level(self) -> float | None:
        """The start level (None until baseline_steps steps are in)."""
        return sum(self.start) / len(self.start) if len(self.start) == self.cfg.baseline_steps else None

    def update(self, step: int, gold: float) -> CollapseEvent | None:
        c = self.cfg
        self.recent.append(gold)
        if self.level is None:
            self.start.append(gold)
            return None
        mean = sum(self.recent) / len(self.recent)
        self.below = self.below + [step] if mean < self.level - c.margin else []
        if self.event is None and len(self.below) >= c.confirm:
            self.event = CollapseEvent(self.below[0], f"gold reward (trailing mean of {c.window} steps) "
                                       f"{mean:.2f} stayed more than {c.margin:g} below its start "
                                       f"{self.level:.2f} for {c.confirm} steps")
            return self.event
        return None

    def state_dict(self) -> dict:
        return {"start": list(self.start), "recent": list(self.recent), "below": list(self.below),
                "event": None if self.event is None else asdict(self.event)}

    def load_state_dict(self, s: dict) -> None:
        self.start, self.below = list(s["start"]), list(s["below"])
        self.recent = deque(s["recent"], maxlen=self.cfg.window)
        self.event = CollapseEvent(**s["event"]) if s["event"] else None


def gold_onset(cfg: CollapseConfig, gold: Iterable[tuple[int, float]]) -> int | None:
    """The onset over logged (step, per-step gold) rows in step order, as the trainer found it."""
    truth = GoldTruth(cfg)
    for step, g in gold:
        truth.update(step, g)
    return None if truth.event is None else truth.event.step


class IndicatorRule:
    """Two of {KL high, perplexity low, length at the cap} for `patience` steps (EMA-smoothed)."""

    def __init__(self, cfg: CollapseConfig, ppl_key: str = keys.PPL):
        self.cfg, self.ppl_key = cfg, ppl_key  # keys.PPL_TOKENS: perplexity pooled over tokens (no outlier spikes)
        self.ema: dict[str, float] = {}
        self.streak_start: int | None = None
        self.streak = 0
        self.event: CollapseEvent | None = None

    def _smooth(self, key: str, value: float) -> float:
        a = self.cfg.smoothing
        self.ema[key] = value if key not in self.ema else a * self.ema[key] + (1 - a) * value
        return self.ema[key]

    def signals(self, m: dict[str, float]) -> list[str]:
        c = self.cfg
        kl = self._smooth("kl", m[keys.KL])
        ppl = self._smooth("ppl", m[self.ppl_key])
        cap = self._smooth("cap", m[keys.FRAC_AT_CAP])
        fired = [msg for bad, msg in ((kl > c.kl_max, f"KL {kl:.2f} > {c.kl_max:g}"),
                                      (ppl < c.ppl_min, f"perplexity {ppl:.3f} < {c.ppl_min:g}"),
                                      (cap > c.cap_frac_max, f"{cap:.0%} of responses at the length cap")) if bad]
        return fired if len(fired) >= 2 else []

    def update(self, step: int, metrics: dict[str, float]) -> tuple[int, CollapseEvent | None]:
        """Feed one step; returns (number of signals firing, the collapse event if it begins now)."""
        fired = self.signals(metrics)
        if not fired:
            self.streak, self.streak_start = 0, None
            return 0, None
        if self.streak == 0:
            self.streak_start = step
        self.streak += 1
        if self.event is None and self.streak >= self.cfg.patience:
            self.event = CollapseEvent(self.streak_start or step, "; ".join(fired))
            return len(fired), self.event
        return len(fired), None

    def state_dict(self) -> dict:
        return {"ema": dict(self.ema), "streak": self.streak, "streak_start": self.streak_start,
                "event": None if self.event is None else asdict(self.event)}

    def load_state_dict(self, s: dict) -> None:
        self.ema = dict(s["ema"])
        self.streak, self.streak_start = s["streak"], s["streak_start"]
        self.event = CollapseEvent(**s["event"]) if s["event"] else None


def replay(cfg: CollapseConfig, rows: Iterable[tuple[int, dict[str, float]]], ppl_key: str = keys.PPL) -> CollapseEvent | None:
    """The indicator rule over logged (step, metrics) rows in step order, as the trainer ran it."""
    d = IndicatorRule(cfg, ppl_key)
    for step, m in rows:
        d.update(step, m)
    return d.event


class Monitor:
    """A run's collapse flag, step by step: the gold truth where the source has a gold reward (the
    indicator rule is then only logged, as collapse/signals), else the indicator rule."""

    def __init__(self, cfg: CollapseConfig, has_gold: bool):
        self.cfg, self.has_gold = cfg, has_gold
        self.truth = GoldTruth(cfg) if has_gold else None
        self.rule = IndicatorRule(cfg)

    @property
    def event(self) -> CollapseEvent | None:
        """The flag's event (None: not collapsed so far)."""
        return self.truth.event if self.truth is not None else self.rule.event

    def update(self, step: int, metrics: dict[str, float]) -> tuple[dict[str, float], CollapseEvent | None]:
        """Feed one step's metrics; returns (the collapse/ metrics to log with it, the flag's event
        on the step it is raised). The gold onset is logged at its own step once confirmed."""
        if not self.cfg.enabled:
            return {}, None
        flagged = self.event is not None
        n_signals, _ = self.rule.update(step, metrics)
        out: dict[str, float] = {keys.COLLAPSE_SIGNALS: n_signals}
        if self.truth is not None and keys.GOLD_SCORE in metrics:
            if (onset := self.truth.update(step, metrics[keys.GOLD_SCORE])) is not None:
                out[keys.GOLD_ONSET] = onset.step
        event = self.event if not flagged else None
        if event is not None:
            out[keys.COLLAPSE_STEP] = event.step
        return out, event

    def state_dict(self) -> dict:
        return {"rule": self.rule.state_dict(), "truth": None if self.truth is None else self.truth.state_dict()}

    def load_state_dict(self, s: dict) -> None:
        self.rule.load_state_dict(s["rule"])
        if self.truth is not None and s.get("truth"):
            self.truth.load_state_dict(s["truth"])
