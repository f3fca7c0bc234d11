"""PDF reports of finished ablations from the MLflow store and the registry alone (`python -m reports.build`):
OUT/<ablation>/report.pdf per ablation and OUT/harness-report.pdf with all. Per ablation: grid, figure,
final/peak metrics, claims with their tests and verdicts, samples (a sweep: analysis.sweep_plots'
summary). Fonts: DejaVu Sans from matplotlib's data folder, so δ, η, λ print everywhere. Outputs and
how to read them: reports/README.md.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import math
import platform
import shutil
import sys
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib import get_data_path
from reportlab import rl_config
from reportlab.lib import colors
from reportlab.lib.enums import TA_CENTER
from reportlab.lib.fonts import addMapping
from reportlab.lib.pagesizes import A4
from reportlab.lib.styles import ParagraphStyle
from reportlab.lib.units import cm
from reportlab.lib.utils import ImageReader
from reportlab.pdfbase.pdfmetrics import getRegisteredFontNames, registerFont, stringWidth
from reportlab.pdfbase.ttfonts import TTFont
from reportlab.platypus import (
    CondPageBreak,
    Image,
    KeepTogether,
    PageBreak,
    Paragraph,
    SimpleDocTemplate,
    Spacer,
    Table,
    TableStyle,
)

from analysis import detector
from analysis.claims import check_claims, log_claims
from analysis.figures import make_figures
from analysis.stats import ALPHA, INCONCLUSIVE, MIN_SEEDS, NOT_REPRODUCED, POWER, REPRODUCED, WORLD_DEPENDENT
from analysis.store import (
    STORE_OPTIONS,
    AblationData,
    ablations_in_store,
    default_tracking_uri,
    load_ablation,
    smoothing,
)
from harness import keys as K
from harness import provenance, tracking
from harness.registry import REPO_ROOT, Registry, RegistryError, UnknownAblation, ablation_names, paper_key
from harness.summary import TRAIN_TABLE, WORLD_TABLE, describe, fmt, fmt_mean_sd
from harness.tracking import redact
from reports.reference import GENERATED, fit_worlds_text, write_reference

# Images go into the PDF as binary streams: the ASCII85 text encoding (reportlab's default)
# runs in pure Python here and costs about a second per report for nothing a reader sees.
rl_config.useA85 = 0

PAGE = A4
MARGIN = 2 * cm
FRAME_W = PAGE[0] - 2 * MARGIN
FRAME_H = PAGE[1] - 2 * MARGIN
CELL_PAD = 3
SAMPLES_PER_VARIANT = 2
MAX_RESPONSE_CHARS = 500
MAX_SWEEP_ROWS = 40
SWEEP_COLS_PER_TABLE = 8  # a 2-D sweep's trials (failure reasons too) in one table
COMBINED = "harness-report.pdf"
RESULTS = "results"  # what a user's build writes (ignored by git)
REFERENCE = REPO_ROOT / "reports"  # the committed reports, rebuilt only with --reference
DETECTOR_DIRS = (Path(RESULTS) / "detector", REFERENCE / "detector")
"""Where the detector's evaluation is read from for the combined report: a user's, else the committed one."""
VERDICT_COLORS = {REPRODUCED: "#d9f2d9", NOT_REPRODUCED: "#f8d7d7", INCONCLUSIVE: "#fdf0c8"}
WORLDS_COLOR = "#e3d9f2"  # a world-dependent claim (analysis.claims): neither of the three


def make_styles() -> dict[str, ParagraphStyle]:
    """Paragraph styles in DejaVu Sans and Sans Mono (registered from matplotlib's data folder)."""
    for name in ("DejaVuSans", "DejaVuSans-Bold", "DejaVuSans-Oblique", "DejaVuSansMono"):
        if name not in getRegisteredFontNames():
            registerFont(TTFont(name, str(Path(get_data_path()) / "fonts" / "ttf" / f"{name}.ttf")))
    for bold, italic, face in ((0, 0, ""), (1, 0, "-Bold"), (0, 1, "-Oblique"), (1, 1, "-Bold")):
        addMapping("DejaVuSans", bold, italic, f"DejaVuSans{face}")
    base = ParagraphStyle("body", fontName="DejaVuSans", fontSize=9, leading=12, splitLongWords=1)

    def style(name: str, size: float, leading: float, **kw) -> ParagraphStyle:
        return ParagraphStyle(name, parent=base, fontSize=size, leading=leading, **kw)

    return {
        "body": base, "cell": style("cell", 7.5, 9.3), "mono": style("mono", 7, 8.8, fontName="DejaVuSansMono"),
        # header cells wrap between words only (never "accura-cy"); `table` widens columns to fit
        "cellb": style("cellb", 7.5, 9.3, fontName="DejaVuSans-Bold", splitLongWords=0),
        "title": style("title", 22, 28, fontName="DejaVuSans-Bold", alignment=TA_CENTER),
        "subtitle": style("subtitle", 11, 15, alignment=TA_CENTER),
        # keepWithNext: a heading never ends a page without what it heads
        **{f"h{i}": style(f"h{i}", size, size * 1.3, fontName="DejaVuSans-Bold", spaceBefore=b, spaceAfter=a,
                          keepWithNext=1) for i, (size, b, a) in enumerate([(14, 4, 6), (11, 10, 4), (9, 6, 2)], 1)},
        "note": style("note", 8, 10.5, textColor=colors.HexColor("#555555")),
    }


def P(text: Any, style: ParagraphStyle) -> Paragraph:
    """A paragraph of plain text (escaped: responses may hold < & >)."""
    return Paragraph(escape(str(text)).replace("\n", "<br/>"), style)


def _fit_header(rows: list[list[Any]], widths: list[float], st: dict[str, ParagraphStyle]) -> list[float]:
    """Column widths (points) from fractions of the frame, each at least as wide as the longest
    word of its header; the other columns give up the difference in proportion to their slack."""
    head = st["cellb"]
    need = [max((stringWidth(w, head.fontName, head.fontSize) for w in str(h).split()), default=0) + 2 * CELL_PAD + 1
            for h in rows[0]]
    width = [max(f * FRAME_W, n) for f, n in zip(widths, need)]
    slack = [w - n for w, n in zip(width, need)]
    excess = sum(width) - FRAME_W
    return [w - excess * s / sum(slack) if excess > 0 and sum(slack) else w for w, s in zip(width, slack)]


def table(rows: list[list[Any]], widths: list[float], st: dict[str, ParagraphStyle], *, header: bool = True,
          extra: list[tuple] | None = None) -> Table:
    """Wrapping table: every cell a Paragraph, widths as fractions of the frame, header on each page."""
    cells = [[c if isinstance(c, Paragraph) else P(c, st["cellb" if header and i == 0 else "cell"]) for c in row]
             for i, row in enumerate(rows)]
    t = Table(cells, colWidths=_fit_header(rows, widths, st) if header else [w * FRAME_W for w in widths],
              repeatRows=1 if header else 0, hAlign="LEFT")
    style = [("VALIGN", (0, 0), (-1, -1), "TOP"), ("GRID", (0, 0), (-1, -1), 0.3, colors.HexColor("#bbbbbb")),
             ("LEFTPADDING", (0, 0), (-1, -1), CELL_PAD), ("RIGHTPADDING", (0, 0), (-1, -1), CELL_PAD),
             ("TOPPADDING", (0, 0), (-1, -1), 2), ("BOTTOMPADDING", (0, 0), (-1, -1), 2)]
    if header:
        style.append(("BACKGROUND", (0, 0), (-1, 0), colors.HexColor("#e8e8e8")))
    t.setStyle(TableStyle(style + (extra or [])))
    return t


class FitImage(Image):
    """Shrinks (to `min_scale` at most) to fill the rest of a page rather than leave it blank, else moves on."""

    min_scale = 0.8

    def __init__(self, path: Path, max_h: float):
        w, h = ImageReader(str(path)).getSize()
        scale = min(FRAME_W / w, max_h / h)  # frame width, or smaller to fit max_h; aspect kept
        super().__init__(str(path), width=w * scale, height=h * scale)
        self.full = (w * scale, h * scale)

    def wrap(self, avail_w, avail_h):
        w, h = self.full
        scale = min(1.0, avail_w / w)
        if h * scale > avail_h >= h * self.min_scale:
            scale = avail_h / h
        self.drawWidth, self.drawHeight = w * scale, h * scale
        return self.drawWidth, self.drawHeight


def machine_info(tracking_uri: str) -> dict[str, str]:
    """The title page's record: when, which code, machine and libraries (harness.provenance), which store."""
    cpu = provenance.cpu()
    return {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "git commit": provenance.commit(ignore=GENERATED),
        "machine": f"{platform.platform()}; {cpu['model']}, {cpu['logical_cpus']} logical CPUs; flags {cpu['flags']}",
        "libraries": ", ".join(f"{k} {x}" for k, x in provenance.versions().items()),
        "MLflow store": redact(f"sqlite:///{_relative(tracking_uri[10:])}" if tracking_uri.startswith("sqlite:///")
                               else tracking_uri),
    }


def _relative(path: Path | str) -> str:
    """A file as the repo names it, else its name: no machine's absolute path in a report."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else path.name


@dataclass
class Section:
    """Everything one ablation's pages need, computed once; `flowables` renders it afresh (a
    reportlab flowable cannot be placed in two documents)."""

    spec: Registry
    data: AblationData
    figure_png: Path | None = None
    metrics: pd.DataFrame = field(default_factory=pd.DataFrame)
    claims: pd.DataFrame = field(default_factory=pd.DataFrame)
    samples: pd.DataFrame = field(default_factory=pd.DataFrame)
    sweep: dict[str, Any] | None = None
    tricks: dict[str, Any] | None = None
    """A design study's analysis (a sweep with `objectives`: reports/tricks.py, which tricks matter)."""
    notes: list[str] = field(default_factory=list)

    def flowables(self, st) -> list:
        out: list = [P(self.spec.title, st["h1"]), overview(self, st)] + [P(n, st["note"]) for n in self.notes]
        if self.spec.is_sweep:
            if self.tricks:  # a design study: its own pages instead of the trials of a search
                from reports.tricks import flowables as tricks_pages

                return out + tricks_pages(self.tricks, st, sys.modules[__name__]) + [PageBreak()]
            return out + sweep_flowables(self, st) + [PageBreak()]
        out += [P("Grid: what each variant changes", st["h2"])] + grid_flowables(self.spec, st)
        if self.figure_png is not None:  # heading and figure on one page; not keepWithNext: reportlab measures a
            # kept-together group at unlimited height, so the image could not shrink into the space left
            img = FitImage(self.figure_png, FRAME_H * 0.85)
            head = ParagraphStyle("figure-heading", parent=st["h2"], keepWithNext=0)
            out += [CondPageBreak(img.full[1] * img.min_scale + 2 * head.leading + head.spaceBefore),
                    P("Figure", head), img, Spacer(1, 4)]
        if not self.metrics.empty:
            note = ("mean ± sd over seeds (sample sd; one seed: the value); final = mean of the last 10% of "
                    "logged steps, peak = largest logged value")
            note += ("; collapsed = seeds marked collapsed (mean collapse step: the gold onset on the embedded "
                     "world)") if "collapsed" in self.metrics else ""
            note += warned_note(self.data.runs) if "warned" in self.metrics else ""
            note += ("; best step = per seed, the step of the best held-out eval before collapse (its policy: "
                     "best_policy.pt in the run folder)") if "best step" in self.metrics else ""
            rows, n = [list(self.metrics.columns)] + self.metrics.astype(str).values.tolist(), self.metrics.shape[1]
            out += [P("Final and peak metrics", st["h2"]), table(rows, [0.22] + [0.78 / (n - 1)] * (n - 1), st),
                    P(note + ".", st["note"])]
        out += [P("Claims", st["h2"])] + claims_flowables(self, st)
        if self.spec.kind != "world":  # reward-model runs sample no responses
            out += [P("Sample responses (last sampled step)", st["h2"])] + samples_flowables(self, st)
        return out + [PageBreak()]


def overview(sec: Section, st) -> Table:
    spec, d, runs = sec.spec, sec.data, sec.data.runs
    status = ", ".join(f"{k} {v}" for k, v in runs["status"].value_counts().items()) or "none"
    n = len(runs)
    trials = (sec.sweep or {}).get("table_full")
    if isinstance(trials, pd.DataFrame):  # a sweep's runs are its trials' (they carry no variant tag)
        n, status = sum(len(ids) for ids in trials["mlflow_run_ids"] if isinstance(ids, list)), f"{len(trials)} trials"
    elsewhere = sorted(set(runs["experiment"]) - {spec.name})
    rows = [
        ["figure", spec.figure or "–"], ["kind", spec.kind], ["description", spec.description],
        ["inferred (not stated by the paper)", "\n".join(spec.inferred)], ["base config", spec.base or ""],
        ["seeds (registry)", ", ".join(map(str, spec.seeds))], ["runs in store", f"{n} ({status})"],
        ["runs read from", f"experiment {', '.join(elsewhere)} (no runs in experiment {spec.name!r}: the world "
                           "build's own runs stand in)" if elsewhere else ""],
        ["code of the runs", ", ".join(sorted({c for c in runs["git_commit"] if c}))],
        ["parent run", d.parent_run_id or ""], ["variants without runs", ", ".join(d.missing_variants)],
        ["registry file", _relative(spec.path) if spec.path else ""],
    ]
    return table([r for r in rows if r[1]], [0.2, 0.8], st, header=False)


def grid_flowables(spec: Registry, st) -> list:
    """Variant | the settings where variants differ; settings all variants share listed below."""
    if not spec.variants:
        return [P("The registry lists no variants for this ablation (spec read from the runs' tags).", st["note"])]
    keys = sorted({k for v in spec.variants for k in v.settings})
    varying = [k for k in keys if len({repr(v.settings.get(k, "(base)")) for v in spec.variants}) > 1]
    shared = {**spec.shared, **{k: spec.variants[0].settings[k] for k in keys if k not in varying}}
    rows = [["variant (legend name)", "settings that differ between variants"]]
    rows += [[v.name, "\n".join(f"{k} = {v.settings[k]}" for k in varying if k in v.settings) or "(the base config)"]
             for v in spec.variants]
    out: list = [table(rows, [0.38, 0.62], st)]
    if shared:
        out.append(P("Shared by all variants: " + "; ".join(f"{k} = {v}" for k, v in shared.items())
                     + (f" (on top of {spec.base})" if spec.base else ""), st["note"]))
    return out


def final_peak_table(data: AblationData) -> pd.DataFrame:
    """Per variant, mean ± sd over seeds of TRAIN_TABLE / WORLD_TABLE (harness.summary, as the runner's
    table) and "k/n (mean step)" collapsed; columns without data anywhere (gold on HH-RLHF) dropped."""
    world = data.spec.kind == "world"
    columns = WORLD_TABLE if world else TRAIN_TABLE
    if not world and data.shown_metric(K.PPL) == K.PPL_TOKENS:
        columns = [("final ppl (token-pooled)", K.PPL_TOKENS, s) if m == K.PPL else (h, m, s) for h, m, s in columns]
    data.metrics(sorted({m for _, m, _ in columns}))  # one load for all columns
    table = pd.DataFrame({"variant": data.variants})
    for header, metric, stat in columns:
        if not (per_run := data.per_run(metric, stat)).empty:
            table[header] = [fmt_mean_sd(describe(per_run.value[per_run.variant == v])) for v in table.variant]
    if not world:  # reward-model runs do not collapse
        groups = [data.runs[data.runs["variant"] == v] for v in data.variants]
        table["collapsed"] = [f"{g['collapsed'].sum()}/{len(g)}" + (
            f" (step {fmt(g['collapse_step'].mean())})" if g["collapse_step"].notna().any() else "") for g in groups]
        if data.runs["warning_step"].notna().any():  # the early warning (no gold) and its lead on the gold onset
            table["warned"] = [f"{g['warning_step'].notna().sum()}/{len(g)}" for g in groups]
            table["lead"] = [_leads(g) for g in groups]
    if data.runs["best_step"].notna().any():  # harness.train's best held-out policy before collapse, per seed
        table["best step"] = [", ".join(fmt(x) for x in data.runs.loc[data.runs["variant"] == v, "best_step"].dropna())
                              or "–" for v in data.variants]
    return table


def warned_note(runs: pd.DataFrame) -> str:
    """The metrics table's note on its warned and lead columns, naming the detector(s) the runs ran with (their tag
    provenance.detector; runs of older code have none): a committed page and a fresh run can differ there."""
    key = K.TAG_DETECTOR.removeprefix("provenance.")
    ran = sorted({p[key] for p in runs.get("provenance", []) if isinstance(p, dict) and key in p})
    return ("; warned = seeds the early-warning detector they ran with warned (no gold used"
            + (f"; the detector {' and '.join(ran)}" if ran else "") + "), lead = gold onset − warning step over the "
            "warned seeds whose gold fell, median (range)")


def _leads(runs: pd.DataFrame) -> str:
    """The warned runs' leads (gold onset - warning step: > 0, warned before the gold fell), median (range)."""
    lead = (runs["gold_onset"] - runs["warning_step"]).dropna()
    if lead.empty:
        return "–"
    return fmt(lead.median()) + (f" ({fmt(lead.min())} to {fmt(lead.max())})" if lead.nunique() > 1 else "")


def claims_flowables(sec: Section, st) -> list:
    """The claims table, then per claim the smallest difference its test finds with 80% power."""
    if sec.claims.empty:
        return [P(f"{_relative(sec.spec.path) if sec.spec.path else sec.spec.name} states no claims.", st["note"])]
    rows: list[list[Any]] = [["claim", "rule; test", "numbers (every part of the rule)", "verdict"]]
    extra, power = [], []
    for i, r in enumerate(sec.claims.itertuples(), start=1):
        why = f"<br/>{escape(r.reason)}" if r.reason else ""
        verdict = Paragraph(f"<b>{escape(r.verdict)}</b>{why}{_worlds_note(r)}", st["cell"])
        rows.append([f"{r.claim} ({r.source})", f"{r.rule}; {r.test if isinstance(r.test, str) else '–'}",
                     r.numbers or "–", verdict])
        extra.append(("BACKGROUND", (3, i), (3, i), colors.HexColor(VERDICT_COLORS.get(r.verdict, WORLDS_COLOR))))
        if isinstance(r.min_detectable, float) and math.isfinite(r.min_detectable):
            power.append(f"“{r.claim}”: with n = {r.n} seeds, a difference smaller than {r.min_detectable:.2g} "
                         "would not be detected")
    note = (f"Verdicts: reproduced when the {1 - ALPHA:.0%} interval lies wholly on the claimed side, not reproduced "
            f"when wholly on the other, else inconclusive; a claim that variants are alike (similar), by equivalence: "
            f"two one-sided tests (TOST) at α = {ALPHA:g}, reproduced when the {1 - 2 * ALPHA:.0%} interval lies within "
            "the claim's ±margin (its smallest difference that matters, with its reason in the rule), not reproduced "
            f"when wholly outside it; always inconclusive with fewer than {MIN_SEEDS} runs per "
            f"variant. Source: the paper's section, or ours (our own extra check).")
    if sec.claims["worlds"].astype(bool).any():
        note += WORLDS_NOTE
    power_note = f"Power ({POWER:.0%}, two-sided α = {ALPHA:g}): " + "; ".join(power) + "." if power else ""
    return [table(rows, [0.22, 0.26, 0.36, 0.16], st, extra=extra), P(note, st["note"])] + (
        [P(power_note, st["note"])] if power else [])


WORLDS_NOTE = (" Runs on several worlds: each claim is judged on each world alone and once pooled over all runs by "
               "the same tests stratified by world (runs compared within their world only); the numbers are the "
               "pooled test's, then each world's verdict; world-dependent: reproduced on one world and not "
               "reproduced on another (the pooled verdict beside it).")


def _worlds_note(r) -> str:
    """Under a claim's verdict: 'reproduced on k of K worlds', and the pooled verdict where it is world-dependent."""
    if not r.worlds:
        return ""
    pooled = f"; pooled test: {escape(r.pooled_verdict)}" if r.verdict == WORLD_DEPENDENT else ""
    return f"<br/>{escape(r.worlds)}{pooled}"


def _clip(text: Any, n: int = MAX_RESPONSE_CHARS) -> str:
    s = "" if text is None else str(text)
    return s if len(s) <= n else s[:n] + f" … [{len(s) - n} more characters]"


def samples_flowables(sec: Section, st) -> list:
    if sec.samples.empty:
        return [P("No samples artifacts (samples/step_*.json) in these runs.", st["note"])]
    out: list = []
    for variant in sec.data.variants:
        rows_v = sec.samples[sec.samples["variant"] == variant]
        if rows_v.empty:
            continue
        first = rows_v.iloc[0]
        run = sec.data.runs[sec.data.runs["run_id"] == first.run_id].iloc[0]
        head = f"{variant} — seed {first.seed}, step {first.step}"
        if run.collapsed:
            head += " — COLLAPSED" + (f" at step {int(run.collapse_step)}" if pd.notna(run.collapse_step) else "")
        rows = [["prompt", "response", "RM / gold / length"]]
        for r in rows_v.head(SAMPLES_PER_VARIANT).itertuples():
            scores = " / ".join(fmt(x) for x in (r.rm_score, r.gold_score, r.length))
            rows.append([P(_clip(r.prompt, 200), st["mono"]), P(_clip(r.response), st["mono"]), scores])
        out.append(KeepTogether([P(head, st["h3"]), table(rows, [0.25, 0.57, 0.18], st)]))
    return out


def sweep_flowables(sec: Section, st) -> list:
    sweep = sec.sweep or {}
    out: list = []
    if sweep.get("best"):
        b = sweep["best"]
        rows = [["trial", str(b["number"])], ["objective", fmt(b["value"], 4)]]
        rows += [["collapsed", str(b["collapsed"]).lower()]] if "collapsed" in b else []
        rows += [[k, fmt(v, 4) if isinstance(v, float) else str(v)] for k, v in b["params"].items()]
        rows += [["MLflow runs", ", ".join(map(str, b.get("mlflow_run_ids") or []))]]
        out += [P("Best trial", st["h2"]), table(rows, [0.3, 0.7], st, header=False)]
    for fig in sweep.get("figures") or []:
        if Path(fig).is_file():  # the spacers keep the PNG's opaque white edge off the table rules around it
            out += [Spacer(1, 4), FitImage(Path(fig), FRAME_H * 0.6), Spacer(1, 4)]
    trials = sweep.get("table")
    if isinstance(trials, pd.DataFrame) and not trials.empty:
        shown = trials.head(MAX_SWEEP_ROWS).rename(columns=str)
        out.append(P(f"Trials ({len(shown)} of {len(trials)} shown)", st["h2"]))
        cols, step = list(shown.columns), SWEEP_COLS_PER_TABLE - 1
        for i in range(0, max(len(cols) - 1, 1), step):  # wide tables split, the first column repeated in each
            group = cols[:1] + cols[1:][i:i + step]
            rows = [group] + shown[group].map(lambda x: fmt(x, 4) if isinstance(x, float) else str(x)).values.tolist()
            out += [table(rows, [1 / len(group)] * len(group), st), Spacer(1, 0.3 * cm)]
    return out


def build_section(data: AblationData, out: Path, smooth_k: int = 1, log_figures: bool = True) -> Section:
    sec = Section(spec=data.spec, data=data)
    if data.spec.is_sweep:
        try:  # a sweep with `objectives` is a design study (analysis.tricks); None for the others
            from reports.tricks import design_summary

            sec.tricks = design_summary(str(data.spec.path), data.tracking_uri, out / data.name)
        except Exception as e:
            sec.notes.append(f"analysis.tricks failed: {type(e).__name__}: {e}")
        if sec.tricks:
            return sec
        try:  # imported here: it loads optuna; a broken sweep should not take the other sections down
            sec.sweep = importlib.import_module("analysis.sweep_plots").sweep_summary(
                str(data.spec.path), data.tracking_uri, out_dir=out / data.name)
        except Exception as e:
            sec.notes.append(f"analysis.sweep_plots.sweep_summary failed: {type(e).__name__}: {e}")
        return sec
    sec.figure_png = make_figures(data.name, None, smooth_k, out, log_figures, data=data).paths[0]
    sec.metrics = final_peak_table(data)
    sec.samples = data.samples(SAMPLES_PER_VARIANT)
    sec.claims = check_claims(data)
    return sec


def detector_flowables(found: tuple[Path, dict] | None, st) -> list:
    """The combined report's last page: the early warning scored against the gold truth on runs it was
    not fit on (the committed reports/detector/, or a user's results/detector/): (its folder, evaluation)."""
    if not found:
        return []
    folder, ev = found
    prov = ev.get("detector", {}).get("provenance", {})
    note = (f"{ev['line']}. Fit on {prov.get('fit_runs', '?')} runs of {', '.join(prov.get('split', {}).get('files', []))} "
            f"(seeds {prov.get('split', {}).get('seeds')}) on {fit_worlds_text(prov)}; every row but \"fit\" is out of "
            "sample. Recall: gold "
            "falls warned; false alarms: runs whose gold never fell that were warned; lead = gold onset − warning step. "
            "Intervals: Clopper-Pearson, percentile bootstrap (analysis/detector.py).")
    out = [P("The early warning against the gold truth", st["h1"]),
           table(detector.table_rows(ev), [0.36, 0.12, 0.17, 0.17, 0.18], st), P(note, st["note"])]
    if (folder / "detector.png").is_file():
        out += [Spacer(1, 6), FitImage(folder / "detector.png", FRAME_H * 0.45)]
    return out


def write_pdf(path: Path, sections: list[Section], info: dict[str, str], st, extra: list | None = None) -> Path:
    """A title page (naming the ablation of a one-section report), contents, every section, `extra`."""
    one = len(sections) == 1
    title = f"Ablation report: {sections[0].spec.title}" if one else "Secrets of RLHF: PPO ablation report"
    story: list = [Spacer(1, 3 * cm), P(title, st["title"]), Spacer(1, 0.4 * cm),
                   P("Reproducing “Secrets of RLHF in LLMs Part I: PPO” and the APA paper with the harness",
                     st["subtitle"]), Spacer(1, 1.5 * cm), table([[k, v] for k, v in info.items()], [0.22, 0.78], st,
                                                                  header=False)]
    if sections:
        rows = [["ablation", "figure", "runs", "claims: reproduced / not / inconclusive"]]
        for s in sections:
            counts = s.claims["verdict"].value_counts() if not s.claims.empty else {}
            rows.append([s.spec.title, s.spec.figure or "–", str(len(s.data.runs)), " / ".join(
                str(counts.get(v, 0)) for v in VERDICT_COLORS) + (f" (+{counts[WORLD_DEPENDENT]} world-dependent)"
                                                                  if WORLD_DEPENDENT in counts else "")
                if len(s.claims) else "–"])
        story += [Spacer(1, 0.8 * cm), P("Contents", st["h2"]), table(rows, [0.55, 0.1, 0.08, 0.27], st)]
    story.append(PageBreak())
    for s in sections:
        story += s.flowables(st)
    story += (extra or []) + ([PageBreak()] if extra else [])
    label = "harness report" + (f" · {sections[0].spec.name}" if one else "")

    def footer(canvas, doc):
        canvas.saveState()
        canvas.setFont("DejaVuSans", 7)
        canvas.setFillColor(colors.HexColor("#777777"))
        canvas.drawString(MARGIN, MARGIN / 2, f"{label} · commit {info['git commit']}")
        canvas.drawRightString(PAGE[0] - MARGIN, MARGIN / 2, f"page {doc.page}")
        canvas.restoreState()

    path.parent.mkdir(parents=True, exist_ok=True)
    doc = SimpleDocTemplate(str(path), pagesize=PAGE, leftMargin=MARGIN, rightMargin=MARGIN, topMargin=MARGIN,
                            bottomMargin=MARGIN, title=title, author="harness reports.build")
    doc.build(story[:-1], onFirstPage=footer, onLaterPages=footer)  # no blank page after the last section
    return path


@dataclass
class BuildResult:
    reports: dict[str, Path]
    combined: Path | None
    errors: dict[str, str]
    skipped: list[str] = field(default_factory=list)
    """Ablations left out because the store holds no runs of them."""


def build(ablations: list[str] | None, tracking_uri: str | None = None, out: str | Path = RESULTS, smooth_k: int = 1,
          ablations_dir: str | Path | None = None, log_figures: bool = True, reference: bool = False,
          merge: bool = False) -> BuildResult:
    """Per-ablation PDFs and, when every ablation asked for (none: all, registry and store) has runs
    and more than one was asked for, the combined one. An ablation without runs is skipped with a
    message; one that fails is reported (`errors`, stderr) and left out. reference=True also writes
    OUT/reference.json and OUT/README.md (reports.reference); with merge=True the named ablations' results
    go into the committed ones, the others' kept (the combined PDF is left as it is: it needs every run)."""
    uri, out, st = tracking_uri or default_tracking_uri(), Path(out), make_styles()
    registry = ablation_names(ablations_dir)
    names = list(ablations) if ablations else registry + [n for n in ablations_in_store(uri) if n not in registry]
    info, sections, errors, skipped = machine_info(uri), [], {}, []
    for name in names:
        try:
            data = load_ablation(name, uri, ablations_dir)
            spec = data.spec
            # a sweep's runs: the experiment of its parent run (of the others: what load_ablation found)
            if not (tracking.client(uri).get_experiment_by_name(spec.name) if spec.is_sweep else len(data.runs)):
                skipped.append(data.name)
                how = f"harness.sweep {_relative(spec.path)}" if spec.is_sweep else f"harness.ablate {data.name}"
                print(f"skipped {data.name}: no runs in {redact(uri)} (run `python -m {how}` first)", file=sys.stderr)
                continue
            sections.append(build_section(data, out, smooth_k, log_figures))
        except (UnknownAblation, RegistryError):
            raise
        except Exception as e:  # keep the other ablations' reports
            errors[str(name)] = f"{type(e).__name__}: {e}"
            print(f"error: {name}: {errors[str(name)]}", file=sys.stderr)
    sections.sort(key=lambda s: paper_key(s.spec.order, s.spec.name))
    reports = {s.spec.name: write_pdf(out / s.spec.name / "report.pdf", [s], info, st) for s in sections}
    for s in sections if log_figures else []:  # the grid's parent run: its report and claims, for MLflow's UI
        if s.data.parent_run_id:
            tracking.log_file_artifacts(uri, s.data.parent_run_id, [reports[s.spec.name]])
            if not s.claims.empty:
                log_claims(s.claims, uri, s.data.parent_run_id)
    # one named ablation must not replace the combined report of everything with itself alone, nor may a partial store
    whole = sections and not skipped and not errors and (not ablations or len(sections) > 1)
    whole = (whole or (reference and bool(sections))) and not merge  # the reference: every figure it holds
    found = next(((d, e) for d in (out / "detector", *DETECTOR_DIRS) if (e := detector.load_summary(d / "evaluation.json"))),
                 None)
    combined = write_pdf(out / COMBINED, sections, info, st, detector_flowables(found, st)) if whole else None
    if reference:  # the committed folder holds reference results only: no report of older runs stays
        for name in [] if merge else skipped:
            shutil.rmtree(out / name, ignore_errors=True)
        write_reference(sections, out, skipped, merge=merge)
    return BuildResult(reports, combined, errors, skipped)


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    ap = argparse.ArgumentParser(prog="python -m reports.build", parents=[STORE_OPTIONS], description=__doc__)
    ap.add_argument("ablations", nargs="*", metavar="ABLATION",
                    help="registry names or YAML paths (default: every ablation in the registry and the store)")
    ap.add_argument("--out", help=f"output root (default {RESULTS}/; with --reference the committed reports/)")
    ap.add_argument("--reference", action="store_true",
                    help="rebuild the committed reference reports in reports/ with reference.json and README.md")
    ap.add_argument("--merge", action="store_true",
                    help="with --reference and ABLATION names: put their results into the committed reference "
                         "(reference.json, README.md), keeping every other figure's; for files run into a store of "
                         "their own (a design study, a figure at a later commit)")
    ap.add_argument("--smooth", type=smoothing, default=1, metavar="K",
                    help="rolling mean over K logged steps in figures (default 1 = raw)")
    ap.add_argument("--no-log", action="store_true", help="do not log figures to the ablations' parent runs")
    args = ap.parse_args(argv)
    out = Path(args.out or (REFERENCE if args.reference else RESULTS))
    try:
        if args.merge and not (args.reference and args.ablations):
            print("error: --merge: needs --reference and the ABLATION names to put in (e.g. reports.build study_tricks "
                  "--reference --merge --tracking-uri STORE)", file=sys.stderr)
            return 2
        res = build(args.ablations, args.tracking_uri, out, args.smooth, args.ablations_dir, not args.no_log,
                    args.reference, args.merge)
    except (UnknownAblation, RegistryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, path in res.reports.items():
        print(f"{name}: {path}")
    store = redact(args.tracking_uri or default_tracking_uri())
    if res.combined:
        print(f"combined: {res.combined}")
    elif not res.reports and not res.errors:
        print(f"error: nothing to report: the store {store} holds no runs of "
              + (", ".join(res.skipped) if args.ablations else "any ablation"), file=sys.stderr)
        return 1
    elif res.skipped or res.errors:
        print(f"combined report not built: no runs of {', '.join(res.skipped) or '-'}"
              + (f"; failed: {', '.join(res.errors)}" if res.errors else ""))
    elif args.merge:
        print(f"combined report left as it was (--merge: {out / COMBINED} is built from every figure's runs)")
    else:
        print("combined report left as it was (one ablation named; name none, or several, to rebuild "
              f"{out / COMBINED})")
    if args.ablations and res.skipped:  # asked for by name and not built: the command did not do its job
        print(f"error: no report of {', '.join(res.skipped)}: the store {store} holds no runs of "
              f"{'them' if len(res.skipped) > 1 else 'it'}", file=sys.stderr)
        return 1
    return 1 if res.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
