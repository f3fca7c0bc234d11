"""The early warning: a collapse detector over the signals every run logs (no gold reward needed),
so a run on HH-RLHF or any Hugging Face model is warned as a world run is.

Every feature is scale-free, relative to the run's own start, so that what is fit on the embedded
world can carry to a bigger model. Each logged signal x is smoothed by its trailing mean over
`window` steps, s(x); its start b(x) is the mean of the run's first `baseline_steps` steps (the
policy is still the SFT model there). With H the policy's per-token entropy on its own samples:

    kl         s(kl_k3) / b(H)             per-token KL to the reference, in units of the start's entropy
    kl_growth  (s_t(kl_k3) - s_{t-window}(kl_k3)) / b(H)    its growth over the last window
    ppl        log s(ppl_tokens) / b(ppl_tokens)             the policy's perplexity of its samples
    ppl_ref    log s(ppl_ref) / b(ppl_ref)                   the reference's perplexity of them
    entropy    log s(H) / b(H)
    length     log s(length) / b(length)
    length_cv  log (s(length_std)/s(length)) / (b(length_std)/b(length))   the spread of lengths
    cap        s(frac_at_cap)                                 share of responses at the length cap
    rm_gain    (s(rm) - b(rm)) / b(rm_std)                    RM score gained, in the start's spreads
    rm_spread  log s(rm_std) / b(rm_std)
    clipfrac   s(policy clip fraction)

The warning score is a logistic model of the features, p = sigmoid(b + sum_i w_i (f_i - m_i) / s_i),
fit by `python -m analysis.detector fit` on runs whose gold truth is known (harness.metrics.GoldTruth)
and scored out of sample; its parameters are a JSON file (`DetectorParams`, with the provenance of
the runs it was fit on). A run is warned on the first step where p >= threshold for `patience`
steps in a row (the step the warning is raised: what a trainer could act on).
"""
from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable

from pydantic import Field

from . import keys as K
from .schema import ConfigError, Float, PosCount, Unit, section, validate

DEFAULT_PARAMS = Path(__file__).with_name("detector_params.json")
"""The committed detector (`collapse.detector: default`)."""
SIGNALS = {"kl": K.KL_K3, "entropy": K.ENTROPY, "ppl": K.PPL_TOKENS, "ppl_ref": K.PPL_REF, "length": K.LENGTH,
           "length_std": K.LENGTH_STD, "cap": K.FRAC_AT_CAP, "rm": K.RM_SCORE, "rm_std": K.RM_SCORE_STD,
           "clipfrac": K.POLICY_CLIPFRAC}
"""The logged metrics the features read (short name -> metric key): all logged by every run."""
EPS = 1e-6


def _log_ratio(a: float, b: float) -> float:
    return math.log(max(a, EPS) / max(b, EPS))


FEATURES = {
    "kl": lambda s, b, old: s["kl"] / max(b["entropy"], EPS),
    "kl_growth": lambda s, b, old: (s["kl"] - old) / max(b["entropy"], EPS),
    "ppl": lambda s, b, old: _log_ratio(s["ppl"], b["ppl"]),
    "ppl_ref": lambda s, b, old: _log_ratio(s["ppl_ref"], b["ppl_ref"]),
    "entropy": lambda s, b, old: _log_ratio(s["entropy"], b["entropy"]),
    "length": lambda s, b, old: _log_ratio(s["length"], b["length"]),
    "length_cv": lambda s, b, old: _log_ratio(s["length_std"] / max(s["length"], EPS),
                                              b["length_std"] / max(b["length"], EPS)),
    "cap": lambda s, b, old: s["cap"],
    "rm_gain": lambda s, b, old: (s["rm"] - b["rm"]) / max(b["rm_std"], EPS),
    "rm_spread": lambda s, b, old: _log_ratio(s["rm_std"], b["rm_std"]),
    "clipfrac": lambda s, b, old: s["clipfrac"],
}
"""Feature name -> f(smoothed signals now, the start's signals, the smoothed KL `window` steps ago)."""


class Features:
    """The features of one run, step by step (`update` returns None until the start and one window
    are in: the first `baseline_steps + window` steps)."""

    def __init__(self, window: int = 10, baseline_steps: int = 5):
        self.window, self.baseline_steps = window, baseline_steps
        self.start: list[dict[str, float]] = []
        self.recent: deque[dict[str, float]] = deque(maxlen=window)
        self.kl_past: deque[float] = deque(maxlen=window + 1)
        self.n = 0

    def update(self, metrics: dict[str, float]) -> dict[str, float] | None:
        raw = {name: float(metrics[key]) for name, key in SIGNALS.items() if key in metrics}
        if len(raw) < len(SIGNALS):
            missing = sorted(k for k in SIGNALS.values() if k not in metrics)
            raise KeyError(f"the detector needs {', '.join(missing)} at every step")
        self.n += 1
        if len(self.start) < self.baseline_steps:
            self.start.append(raw)
        self.recent.append(raw)
        s = {k: sum(r[k] for r in self.recent) / len(self.recent) for k in SIGNALS}
        self.kl_past.append(s["kl"])
        if self.n < self.baseline_steps + self.window:
            return None
        b = {k: sum(r[k] for r in self.start) / len(self.start) for k in SIGNALS}
        return {name: f(s, b, self.kl_past[0]) for name, f in FEATURES.items()}

    def state_dict(self) -> dict:
        return {"start": list(self.start), "recent": list(self.recent), "kl_past": list(self.kl_past), "n": self.n}

    def load_state_dict(self, st: dict) -> None:
        self.start, self.n = list(st["start"]), int(st["n"])
        self.recent = deque(st["recent"], maxlen=self.window)
        self.kl_past = deque(st["kl_past"], maxlen=self.window + 1)


FeatureName = Annotated[str, Field(pattern="^(" + "|".join(FEATURES) + ")$")]


@section
class DetectorParams:
    """A fitted detector: what `python -m analysis.detector fit` writes and the trainer reads."""

    features: Annotated[list[FeatureName], Field(min_length=1)]
    """Feature names (harness.detector.FEATURES), in the order of the weights."""
    mean: list[Float]
    """Each feature's mean over the fit steps (standardization)."""
    scale: list[Float]
    """Each feature's standard deviation over the fit steps."""
    coef: list[Float]
    """Logistic weights of the standardized features."""
    intercept: Float
    """Logistic intercept."""
    threshold: Unit
    """Warn when the score reaches this..."""
    patience: PosCount = 3
    """...for this many steps in a row."""
    window: PosCount = 10
    """Trailing-mean window of the signals (steps)."""
    baseline_steps: PosCount = 5
    """Steps whose mean is the run's start."""
    provenance: dict[str, Any] = field(default_factory=dict)
    """Where it was fit: commit, store, world hashes, runs, split, fit-set numbers (analysis.detector)."""


def load_params(path: str | Path) -> DetectorParams:
    """A detector file, validated (ConfigError naming the file, the field and what is allowed)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError([f"collapse.detector: {str(p)!r}: no such detector file; allowed: default, off, or a file "
                           "written by `python -m analysis.detector fit`"]) from None
    except (OSError, ValueError) as e:
        raise ConfigError([f"{p}: not a detector file (JSON: {e})"]) from None
    params = validate(DetectorParams, data, str(p))
    n = len(params.features)
    bad = [f"{p}: {name}: got {len(getattr(params, name))} values for {n} features; allowed: one per feature"
           for name in ("mean", "scale", "coef") if len(getattr(params, name)) != n]
    bad += [f"{p}: scale: got {s} for {f}; allowed: a number > 0" for f, s in zip(params.features, params.scale) if s <= 0]
    if bad:
        raise ConfigError(bad)
    return params


def resolve_params(spec: str) -> DetectorParams | None:
    """collapse.detector: `default` (the committed file), `off` (None), or a path."""
    if spec == "off":
        return None
    return load_params(DEFAULT_PARAMS if spec == "default" else spec)


@dataclass
class Alert:
    step: int
    score: float


@dataclass
class Detector:
    """The warning, step by step: `update` returns (score or None before the first window, the
    Warning on the step it is raised)."""

    params: DetectorParams
    threshold: float | None = None
    """Overrides params.threshold (an operating point of the curve)."""
    features: Features = field(init=False)
    streak: int = 0
    warning: Alert | None = None

    def __post_init__(self) -> None:
        self.features = Features(self.params.window, self.params.baseline_steps)
        if self.threshold is None:
            self.threshold = self.params.threshold

    def score(self, f: dict[str, float]) -> float:
        p = self.params
        z = p.intercept + sum(w * (f[name] - m) / s for name, w, m, s in zip(p.features, p.coef, p.mean, p.scale))
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))

    def update(self, step: int, metrics: dict[str, float]) -> tuple[float | None, Alert | None]:
        f = self.features.update(metrics)
        if f is None:
            return None, None
        score = self.score(f)
        self.streak = self.streak + 1 if score >= self.threshold else 0
        if self.warning is None and self.streak >= self.params.patience:
            self.warning = Alert(step, score)
            return score, self.warning
        return score, None

    def state_dict(self) -> dict:
        return {"features": self.features.state_dict(), "streak": self.streak,
                "warning": None if self.warning is None else asdict(self.warning)}

    def load_state_dict(self, st: dict) -> None:
        self.features.load_state_dict(st["features"])
        self.streak = int(st["streak"])
        self.warning = Alert(**st["warning"]) if st["warning"] else None


def replay(params: DetectorParams, rows: Iterable[tuple[int, dict[str, float]]],
           threshold: float | None = None) -> tuple[list[tuple[int, float]], Alert | None]:
    """The detector over logged (step, metrics) rows in step order, as the trainer ran it: the
    (step, score) series and the warning (None: never warned)."""
    d = Detector(params, threshold)
    scores = []
    for step, m in rows:
        s, _ = d.update(step, m)
        if s is not None:
            scores.append((step, s))
    return scores, d.warning
