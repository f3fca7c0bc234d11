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

The trend family (issue 35; measured in bench/RESULTS.md session 16 and not adopted: no committed
detector reads it, and `python -m analysis.detector families` tries it only with --trend) reads longer
windows of the audit RMs' gap and of the KL, over the last L = TREND_WINDOWS * window steps (fewer while
the run is younger: every step it has). With g = r(rm) / b(rm_std) - r(audit) / b(audit_std) of each
step's raw values r (audit_gap's gap, up to a constant), G_t = (s(rm) - b(rm)) / b(rm_std) -
(s(audit) - b(audit)) / b(audit_std) the same of the smoothed signals (audit_gap), and h = floor(L / 2):

    gap_trend         window * (least-squares slope of g over the last L steps)   the gap's growth per window
    gap_cusum         G_t - min_{baseline_steps <= tau <= t} G_tau   a CUSUM (Page's, no allowance) of the
                      gap's increments: how far it has risen above its lowest point since the start
    audit_dis_trend   log s_t(audit_dis) / s_{t-L}(audit_dis)        the audit RMs' disagreement's long growth
    kl_curvature      (s_t(kl) - 2 s_{t-h}(kl) + s_{t-2h}(kl)) / b(H)   the KL's long-window second difference

The warning score is a logistic model of the features, p = sigmoid(b + sum_i w_i (f_i - m_i) / s_i),
fit by `python -m analysis.detector fit` on runs whose gold truth is known (harness.metrics.GoldTruth)
and scored out of sample; its parameters are a JSON file (`DetectorParams`, with the provenance of
the runs it was fit on). A run is warned on the first step where p >= threshold for `patience`
steps in a row (the step the warning is raised: what a trainer could act on).
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable

from pydantic import Field

from . import keys as K
from .schema import ConfigError, Float, PosCount, Unit, section, validate

DEFAULT_PARAMS = Path(__file__).with_name("detector_params.json")
"""The committed detector (`collapse.detector: default`) of a run with audit reward models: every signal family
(reports/detector/campaign10/fit/, fit on campaigns 1-9; scored on campaign 10 in reports/detector/audit/)."""
DEFAULT_PARAMS_NO_AUDIT = Path(__file__).with_name("detector_params_no_audit.json")
"""The committed detector of a run without them (`default` picks by what the run logs): the base and diversity
families, fit on the same runs (scored in reports/detector/). The pair they replaced: reports/detector/retired/."""
BASE_SIGNALS = {"kl": K.KL_K3, "entropy": K.ENTROPY, "ppl": K.PPL_TOKENS, "ppl_ref": K.PPL_REF, "length": K.LENGTH,
                "length_std": K.LENGTH_STD, "cap": K.FRAC_AT_CAP, "rm": K.RM_SCORE, "rm_std": K.RM_SCORE_STD,
                "clipfrac": K.POLICY_CLIPFRAC}
"""The logged metrics today's features read (short name -> metric key): logged by every run."""
SIGNALS = {**BASE_SIGNALS, "distinct_1": K.DISTINCT_1, "distinct_2": K.DISTINCT_2, "repeated": K.REPEATED_2GRAM,
           "audit": K.AUDIT_MEAN, "audit_std": K.AUDIT_STD, "audit_dis": K.AUDIT_DISAGREEMENT}
"""Every signal a feature may read: the base ones, the samples' diversity (every run, harness.signals) and
the audit reward models' (runs with model.audit_reward_paths)."""
EPS = 1e-6


def _log_ratio(a: float, b: float) -> float:
    return math.log(max(a, EPS) / max(b, EPS))


@dataclass(frozen=True)
class Feature:
    family: str
    """base | diversity | audit | forecast | trend: the signal family it belongs to (the ablation's unit)."""
    signals: tuple[str, ...]
    """The SIGNALS it reads."""
    fn: Callable[[dict[str, float], dict[str, float], dict[str, float]], float]
    """f(smoothed signals now, the start's signals, the smoothed signals `window` steps ago)."""


_BASE = ("kl", "entropy", "ppl", "ppl_ref", "length", "length_std", "cap", "rm", "rm_std", "clipfrac")
FEATURES: dict[str, Feature] = {
    "kl": Feature("base", ("kl", "entropy"), lambda s, b, old: s["kl"] / max(b["entropy"], EPS)),
    "kl_growth": Feature("base", ("kl", "entropy"), lambda s, b, old: (s["kl"] - old["kl"]) / max(b["entropy"], EPS)),
    "ppl": Feature("base", ("ppl",), lambda s, b, old: _log_ratio(s["ppl"], b["ppl"])),
    "ppl_ref": Feature("base", ("ppl_ref",), lambda s, b, old: _log_ratio(s["ppl_ref"], b["ppl_ref"])),
    "entropy": Feature("base", ("entropy",), lambda s, b, old: _log_ratio(s["entropy"], b["entropy"])),
    "length": Feature("base", ("length",), lambda s, b, old: _log_ratio(s["length"], b["length"])),
    "length_cv": Feature("base", ("length", "length_std"), lambda s, b, old: _log_ratio(
        s["length_std"] / max(s["length"], EPS), b["length_std"] / max(b["length"], EPS))),
    "cap": Feature("base", ("cap",), lambda s, b, old: s["cap"]),
    "rm_gain": Feature("base", ("rm", "rm_std"), lambda s, b, old: (s["rm"] - b["rm"]) / max(b["rm_std"], EPS)),
    "rm_spread": Feature("base", ("rm_std",), lambda s, b, old: _log_ratio(s["rm_std"], b["rm_std"])),
    "clipfrac": Feature("base", ("clipfrac",), lambda s, b, old: s["clipfrac"]),
    # what the samples look like: repetition is what pattern collapse is made of
    "distinct_1": Feature("diversity", ("distinct_1",), lambda s, b, old: _log_ratio(s["distinct_1"], b["distinct_1"])),
    "distinct_2": Feature("diversity", ("distinct_2",), lambda s, b, old: _log_ratio(s["distinct_2"], b["distinct_2"])),
    "repetition": Feature("diversity", ("repeated",), lambda s, b, old: s["repeated"] - b["repeated"]),
    "repetition_growth": Feature("diversity", ("repeated",), lambda s, b, old: s["repeated"] - old["repeated"]),
    # a second opinion on the reward: held-out RMs stop rising (or fall) while the proxy climbs
    "audit_gain": Feature("audit", ("audit", "audit_std"),
                          lambda s, b, old: (s["audit"] - b["audit"]) / max(b["audit_std"], EPS)),
    "audit_slope": Feature("audit", ("audit", "audit_std"),
                           lambda s, b, old: (s["audit"] - old["audit"]) / max(b["audit_std"], EPS)),
    "audit_gap": Feature("audit", ("audit", "audit_std", "rm", "rm_std"), lambda s, b, old:
                         (s["rm"] - b["rm"]) / max(b["rm_std"], EPS) - (s["audit"] - b["audit"]) / max(b["audit_std"], EPS)),
    "audit_disagreement": Feature("audit", ("audit_dis",), lambda s, b, old: _log_ratio(s["audit_dis"], b["audit_dis"])),
    # a forecast: where the held-out reward peaks against sqrt(KL) (Gao et al. 2022), fit online (GaoFit)
    "audit_peak": Feature("forecast", ("audit", "audit_std", "kl", "length"), lambda s, b, old: 0.0),
    # trends over TREND_WINDOWS windows (computed by Features from its longer history; the fn is a stand-in)
    "gap_trend": Feature("trend", ("audit", "audit_std", "rm", "rm_std"), lambda s, b, old: 0.0),
    "gap_cusum": Feature("trend", ("audit", "audit_std", "rm", "rm_std"), lambda s, b, old: 0.0),
    "audit_dis_trend": Feature("trend", ("audit_dis",), lambda s, b, old: 0.0),
    "kl_curvature": Feature("trend", ("kl", "entropy"), lambda s, b, old: 0.0),
}
"""Feature name -> its family, the signals it reads and how (every one relative to the run's own start)."""
FAMILIES = ("base", "diversity", "audit", "forecast", "trend")
TREND = tuple(n for n, f in FEATURES.items() if f.family == "trend")
TREND_WINDOWS = 3
"""The trend family's span, in windows (L = TREND_WINDOWS * window steps)."""
AUDIT_SIGNALS = ("audit", "audit_std", "audit_dis")
"""The signals only a run with audit reward models logs."""
BASE_FEATURES = [n for n, f in FEATURES.items() if f.family == "base"]
"""Today's features (a detector file written before the new families names only these)."""


def family_features(families: Iterable[str]) -> list[str]:
    """The features of these families, in FEATURES order."""
    fams = set(families)
    return [n for n, f in FEATURES.items() if f.family in fams]


def reads_audit(features: Iterable[str]) -> bool:
    """Whether these features read a signal of the audit reward models (a run without them cannot have it)."""
    return any(s in AUDIT_SIGNALS for n in features for s in FEATURES[n].signals)


def least_squares_slope(ys: list[float]) -> float:
    """The slope per step of the least-squares line through ys at steps 0, 1, ... (0 for fewer than 2)."""
    n = len(ys)
    if n < 2:
        return 0.0
    xm, ym = (n - 1) / 2, sum(ys) / n
    return sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / sum((i - xm) ** 2 for i in range(n))


def signals_of(features: Iterable[str]) -> dict[str, str]:
    """short name -> metric key of every signal these features read."""
    return {s: SIGNALS[s] for n in features for s in FEATURES[n].signals}


class GaoFit:
    """The held-out reward against d = sqrt(KL to the start), fit online in Gao et al.'s (2022) RL form

        R(d) - R(0) = d (alpha - beta ln d)       peak at d* = exp(alpha / beta - 1) when beta > 0

    by least squares over the steps so far (two running sums per product: O(1) a step). The feature is
    d_t / d* (clipped to [0, CAP]): 1 = the fitted peak of the held-out reward is reached now; 0 = no
    peak in sight (beta <= 0, or fewer than `min_points` steps). KL here is the sequence's: the mean
    per-token k3 times the mean length, both smoothed; R is the audit RMs' mean in the start's spreads."""

    CAP = 5.0

    def __init__(self, min_points: int = 10):
        self.min_points = min_points
        self.sums = [0.0] * 5  # uu, uv, vv, uy, vy with u = d, v = -d ln d
        self.n = 0

    def update(self, d: float, y: float) -> float:
        u = d
        v = -d * math.log(d) if d > 0 else 0.0
        for i, x in enumerate((u * u, u * v, v * v, u * y, v * y)):
            self.sums[i] += x
        self.n += 1
        return self.ratio(d)

    def coefficients(self) -> tuple[float, float] | None:
        uu, uv, vv, uy, vy = self.sums
        det = uu * vv - uv * uv
        if self.n < self.min_points or abs(det) <= 1e-12 * max(uu * vv, 1e-300):
            return None
        return (uy * vv - vy * uv) / det, (vy * uu - uy * uv) / det

    def peak(self) -> float | None:
        """d* (None: no peak: too few points, or beta <= 0)."""
        c = self.coefficients()
        if c is None or c[1] <= 0:
            return None
        return math.exp(min(50.0, c[0] / c[1] - 1))

    def ratio(self, d: float) -> float:
        p = self.peak()
        return 0.0 if p is None or p <= 0 else min(self.CAP, d / p)

    def state_dict(self) -> dict:
        return {"sums": list(self.sums), "n": self.n}

    def load_state_dict(self, st: dict) -> None:
        self.sums, self.n = list(st["sums"]), int(st["n"])


class Features:
    """The features `names` of one run, step by step (`update` returns None until the start and one
    window are in: the first `baseline_steps + window` steps). Default: today's base features."""

    def __init__(self, window: int = 10, baseline_steps: int = 5, names: Iterable[str] | None = None):
        self.window, self.baseline_steps = window, baseline_steps
        self.names = list(BASE_FEATURES if names is None else names)
        self.signals = signals_of(self.names)
        self.start: list[dict[str, float]] = []
        self.recent: deque[dict[str, float]] = deque(maxlen=window)
        self.past: deque[dict[str, float]] = deque(maxlen=window + 1)
        self.gao = GaoFit(window) if "audit_peak" in self.names else None
        self.trend = [n for n in self.names if n in TREND]
        span = TREND_WINDOWS * window
        self.long_raw: deque[dict[str, float]] = deque(maxlen=span)  # the raw signals of the last L steps
        self.long_s: deque[dict[str, float]] = deque(maxlen=span + 1)  # the smoothed ones of the last L + 1
        self.gap_min: float | None = None
        self.n = 0

    def update(self, metrics: dict[str, float]) -> dict[str, float] | None:
        missing = sorted(k for k in self.signals.values() if k not in metrics)
        if missing:
            raise KeyError(f"the detector needs {', '.join(missing)} at every step")
        raw = {name: float(metrics[key]) for name, key in self.signals.items()}
        self.n += 1
        if len(self.start) < self.baseline_steps:
            self.start.append(raw)
        self.recent.append(raw)
        s = {k: sum(r[k] for r in self.recent) / len(self.recent) for k in self.signals}
        self.past.append(s)
        b = {k: sum(r[k] for r in self.start) / len(self.start) for k in self.signals}
        peak = None
        if self.gao is not None and self.n > self.baseline_steps:
            d = math.sqrt(max(s["kl"], 0.0) * max(s["length"], 0.0))
            peak = self.gao.update(d, (s["audit"] - b["audit"]) / max(b["audit_std"], EPS))
        trend = self._trend(raw, s, b) if self.trend else {}
        if self.n < self.baseline_steps + self.window:
            return None
        old = self.past[0]
        out = {name: FEATURES[name].fn(s, b, old) for name in self.names}
        if peak is not None:
            out["audit_peak"] = peak
        out.update(trend)
        return out

    def _trend(self, raw: dict[str, float], s: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        """The trend family's features this step (module docstring), its history updated."""
        self.long_raw.append(raw)
        self.long_s.append(s)
        out: dict[str, float] = {}
        if "gap_trend" in self.trend or "gap_cusum" in self.trend:
            rs, aus = max(b["rm_std"], EPS), max(b["audit_std"], EPS)
            if "gap_trend" in self.trend:
                out["gap_trend"] = self.window * least_squares_slope([r["rm"] / rs - r["audit"] / aus for r in self.long_raw])
            if "gap_cusum" in self.trend:
                gap = (s["rm"] - b["rm"]) / rs - (s["audit"] - b["audit"]) / aus
                if self.n >= self.baseline_steps:  # the start is known (b fixed) from here on
                    self.gap_min = gap if self.gap_min is None else min(self.gap_min, gap)
                out["gap_cusum"] = 0.0 if self.gap_min is None else gap - self.gap_min
        if "audit_dis_trend" in self.trend:
            out["audit_dis_trend"] = _log_ratio(s["audit_dis"], self.long_s[0]["audit_dis"])
        if "kl_curvature" in self.trend:
            h = (len(self.long_s) - 1) // 2
            mid, first = self.long_s[-1 - h]["kl"], self.long_s[-1 - 2 * h]["kl"]
            out["kl_curvature"] = (s["kl"] - 2 * mid + first) / max(b["entropy"], EPS)
        return out

    def state_dict(self) -> dict:
        return {"start": list(self.start), "recent": list(self.recent), "past": list(self.past), "n": self.n,
                "gao": None if self.gao is None else self.gao.state_dict(),
                "long_raw": list(self.long_raw), "long_s": list(self.long_s), "gap_min": self.gap_min}

    def load_state_dict(self, st: dict) -> None:
        self.start, self.n = list(st["start"]), int(st["n"])
        self.recent = deque(st["recent"], maxlen=self.window)
        self.past = deque(st.get("past", []), maxlen=self.window + 1)  # a checkpoint of older code: refilled
        if self.gao is not None and st.get("gao"):
            self.gao.load_state_dict(st["gao"])
        self.long_raw = deque(st.get("long_raw", []), maxlen=self.long_raw.maxlen)  # older code: refilled
        self.long_s = deque(st.get("long_s", []), maxlen=self.long_s.maxlen)
        self.gap_min = st.get("gap_min")


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


def resolve_params(spec: str, has_audit: bool = True) -> DetectorParams | None:
    """collapse.detector: `default` (the committed detector for a run with audit reward models, or the
    one fit without their signals for a run without), `off` (None), or a path."""
    if spec == "off":
        return None
    if spec == "default":
        return load_params(DEFAULT_PARAMS if has_audit and DEFAULT_PARAMS.is_file() else DEFAULT_PARAMS_NO_AUDIT)
    return load_params(spec)


def fingerprint(params: DetectorParams) -> str:
    """What a run records of the detector it ran with (tag provenance.detector, beside the run's other provenance): the
    commit it was fit at and a hash of its parameters, so the warnings of two runs are known to come from one detector."""
    blob = json.dumps(asdict(params), sort_keys=True, default=str).encode()
    return f"fit at {params.provenance.get('commit', '?')}, sha256 {hashlib.sha256(blob).hexdigest()[:12]}"


def needs_audit(params: DetectorParams) -> bool:
    """Whether the detector reads the audit reward models' signals."""
    return reads_audit(params.features)


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
        self.features = Features(self.params.window, self.params.baseline_steps, self.params.features)
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
                "warning": None if self.warning is None else asdict(self.warning),
                "params": asdict(self.params), "threshold": self.threshold}

    def load_state_dict(self, st: dict) -> None:
        self.features.load_state_dict(st["features"])
        self.streak = int(st["streak"])
        self.warning = Alert(**st["warning"]) if st["warning"] else None

    def restored(self, st: dict) -> Detector:
        """The detector a resumed run goes on with, its checkpointed state loaded: the one the run started with,
        which the checkpoint holds (so a `default` that changed since, with an update, does not switch detectors in
        the middle of a run). A checkpoint of older code holds only the state: this detector takes it where it
        holds every signal this one reads, else this one starts over from the resumed step (said on stderr)."""
        if st.get("params"):
            d = Detector(validate(DetectorParams, st["params"], "the checkpoint's detector"), st.get("threshold"))
        else:
            d = Detector(self.params, self.threshold)
            start = st["features"]["start"]
            if missing := sorted(set(d.features.signals) - set(start[0])) if start else []:
                print(f"[harness] the checkpoint's warning state is of another detector (it lacks {', '.join(missing)}): "
                      "the warning starts over from this step", file=sys.stderr)
                return d
        d.load_state_dict(st)
        return d


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
