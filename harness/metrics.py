"""What "collapsed" means, defined once for the trainer, the figures and the claims.

- `GoldTruth`: the truth, where a gold reward exists (the embedded world). The start level is the
  mean per-step gold of the run's first `baseline_steps` steps (the policy is still the SFT model
  there, on the same training prompts). The gold has fallen at step t when the trailing mean of
  the per-step gold over `window` steps lies more than `margin` below the start level; the onset is
  the first step of the first `confirm`-long run of such steps, so it is known `confirm - 1` steps
  after it happened. An early dip that recovers within `confirm` steps is no collapse, and a run
  whose gold rose first is judged against where it started, not against its peak.
- The warning: harness.detector, over the signals every run logs (no gold); `Monitor` runs both and
  raises the run's collapse flag: the gold truth where gold exists, else the warning.
- `IndicatorRule`: the harness's earlier rule over the indicators alone (KL, perplexity, share at the
  length cap) at the paper's scale: at least two of them out of bounds for `patience` steps in a row
  (EMA-smoothed). It fired in 1 of 260 reference runs; analysis.detector keeps it as a baseline.

All replay offline over logged rows (`gold_onset`, `replay`, harness.detector.replay) as the trainer ran them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Iterable

from . import keys
from .config import CollapseConfig
from .detector import Detector, resolve_params


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


@dataclass(frozen=True)
class IndicatorThresholds:
    """The indicator rule's bounds, as the paper's 7B / 512-token runs collapse (section 4)."""

    kl_max: float = 2.0
    """objective/kl (mean per-token k1, nats) above this counts."""
    ppl_min: float = 1.3
    """The policy's perplexity of its own samples below this counts as degenerate."""
    cap_frac_max: float = 0.9
    """Share of responses at the length cap above this counts as running on."""
    smoothing: float = 0.8
    """EMA factor of the indicators."""
    patience: int = 10
    """Steps in a row before the rule fires."""


class IndicatorRule:
    """Two of {KL high, perplexity low, length at the cap} for `patience` steps (EMA-smoothed)."""

    def __init__(self, cfg: IndicatorThresholds = IndicatorThresholds(), ppl_key: str = keys.PPL):
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


def replay(cfg: IndicatorThresholds, rows: Iterable[tuple[int, dict[str, float]]], ppl_key: str = keys.PPL) -> CollapseEvent | None:
    """The indicator rule over logged (step, metrics) rows in step order, as the trainer ran it."""
    d = IndicatorRule(cfg, ppl_key)
    for step, m in rows:
        d.update(step, m)
    return d.event


class Monitor:
    """A run's collapse flag, step by step: the gold truth where the source has a gold reward, else
    the detector's warning; the warning is logged on every run (on the world, for scoring it)."""

    def __init__(self, cfg: CollapseConfig, has_gold: bool, has_audit: bool = False):
        self.cfg, self.has_gold = cfg, has_gold
        self.truth = GoldTruth(cfg) if has_gold else None
        params = resolve_params(cfg.detector, has_audit) if cfg.enabled else None
        self.detector = Detector(params, cfg.warn_threshold) if params is not None else None
        self.warned: CollapseEvent | None = None

    @property
    def event(self) -> CollapseEvent | None:
        """The flag's event (None: not collapsed so far)."""
        return self.truth.event if self.truth is not None else self.warned

    def update(self, step: int, metrics: dict[str, float]) -> tuple[dict[str, float], CollapseEvent | None]:
        """Feed one step's metrics; returns (the collapse/ metrics to log with it, the flag's event on
        the step it is raised). The gold onset and the warning are logged once, when they are known."""
        if not self.cfg.enabled:
            return {}, None
        flagged = self.event is not None
        out: dict[str, float] = {}
        if self.detector is not None:
            score, alert = self.detector.update(step, metrics)
            if score is not None:
                out[keys.WARNING] = score
            if alert is not None:
                out[keys.WARNING_STEP] = alert.step
                self.warned = CollapseEvent(alert.step, f"warning: detector score {alert.score:.2f} >= "
                                            f"{self.detector.threshold:g} for {self.detector.params.patience} steps")
        if self.truth is not None and keys.GOLD_SCORE in metrics:
            if (onset := self.truth.update(step, metrics[keys.GOLD_SCORE])) is not None:
                out[keys.GOLD_ONSET] = onset.step
        event = self.event if not flagged else None
        if event is not None:
            out[keys.COLLAPSE_STEP] = event.step
        return out, event

    def state_dict(self) -> dict:
        return {"truth": None if self.truth is None else self.truth.state_dict(),
                "detector": None if self.detector is None else self.detector.state_dict(),
                "warned": None if self.warned is None else asdict(self.warned)}

    def load_state_dict(self, s: dict) -> None:
        if self.truth is not None and s.get("truth"):
            self.truth.load_state_dict(s["truth"])
        if self.detector is not None and s.get("detector"):
            self.detector = self.detector.restored(s["detector"])
        self.warned = CollapseEvent(**s["warned"]) if s.get("warned") else None
