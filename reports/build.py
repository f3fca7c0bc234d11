"""PDF reports of finished ablations, from the MLflow store and the registry alone.

    python -m reports.build [ABLATION ...] [--tracking-uri URI] [--out results/] [--smooth K]
    python -m reports.build --reference     # rebuild the committed reports/ (on purpose only)

Writes OUT/<ablation>/report.pdf per ablation (with its figure.png/.pdf) and OUT/harness-report.pdf
with all of them, OUT = results/ (ignored by git); `--reference` writes the committed reports/ and
reports/provenance.json (commit, uncommitted changes, library versions, world hash). Each report:
a title page (date, git commit, machine), then per ablation the grid (what each variant changes),
the figure, final/peak metrics per variant (mean ± sd over seeds), its YAML's claims (the paper's,
or ours) with verdicts and numbers, and sample responses from each variant's last sampled step.
An ABLATION that is a sweep (YAML with `search_space`) gets a section from
analysis.sweep_plots.sweep_summary. No ABLATION: every registry entry
(and store-only experiment). An ablation without runs is skipped with a message, never drawn
empty, and the combined report is built only when every ablation in it has runs.

Fonts: DejaVu Sans from matplotlib's own data folder, so δ, η, λ print everywhere (the PDF base
fonts have no Greek) and no system font is needed.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import platform
import sys
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import pandas as pd
from reportlab import rl_config
from reportlab.lib import colors
from reportlab.lib.enums import TA_CENTER
from reportlab.lib.pagesizes import A4
from reportlab.lib.styles import ParagraphStyle
from reportlab.lib.units import cm
from reportlab.platypus import (
    CondPageBreak, Image, KeepTogether, PageBreak, Paragraph, SimpleDocTemplate, Spacer, Table, TableStyle,
)

from analysis.claims import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, check_claims
from analysis.figures import make_figures
from analysis.store import AblationData, ablations_in_store, default_tracking_uri, find_runs, load_ablation
from analysis.summary import final_peak_table
from harness import provenance, tracking
from harness.tracking import redact
from harness.registry import REPO_ROOT, Registry, RegistryError, UnknownAblation, ablation_names

# Images go into the PDF as binary streams: the ASCII85 text encoding (reportlab's default)
# runs in pure Python here and costs about a second per report for nothing a reader sees.
rl_config.useA85 = 0

PAGE = A4
MARGIN = 2 * cm
FRAME_W = PAGE[0] - 2 * MARGIN
FRAME_H = PAGE[1] - 2 * MARGIN
SAMPLES_PER_VARIANT = 2
MAX_RESPONSE_CHARS = 500
MAX_SWEEP_ROWS = 40
SWEEP_COLS_PER_TABLE = 7
COMBINED = "harness-report.pdf"
RESULTS = "results"  # what a user's build writes (ignored by git)
REFERENCE = REPO_ROOT / "reports"  # the committed reports, rebuilt only with --reference
VERDICT_COLORS = {
    REPRODUCED: colors.HexColor("#d9f2d9"),
    NOT_REPRODUCED: colors.HexColor("#f8d7d7"),
    INCONCLUSIVE: colors.HexColor("#fdf0c8"),
}


# --------------------------------------------------------------------------------------------
# Fonts and styles
# --------------------------------------------------------------------------------------------
def register_fonts() -> tuple[str, str, str]:
    """DejaVu Sans (regular, bold) and Sans Mono from matplotlib's data folder."""
    from matplotlib import get_data_path
    from reportlab.lib.fonts import addMapping
    from reportlab.pdfbase import pdfmetrics
    from reportlab.pdfbase.ttfonts import TTFont

    ttf = Path(get_data_path()) / "fonts" / "ttf"
    names = {"DejaVuSans": "DejaVuSans.ttf", "DejaVuSans-Bold": "DejaVuSans-Bold.ttf",
             "DejaVuSans-Oblique": "DejaVuSans-Oblique.ttf", "DejaVuSansMono": "DejaVuSansMono.ttf"}
    for name, file in names.items():
        if name not in pdfmetrics.getRegisteredFontNames():
            pdfmetrics.registerFont(TTFont(name, str(ttf / file)))
    addMapping("DejaVuSans", 0, 0, "DejaVuSans")
    addMapping("DejaVuSans", 1, 0, "DejaVuSans-Bold")
    addMapping("DejaVuSans", 0, 1, "DejaVuSans-Oblique")
    addMapping("DejaVuSans", 1, 1, "DejaVuSans-Bold")
    return "DejaVuSans", "DejaVuSans-Bold", "DejaVuSansMono"


def make_styles() -> dict[str, ParagraphStyle]:
    regular, bold, mono = register_fonts()
    base = ParagraphStyle("body", fontName=regular, fontSize=9, leading=12, splitLongWords=1)
    return {
        "body": base,
        "small": ParagraphStyle("small", parent=base, fontSize=7.5, leading=9.5),
        "cell": ParagraphStyle("cell", parent=base, fontSize=7.5, leading=9.3),
        "cellb": ParagraphStyle("cellb", parent=base, fontName=bold, fontSize=7.5, leading=9.3),
        "mono": ParagraphStyle("mono", parent=base, fontName=mono, fontSize=7, leading=8.8),
        "title": ParagraphStyle("title", parent=base, fontName=bold, fontSize=22, leading=28, alignment=TA_CENTER),
        "subtitle": ParagraphStyle("subtitle", parent=base, fontSize=11, leading=15, alignment=TA_CENTER),
        # keepWithNext: a heading never ends a page without what it heads.
        "h1": ParagraphStyle("h1", parent=base, fontName=bold, fontSize=14, leading=18, spaceBefore=4, spaceAfter=6,
                             keepWithNext=1),
        "h2": ParagraphStyle("h2", parent=base, fontName=bold, fontSize=11, leading=14, spaceBefore=10, spaceAfter=4,
                             keepWithNext=1),
        "h3": ParagraphStyle("h3", parent=base, fontName=bold, fontSize=9, leading=12, spaceBefore=6, spaceAfter=2,
                             keepWithNext=1),
        "note": ParagraphStyle("note", parent=base, fontSize=8, leading=10.5, textColor=colors.HexColor("#555555")),
    }


def P(text: Any, style: ParagraphStyle) -> Paragraph:
    """A paragraph of plain text (escaped: responses may hold < & >)."""
    return Paragraph(escape(str(text)).replace("\n", "<br/>"), style)


def table(rows: list[list[Any]], widths: list[float], st: dict[str, ParagraphStyle], *, header: bool = True,
          extra: list[tuple] | None = None) -> Table:
    """Wrapping table: every cell a Paragraph, widths as fractions of the frame, header repeats
    on each page."""
    cells = [[c if isinstance(c, Paragraph) else P(c, st["cellb" if header and i == 0 else "cell"]) for c in row]
             for i, row in enumerate(rows)]
    t = Table(cells, colWidths=[w * FRAME_W for w in widths], repeatRows=1 if header else 0, hAlign="LEFT")
    style = [
        ("VALIGN", (0, 0), (-1, -1), "TOP"),
        ("GRID", (0, 0), (-1, -1), 0.3, colors.HexColor("#bbbbbb")),
        ("LEFTPADDING", (0, 0), (-1, -1), 3), ("RIGHTPADDING", (0, 0), (-1, -1), 3),
        ("TOPPADDING", (0, 0), (-1, -1), 2), ("BOTTOMPADDING", (0, 0), (-1, -1), 2),
    ]
    if header:
        style.append(("BACKGROUND", (0, 0), (-1, 0), colors.HexColor("#e8e8e8")))
    t.setStyle(TableStyle(style + (extra or [])))
    return t


class FitImage(Image):
    """An image that shrinks (down to `min_scale` of its size) to fill what is left of the page
    rather than leave half a page blank; smaller than that it moves to the next page."""

    def __init__(self, path: str, width: float, height: float, min_scale: float = 0.8):
        super().__init__(path, width=width, height=height)
        self.full = (width, height)
        self.min_scale = min_scale

    def wrap(self, avail_w, avail_h):
        w, h = self.full
        scale = min(1.0, avail_w / w)
        if h * scale > avail_h >= h * self.min_scale:
            scale = avail_h / h
        self.drawWidth, self.drawHeight = w * scale, h * scale
        return self.drawWidth, self.drawHeight


def figure_image(path: Path, max_h: float = FRAME_H * 0.8) -> FitImage:
    """The PNG at frame width (or smaller, to fit `max_h`), aspect kept."""
    from reportlab.lib.utils import ImageReader

    w, h = ImageReader(str(path)).getSize()
    scale = min(FRAME_W / w, max_h / h)
    return FitImage(str(path), width=w * scale, height=h * scale)


def figure_block(heading: str, path: Path, st, max_h: float = FRAME_H * 0.85) -> list:
    """Heading + figure on one page. Not keepWithNext: reportlab measures a kept-together group
    at unlimited height, so the image could not shrink into the space left; a conditional page
    break does the same job."""
    img = figure_image(path, max_h)
    head = ParagraphStyle("figure-heading", parent=st["h2"], keepWithNext=0)
    return [CondPageBreak(img.full[1] * img.min_scale + 2 * head.leading + head.spaceBefore), P(heading, head), img,
            Spacer(1, 4)]


# --------------------------------------------------------------------------------------------
# Title page
# --------------------------------------------------------------------------------------------
def machine_info(tracking_uri: str) -> dict[str, str]:
    """What the title page records: when, which code, which machine and libraries, which store
    (harness.provenance, the same record every run carries as tags)."""
    cpu, v = provenance.cpu(), provenance.versions()
    return {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "git commit": provenance.commit(),
        "machine": f"{platform.platform()}; {cpu['model']}, {cpu['logical_cpus']} logical CPUs; flags {cpu['flags']}",
        "libraries": ", ".join(f"{k} {x}" for k, x in v.items()),
        "MLflow store": redact(tracking_uri),
    }


def title_page(info: dict[str, str], sections: list["Section"], st) -> list:
    out: list = [Spacer(1, 3 * cm), P("Secrets of RLHF: PPO ablation report", st["title"]), Spacer(1, 0.4 * cm),
                 P("Reproducing “Secrets of RLHF in LLMs Part I: PPO” and the APA paper with the harness",
                   st["subtitle"]), Spacer(1, 1.5 * cm)]
    out.append(table([[k, v] for k, v in info.items()], [0.22, 0.78], st, header=False))
    if sections:
        out += [Spacer(1, 0.8 * cm), P("Contents", st["h2"])]
        rows = [["ablation", "figure", "runs", "claims: reproduced / not / inconclusive"]]
        for s in sections:
            counts = s.claims["verdict"].value_counts() if not s.claims.empty else {}
            claim_text = (f"{counts.get(REPRODUCED, 0)} / {counts.get(NOT_REPRODUCED, 0)} / {counts.get(INCONCLUSIVE, 0)}"
                          if len(s.claims) else "–")
            rows.append([s.title, s.spec.figure or "–", str(s.n_runs), claim_text])
        out.append(table(rows, [0.55, 0.1, 0.08, 0.27], st))
    out.append(PageBreak())
    return out


# --------------------------------------------------------------------------------------------
# One ablation
# --------------------------------------------------------------------------------------------
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
    notes: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return self.spec.title

    @property
    def n_runs(self) -> int:
        return len(self.data.runs)

    def flowables(self, st) -> list:
        out: list = [P(self.title, st["h1"])]
        out += overview(self, st)
        for note in self.notes:
            out.append(P(note, st["note"]))
        if self.spec.is_sweep:
            out += sweep_flowables(self, st)
            return out + [PageBreak()]
        out += [P("Grid: what each variant changes", st["h2"])] + grid_flowables(self.spec, st)
        if self.figure_png is not None:
            out += figure_block("Figure", self.figure_png, st)
        if not self.metrics.empty:
            note = ("mean ± sd over seeds (sample sd; one seed: the value); final = mean of the last 10% of "
                    "logged steps, peak = largest logged value")
            if "collapsed" in self.metrics.columns:
                note += "; collapsed = seeds marked collapsed (mean collapse step)"
            out += [P("Final and peak metrics", st["h2"]), metrics_table(self.metrics, st), P(note + ".", st["note"])]
        out += [P("Claims", st["h2"])]
        out += [claims_table(self.claims, st), P("Source: the paper's section, or ours (our own extra check).",
                                                 st["note"])] if not self.claims.empty else [
            P(f"{self.spec.path or self.spec.name} states no claims.", st["note"])]
        if self.spec.kind != "world":  # reward-model runs sample no responses
            out += [P("Sample responses (last sampled step)", st["h2"])] + samples_flowables(self, st)
        return out + [PageBreak()]


def overview(sec: Section, st) -> list:
    spec = sec.spec
    rows = [["figure", spec.figure or "–"], ["kind", spec.kind]]
    if spec.description:
        rows.append(["description", spec.description])
    if spec.inferred:
        rows.append(["inferred (not stated by the paper)", "\n".join(spec.inferred)])
    if spec.base:
        rows.append(["base config", str(spec.base)])
    if spec.seeds:
        rows.append(["seeds (registry)", ", ".join(map(str, spec.seeds))])
    d, runs = sec.data, sec.data.runs
    status = ", ".join(f"{k} {v}" for k, v in runs["status"].value_counts().items()) or "none"
    rows.append(["runs in store", f"{len(runs)} ({status})"])
    elsewhere = sorted(set(runs["experiment"]) - {spec.name})
    if elsewhere:
        rows.append(["runs read from", f"experiment {', '.join(elsewhere)} (no runs in experiment {spec.name!r}: "
                                       "the world build's own runs stand in)"])
    commits = sorted({c for c in runs["git_commit"] if c})
    if commits:
        rows.append(["code of the runs", ", ".join(commits)])
    if d.parent_run_id:
        rows.append(["parent run", d.parent_run_id])
    if d.missing_variants:
        rows.append(["variants without runs", ", ".join(d.missing_variants)])
    if spec.path:
        rows.append(["registry file", str(spec.path)])
    return [table(rows, [0.2, 0.8], st, header=False)]


def grid_flowables(spec: Registry, st) -> list:
    """Variant | the settings where variants differ; settings all variants share listed below."""
    if not spec.variants:
        return [P("The registry lists no variants for this ablation (spec read from the runs' tags).", st["note"])]
    keys = sorted({k for v in spec.variants for k in v.settings})
    varying = [k for k in keys if len({repr(v.settings.get(k, "(base)")) for v in spec.variants}) > 1]
    shared = {**spec.shared, **{k: spec.variants[0].settings[k] for k in keys if k not in varying}}
    rows = [["variant (legend name)", "settings that differ between variants"]]
    for v in spec.variants:
        diff = [f"{k} = {v.settings[k]}" for k in varying if k in v.settings]
        rows.append([v.name, "\n".join(diff) or "(the base config)"])
    out: list = [table(rows, [0.38, 0.62], st)]
    if shared:
        out.append(P("Shared by all variants: " + "; ".join(f"{k} = {v}" for k, v in shared.items())
                     + (f" (on top of {spec.base})" if spec.base else ""), st["note"]))
    return out


def metrics_table(df: pd.DataFrame, st) -> Table:
    cols = list(df.columns)
    widths = [0.22] + [0.78 / (len(cols) - 1)] * (len(cols) - 1)
    return table([cols] + df.astype(str).values.tolist(), widths, st)


def claims_table(df: pd.DataFrame, st) -> Table:
    rows: list[list[Any]] = [["claim", "source", "rule", "numbers", "verdict"]]
    extra = []
    for i, r in enumerate(df.itertuples(), start=1):
        verdict = Paragraph(f"<b>{escape(r.verdict)}</b>" + (f"<br/>{escape(r.reason)}" if r.reason else ""), st["cell"])
        rows.append([r.claim, r.source, r.rule, r.numbers or "–", verdict])
        extra.append(("BACKGROUND", (4, i), (4, i), VERDICT_COLORS.get(r.verdict, colors.white)))
    return table(rows, [0.24, 0.08, 0.22, 0.29, 0.17], st, extra=extra)


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
            scores = " / ".join("–" if x is None or pd.isna(x) else f"{float(x):.3g}" for x in (r.rm_score, r.gold_score, r.length))
            rows.append([P(_clip(r.prompt, 200), st["mono"]), P(_clip(r.response), st["mono"]), scores])
        out.append(KeepTogether([P(head, st["h3"]), table(rows, [0.25, 0.57, 0.18], st)]))
    return out


def sweep_flowables(sec: Section, st) -> list:
    if sec.sweep is None:
        return []
    out: list = []
    best = sec.sweep.get("best") or {}
    if best:
        out += [P("Best trial", st["h2"]), table([[str(k), str(v)] for k, v in best.items()], [0.3, 0.7], st, header=False)]
    for fig in sec.sweep.get("figures") or []:
        if Path(fig).is_file():
            # The spacers keep the PNG's opaque white edge off the table rules around it.
            out += [Spacer(1, 4), figure_image(Path(fig), FRAME_H * 0.6), Spacer(1, 4)]
    trials = sec.sweep.get("table")
    if isinstance(trials, pd.DataFrame) and not trials.empty:
        shown = trials.head(MAX_SWEEP_ROWS)
        out.append(P(f"Trials ({len(shown)} of {len(trials)} shown)", st["h2"]))
        cols = [str(c) for c in shown.columns]
        # Wide trial tables are split into column groups, the first column repeated in each.
        groups = [cols[:1] + cols[1:][i:i + SWEEP_COLS_PER_TABLE - 1] for i in range(0, max(len(cols) - 1, 1), SWEEP_COLS_PER_TABLE - 1)]
        for g in groups:
            part = shown.copy()
            part.columns = cols
            rows = [g] + part[g].map(lambda x: f"{x:.4g}" if isinstance(x, float) else str(x)).values.tolist()
            out += [table(rows, [1 / len(g)] * len(g), st), Spacer(1, 0.3 * cm)]
    return out


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------
def load_sweep_summary(spec: Registry, tracking_uri: str, out_dir: Path) -> tuple[dict | None, str | None]:
    """(summary, None) from analysis.sweep_plots (imported here: it loads optuna), or (None, why not)."""
    try:
        return importlib.import_module("analysis.sweep_plots").sweep_summary(str(spec.path), tracking_uri,
                                                                              out_dir=out_dir), None
    except Exception as e:  # a broken sweep should not take the other sections down
        return None, f"analysis.sweep_plots.sweep_summary failed: {type(e).__name__}: {e}"


def has_runs(spec: Registry, tracking_uri: str) -> bool:
    """A train/world ablation: runs in its experiment (world: or the world build's); a sweep: its
    experiment exists (the sweep logs its parent run there)."""
    if spec.is_sweep:
        return tracking.client(tracking_uri).get_experiment_by_name(spec.name) is not None
    return not find_runs(tracking_uri, spec.name, world_fallback=spec.kind == "world").empty


def build_section(data: AblationData, out: Path, smooth_k: int = 1, log_figures: bool = True) -> Section:
    spec = data.spec
    sec = Section(spec=spec, data=data)
    if spec.is_sweep:
        sec.sweep, why = load_sweep_summary(spec, data.tracking_uri, out / spec.name)
        if why:
            sec.notes.append(why)
        return sec
    fig = make_figures(spec, data.tracking_uri, smooth_k, out, log_to_parent=log_figures, data=data)
    sec.figure_png = fig.paths[0]
    sec.metrics = final_peak_table(data)
    sec.samples = data.samples(SAMPLES_PER_VARIANT)
    sec.claims = check_claims(data)
    return sec


def _footer(label: str):
    def draw(canvas, doc):
        canvas.saveState()
        canvas.setFont("DejaVuSans", 7)
        canvas.setFillColor(colors.HexColor("#777777"))
        canvas.drawString(MARGIN, MARGIN / 2, label)
        canvas.drawRightString(PAGE[0] - MARGIN, MARGIN / 2, f"page {doc.page}")
        canvas.restoreState()
    return draw


def write_pdf(path: Path, sections: list[Section], info: dict[str, str], st, label: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = SimpleDocTemplate(str(path), pagesize=PAGE, leftMargin=MARGIN, rightMargin=MARGIN, topMargin=MARGIN,
                            bottomMargin=MARGIN, title=label, author="harness reports.build")
    story = title_page(info, sections, st)
    for s in sections:
        story += s.flowables(st)
    if isinstance(story[-1], PageBreak):
        story.pop()
    footer = _footer(f"{label} · commit {info['git commit']}")
    doc.build(story, onFirstPage=footer, onLaterPages=footer)
    return path


def _order(spec: Registry) -> tuple:
    """The YAML's `order` (the paper's); files without one (sweeps, store-only) last, by name."""
    return (spec.order is None, spec.order or 0, spec.name)


def reference_provenance(info: dict[str, str], sections: list[Section]) -> dict[str, Any]:
    """What a reference build records beside the reports: code, libraries, world, runs' commits."""
    from harness.config import DataConfig

    return {**info, "world": provenance.world(DataConfig().world_dir),
            "ablations": {s.spec.name: {"runs": s.n_runs, "run commits": sorted({c for c in s.data.runs["git_commit"] if c})}
                          for s in sections}}


@dataclass
class BuildResult:
    reports: dict[str, Path]
    combined: Path | None
    errors: dict[str, str]
    skipped: list[str] = field(default_factory=list)
    """Ablations left out because the store holds no runs of them."""


def build(ablations: list[str] | None, tracking_uri: str | None = None, out: str | Path = RESULTS, smooth_k: int = 1,
          ablations_dir: str | Path | None = None, log_figures: bool = True, reference: bool = False) -> BuildResult:
    """Per-ablation PDFs and, when every ablation asked for has runs (and more than one was asked
    for, or none: all of them), the combined one. An ablation without runs is skipped with a
    message; one that fails to build is reported (in `errors` and on stderr) and left out.
    reference=True also writes OUT/provenance.json."""
    uri = tracking_uri or default_tracking_uri()
    out = Path(out)
    st = make_styles()
    names = list(ablations) if ablations else ablation_names(ablations_dir) + [
        n for n in ablations_in_store(uri) if n not in ablation_names(ablations_dir)]
    info = machine_info(uri)
    sections, errors, skipped = [], {}, []
    for name in names:
        try:
            data = load_ablation(name, uri, ablations_dir)
            if not has_runs(data.spec, uri):
                skipped.append(data.name)
                how = f"harness.sweep {data.spec.path}" if data.spec.is_sweep else f"harness.ablate {data.name}"
                print(f"skipped {data.name}: no runs in {redact(uri)} (run `python -m {how}` first)", file=sys.stderr)
                continue
            sections.append(build_section(data, out, smooth_k, log_figures))
        except (UnknownAblation, RegistryError):
            raise
        except Exception as e:  # keep the other ablations' reports
            errors[str(name)] = f"{type(e).__name__}: {e}"
            print(f"error: {name}: {errors[str(name)]}", file=sys.stderr)
    sections.sort(key=lambda s: _order(s.spec))
    reports = {}
    for s in sections:
        reports[s.spec.name] = write_pdf(out / s.spec.name / "report.pdf", [s], info, st, f"harness report · {s.spec.name}")
    combined = None
    # one named ablation must not replace the combined report of everything with itself alone,
    # nor may a partial store
    if sections and not skipped and not errors and (not ablations or len(sections) > 1):
        combined = write_pdf(out / COMBINED, sections, info, st, "harness report")
    if reference:
        (out / "provenance.json").write_text(json.dumps(reference_provenance(info, sections), indent=1, ensure_ascii=False) + "\n")
    return BuildResult(reports, combined, errors, skipped)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m reports.build",
        description="Build PDF reports from the MLflow store: OUT/<ablation>/report.pdf per ablation and "
                    f"OUT/{COMBINED} with all (title page, grid, figure, final/peak metrics, claims with "
                    "verdicts, sample responses; sweep sections for sweep YAMLs).",
    )
    ap.add_argument("ablations", nargs="*", metavar="ABLATION",
                    help="registry names or YAML paths (default: every ablation in the registry and the store)")
    ap.add_argument("--tracking-uri", default=None, help="MLflow store (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    ap.add_argument("--out", default=None, help=f"output root (default {RESULTS}/; with --reference the committed reports/)")
    ap.add_argument("--reference", action="store_true",
                    help="rebuild the committed reference reports in reports/ and record reports/provenance.json")
    ap.add_argument("--smooth", type=int, default=1, metavar="K", help="rolling mean over K logged steps in figures (default 1 = raw)")
    ap.add_argument("--ablations-dir", default=None, help="registry folder (default: the repo's ablations/)")
    ap.add_argument("--no-log", action="store_true", help="do not log figures to the ablations' parent runs")
    args = ap.parse_args(argv)
    out = Path(args.out or (REFERENCE if args.reference else RESULTS))
    try:
        res = build(args.ablations, args.tracking_uri, out, args.smooth, args.ablations_dir, not args.no_log, args.reference)
    except (UnknownAblation, RegistryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, path in res.reports.items():
        print(f"{name}: {path}")
    if res.combined:
        print(f"combined: {res.combined}")
    elif res.skipped or res.errors:
        print(f"combined report not built: no runs of {', '.join(res.skipped) or '-'}"
              + (f"; failed: {', '.join(res.errors)}" if res.errors else ""))
    elif res.reports:
        print(f"combined report left as it was (one ablation named; name none, or several, to rebuild {out / COMBINED})")
    else:
        print("nothing to report")
    return 1 if res.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
