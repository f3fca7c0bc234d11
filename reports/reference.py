"""The reference results' text forms (`python -m reports.build --reference`): reference.json, compact
and stable (sorted keys, floats to 4 significant digits; analysis.compare reads it), and
README.md, README.template.md's prose followed by a results section written from that summary.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from analysis import collapse_rule
from analysis.claims import on_worlds
from analysis.compare import provenance_values, summarize, world_entry_label
from analysis.stats import WORLD_DEPENDENT
from harness import provenance, statefile
from harness.summary import fmt

TEMPLATE = Path(__file__).with_name("README.template.md")
MARK = "<!-- results: written by reports.build --reference -->"

GENERATED = ("reports/*.pdf", "reports/*.png", "reports/*.csv", "reports/*.json", "reports/README.md")
"""What a reference build writes (git pathspecs; `*` spans folders: the figures, the sweep page's
tables, reference.json): a rebuild over a previous one rewrites them, so
they do not make the code count as uncommitted."""


def reference_summary(sections: list, collapse: dict, not_run: list[str]) -> dict[str, Any]:
    """Per figure `summarize`, the collapse rule scored on every run of the store
    (analysis.collapse_rule.score_store), the runs' provenance (each provenance tag: its one value,
    or the sorted distinct values), and the registry's figures the store has no runs of."""
    figures = {s.spec.name: summarize(s.data, s.claims) for s in sections if not s.spec.is_sweep}
    seen = provenance_values(s.data.runs for s in sections)
    return {"figures": figures, "collapse_rule": collapse, "built_at_commit": provenance.commit(ignore=GENERATED), "not_run": sorted(not_run),
            "provenance": {k: next(iter(v)) if len(v) == 1 else sorted(v) for k, v in sorted(seen.items())}}


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |"


def figure_text(name: str, f: dict) -> list[str]:
    """One figure: runs, inferred settings, the claims table, per variant collapses and best steps.
    Runs on several worlds: the worlds, and a claims column "worlds" beside the pooled test."""
    commits = ", ".join(f["run_commits"]) or "unknown"
    worlds = f.get("worlds") or []
    several = len(worlds) > 1
    out = [f"### {f['title']} (`{name}`)", "",
           f"{sum(v['n'] for v in f['variants'].values())} runs, code {commits}. "
           + (f"Worlds ({len(worlds)}): {', '.join(map(world_entry_label, worlds))}. " if several else "")
           + ("Inferred (not stated by the paper): " + "; ".join(f["inferred"]) if f["inferred"] else
              "No inferred settings."), ""]
    if f["claims"]:
        head = ["claim", "source", "verdict"] + (["worlds"] if several else []) + ["n", "statistic [CI]", "p",
                                                                                 "not detectable below"]
        out += [_row(head), _row(["---"] * len(head))]
        for c in f["claims"]:
            est = (f"{c['statistic']} {fmt(c.get('estimate'))} [{fmt(c.get('ci_low'))}, {fmt(c.get('ci_high'))}] "
                   f"({c['level']:.0%} CI)" if "level" in c and "estimate" in c else "–")
            verdict = f"**{c['verdict']}**" + (f": {c['reason']}" if c.get("reason") else "")
            out.append(_row([c["claim"], c["source"], verdict] + ([worlds_cell(c)] if several else [])
                            + [c.get("n", "–"), est, fmt(c.get("p_value")), fmt(c.get("min_detectable"))]))
        out.append("")
    out.append("Per variant (seeds, collapsed, step of the best held-out eval before collapse per seed): " + "; ".join(
        f"{v}: {d['n']}, {d['collapsed']}/{d['n']}" + (f", best at {', '.join(map(str, d['best_step']))}"
                                                       if d["best_step"] else "")
        for v, d in f["variants"].items()) + ".")
    return out + [""]


def worlds_cell(c: dict) -> str:
    """'reproduced on k of K worlds: each world's verdict', and the pooled test's verdict where the
    claim is world-dependent (the interval beside it is the pooled test's)."""
    per = c.get("world_verdicts") or []
    if not per:
        return "–"
    dependent = c["verdict"] == WORLD_DEPENDENT and "pooled_verdict" in c
    pooled = f"; pooled test: {c['pooled_verdict']}" if dependent else ""
    return f"{on_worlds(per)}: {', '.join(per)}{pooled}"


def collapse_text(c: dict) -> list[str]:
    rows = collapse_rule.table_rows(c)
    return (["### The collapse rule against the gold reward", "", _row(rows[0]), _row(["---"] * len(rows[0]))]
            + [_row(r) for r in rows[1:]]
            + ["", f"Better by these numbers: {c['better'] or 'neither (no runs, or a tie)'}; {collapse_rule.CHOICE}.", ""])


def readme(summary: dict) -> str:
    """README.template.md with the results section: per figure, the collapse rule, the provenance."""
    verdicts = [c["verdict"] for f in summary["figures"].values() for c in f["claims"]]
    counts = ", ".join(f"{verdicts.count(v)} {v}" for v in sorted(set(verdicts))) or "no claims"
    lines = ["## Results", "", f"Built at commit {summary['built_at_commit']} from the runs below; claims: {counts}.",
             ""]
    for name, f in summary["figures"].items():  # the sections' order: the paper's
        lines += figure_text(name, f)
    if summary["not_run"]:
        lines += [f"Not yet run for the reference (no results here): {', '.join(summary['not_run'])}.", ""]
    lines += collapse_text(summary["collapse_rule"]) + ["### Provenance of the runs", ""]
    lines += [f"- {k}: {', '.join(v) if isinstance(v, list) else v}" for k, v in summary["provenance"].items()]
    return TEMPLATE.read_text().replace(MARK, "\n".join(lines).rstrip() + "\n")


def write_reference(sections: list, collapse: dict, out: Path, not_run: list[str]) -> dict[str, Any]:
    """OUT/reference.json and OUT/README.md; returns the summary."""
    summary = reference_summary(sections, collapse, not_run)
    # atomically: analysis.compare reads reference.json back, and a half-written one would be no reference
    statefile.write_json(out / "reference.json", summary, indent=1, sort_keys=True, ensure_ascii=False)
    statefile.write_atomic(out / "README.md", readme(summary))
    return summary
