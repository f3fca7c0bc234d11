"""The collapse rule over the indicators (paper section 4; the rule itself: `CollapseConfig.enabled`).

Indicators are smoothed by an EMA, so one noisy batch neither triggers nor hides a collapse;
`collapse/step` is the first step of the `patience`-long streak. The same detector replays logged
metric rows offline (`replay`), also with another perplexity indicator swapped in.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

from . import keys
from .config import CollapseConfig


@dataclass
class CollapseEvent:
    step: int
    reason: str


class CollapseDetector:
    def __init__(self, cfg: CollapseConfig, ppl_key: str = keys.PPL):
        self.cfg, self.ppl_key = cfg, ppl_key  # keys.PPL_TOKENS: perplexity pooled over tokens (no outlier spikes)
        self.ema: dict[str, float] = {}
        self.best_gold: float | None = None
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
        generic = [msg for bad, msg in ((kl > c.kl_max, f"KL {kl:.2f} > {c.kl_max:g}"),
                                        (ppl < c.ppl_min, f"perplexity {ppl:.3f} < {c.ppl_min:g}"),
                                        (cap > c.cap_frac_max, f"{cap:.0%} of responses at the length cap")) if bad]
        fired = generic if len(generic) >= 2 else []
        if keys.GOLD_SCORE in m:
            gold = self._smooth("gold", m[keys.GOLD_SCORE])
            self.best_gold = gold if self.best_gold is None else max(self.best_gold, gold)
            if self.best_gold - gold > c.gold_drop:
                fired.append(f"gold reward {gold:.2f} fell {self.best_gold - gold:.2f} below its best {self.best_gold:.2f}")
        return fired

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
        return {"ema": dict(self.ema), "best_gold": self.best_gold, "streak": self.streak,
                "streak_start": self.streak_start, "event": None if self.event is None else asdict(self.event)}

    def load_state_dict(self, s: dict) -> None:
        self.ema = dict(s["ema"])
        self.best_gold, self.streak, self.streak_start = s["best_gold"], s["streak"], s["streak_start"]
        self.event = CollapseEvent(**s["event"]) if s["event"] else None


def replay(cfg: CollapseConfig, rows: Iterable[tuple[int, dict[str, float]]], ppl_key: str = keys.PPL) -> CollapseEvent | None:
    """The rule over logged (step, metrics) rows in step order, as the trainer ran it: its event or None."""
    d = CollapseDetector(cfg, ppl_key)
    for step, m in rows:
        d.update(step, m)
    return d.event
