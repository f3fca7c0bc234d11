"""The reference results' text forms (`python -m reports.build --reference`): reference.json, compact
and stable (sorted keys, floats to 4 significant digits; analysis.compare reads it), and
README.md, README.template.md's prose followed by a results section written from that summary.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis import detector
from analysis.claims import check_claims, on_worlds
from analysis.compare import claim_entry, from_summary, provenance_values, summarize, world_entry_label
from analysis.stats import WORLD_DEPENDENT
from analysis.store import one_or_sorted
from harness import provenance, statefile
from harness.rules import RULES
from harness.schema import ConfigError
from harness.summary import fmt

TEMPLATE = Path(__file__).with_name("README.template.md")
MARK = "<!-- results: written by reports.build --reference -->"

GENERATED = ("reports/*.pdf", "reports/*.png", "reports/*.csv", "reports/*.json", "reports/README.md")
"""What a reference build writes (git pathspecs; `*` spans folders: the figures, the sweep page's
tables, reference.json): a rebuild over a previous one rewrites them, so
they do not make the code count as uncommitted."""


def reference_summary(sections: list, not_run: list[str], detector_eval: dict | None = None,
                      tricks: dict[str, dict] | None = None) -> dict[str, Any]:
    """Per figure `summarize`, the runs' provenance (each provenance tag: its one value, or the sorted
    distinct values), the registry's figures the store has no runs of, the early-warning
    detector's evaluation (the reference folder's detector/evaluation.json, written by `python -m
    analysis.detector evaluate --out reports/detector` on the detector campaign's store) and each
    design study's analysis (its folder's tricks.json: analysis.tricks, "which tricks matter")."""
    figures = {s.spec.name: summarize(s.data, s.claims) for s in sections if not s.spec.is_sweep}
    # reference.json's keys are sorted: the paper's order (the sections') and each file's order of its
    # variants are kept as lists of their own
    for f in figures.values():
        f["variant_order"] = list(f["variants"])
    seen = provenance_values(s.data.runs for s in sections)
    return {"figures": figures, "order": list(figures), "built_at_commit": provenance.commit(ignore=GENERATED),
            "not_run": sorted(not_run),
            "provenance": one_or_sorted(seen),
            **({"detector": detector_eval} if detector_eval else {}), **({"tricks": tricks} if tricks else {})}


TRICKS_CLAIM_FIELDS = ("figure_file", "figure", "claim", "source", "one_factor", "says", "reason")
TRICKS_INTERACTIONS = 8  # the strongest pairs kept in the summary (tricks.json beside it has all)


def tricks_summaries(out: Path) -> dict[str, dict]:
    """Each design study's summary in the reference folder, from OUT/<study>/tricks.json (analysis.tricks):
    every table but the interactions (the strongest only) and, per claim, its verdicts without the test text."""
    found = {}
    for p in sorted(Path(out).glob("*/tricks.json")):
        t = json.loads(p.read_text())
        t["interactions"] = (t.get("interactions") or [])[:TRICKS_INTERACTIONS]
        t["claims"] = [{k: c[k] for k in TRICKS_CLAIM_FIELDS if k in c} for c in t.get("claims") or []]
        found[p.parent.name] = t
    return found


def merged(old: dict[str, Any], new: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The committed summary `old` with the figures and design studies `names` of `new` (a build of those
    alone, from the store they were run into) put in, the others kept: provenance values joined, `merged`
    naming the commit each came from, the orders made again."""
    res = {**old, "figures": {**old["figures"], **{k: v for k, v in new["figures"].items() if k in names}}}
    if new.get("detector"):  # the later detectors' and campaigns' evaluations: take_evaluations, after the merge
        res["detector"] = new["detector"]
    if new.get("tricks"):  # the studies of the folder the build wrote into, beside those the summary held
        res["tricks"] = {**(old.get("tricks") or {}), **new["tricks"]}
    res["not_run"] = sorted(set(old.get("not_run") or []) - set(names))
    prov: dict[str, set[str]] = {}
    for side in (old, new):
        for k, v in (side.get("provenance") or {}).items():
            prov.setdefault(k, set()).update(v if isinstance(v, list) else [v])
    res["provenance"] = one_or_sorted(prov)
    res["merged"] = {**(old.get("merged") or {}), **{n: new["built_at_commit"] for n in names}}
    res.pop("order", None)
    keep_order(res)
    return res


def redecide(summary: dict[str, Any], kind: str, ablations_dir: str | Path | None = None) -> list[tuple[str, str, str, str]]:
    """Re-decide, in `summary`, every claim whose rule is of `kind` (harness.rules.RULES) from the per-run
    numbers the summary keeps (analysis.compare.from_summary: the same claims code as a store), with the
    figure files' claims as they stand now: for a rule whose test changed while the runs did not. Records
    `redecided`: per kind, the figures, the commit, where the numbers came from. Returns (figure, claim,
    verdict before, verdict now) per claim re-decided."""
    from harness.registry import find_ablation, load_registry

    done, figures = [], []
    for name, f in summary["figures"].items():
        try:
            spec = load_registry(find_ablation(name, ablations_dir), resolve=False)
        except (ConfigError, LookupError):  # LookupError: harness.registry.UnknownAblation
            continue
        claims = [c for c in spec.claims if isinstance(c.rule, RULES[kind])]
        if not claims:
            continue
        figures.append(name)
        for row in check_claims(from_summary(spec, f), claims).to_dict("records"):
            new = claim_entry(row)
            at = next((i for i, c in enumerate(f["claims"]) if c["claim"] == new["claim"]), None)
            done.append((name, new["claim"], "–" if at is None else f["claims"][at]["verdict"], new["verdict"]))
            if at is None:
                f["claims"].append(new)
            else:
                f["claims"][at] = new
    summary.setdefault("redecided", {})[kind] = {
        "at_commit": provenance.commit(ignore=GENERATED), "figures": figures,
        "from": "the per-run numbers of this summary (4 significant digits), not the runs' store"}
    return done


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
            margin = f"; margin ±{fmt(c['margin'])}" if "margin" in c else ""
            est = (f"{c['statistic']} {fmt(c.get('estimate'))} [{fmt(c.get('ci_low'))}, {fmt(c.get('ci_high'))}] "
                   f"({c['level']:.0%} CI{margin})" if "level" in c and "estimate" in c else "–")
            verdict = f"**{c['verdict']}**" + (f": {c['reason']}" if c.get("reason") else "")
            out.append(_row([c["claim"], c["source"], verdict] + ([worlds_cell(c)] if several else [])
                            + [c.get("n", "–"), est, fmt(c.get("p_value")), fmt(c.get("min_detectable"))]))
        out.append("")
    out.append("Per variant (seeds, collapsed, step of the best held-out eval before collapse per seed): " + "; ".join(
        f"{v}: {d['n']}, {d['collapsed']}/{d['n']}" + (f", best at {', '.join(map(str, d['best_step']))}"
                                                       if d["best_step"] else "")
        for v, d in ((v, f["variants"][v]) for v in f.get("variant_order") or f["variants"])) + ".")
    return out + [""]


def tricks_text(name: str, t: dict) -> list[str]:
    """A design study: its size and throughput, the table "which tricks matter", the agreement between
    worlds, the one-factor claims against it and the best configuration (the PDF has every table)."""
    import pandas as pd

    from analysis.tricks import headline

    thr = t.get("throughput") or {}
    prov = t.get("provenance") or {}
    out = [f"### {t.get('title') or name} (`{name}`)", "",
           f"{t['configs']} configurations, {t['runs']} runs on worlds {', '.join(map(str, t['worlds'])) or '–'}, code "
           f"{prov.get('commit', 'unknown')}; a configuration's score is the mean of {t['score']} over its runs; "
           f"importance: {t['evaluator']} above chance, Bonferroni bootstrap interval over the choices (a choice "
           "matters when it lies above 0)"
           + (f"; {thr['runs']} runs in {thr['hours']:.2f} h ({thr['runs_per_hour']:.0f} runs/h)"
              if isinstance(thr.get("runs_per_hour"), (int, float)) else "") + f" (`reports/{name}/report.pdf`).", ""]
    out += [*(f"- {n}" for n in t.get("notes") or []), *([""] if t.get("notes") else [])]
    out += headline({"importances": pd.DataFrame(t["importances"]), "values": pd.DataFrame(t["values"]),
                     "maximize": t.get("maximize", True)}, rows=len(t["importances"])) + [""]
    for w in t.get("worlds_agreement") or []:
        out += [f"Worlds {w['world_a']} and {w['world_b']}: Spearman ρ of the per-value 95th percentiles "
                   f"{fmt(w['rho'])} [{fmt(w['ci_low'])}, {fmt(w['ci_high'])}] over {w['values']} values "
                   f"({w['configs']} configurations), of the importances {fmt(w['importance_rho'])}.", ""]
    claims = t.get("claims") or []
    if claims:
        says = [c["says"] for c in claims]
        out += ["The one-factor claims against the design: " + ", ".join(
            f"{says.count(k)} {k}" for k in ("agrees", "contradicts", "cannot say")) + f" (of {len(claims)}"
            + ("; contradicts: " + "; ".join(f"{c['figure_file']}: {c['claim']}" for c in claims
                                           if c["says"] == "contradicts") if "contradicts" in says else "") + ").", ""]
    if prov:
        worlds = prov.get("world.hash")
        accs = prov.get("world.rm/eval_acc")
        out += [f"Runs' provenance: {prov.get('cpu.model', '?')}, torch {prov.get('version.torch', '?')}; worlds "
                + ", ".join(w[:8] for w in (worlds if isinstance(worlds, list) else [worlds or "?"]))
                + f" (RM held-out accuracy {', '.join(accs) if isinstance(accs, list) else accs or '?'}).", ""]
    best = t.get("best") or {}
    if best:
        out += [f"Best configuration (trial {best['number']}, score {fmt(best['score'])}, selected on these runs; "
                   "its rerun elsewhere: `analysis.tricks best`): "
                   + ", ".join(f"{k}={v}" for k, v in best["values"].items()) + ".", ""]
    return out


def worlds_cell(c: dict) -> str:
    """'reproduced on k of K worlds: each world's verdict', and the pooled test's verdict where the
    claim is world-dependent (the interval beside it is the pooled test's)."""
    per = c.get("world_verdicts") or []
    if not per:
        return "–"
    dependent = c["verdict"] == WORLD_DEPENDENT and "pooled_verdict" in c
    pooled = f"; pooled test: {c['pooled_verdict']}" if dependent else ""
    return f"{on_worlds(per)}: {', '.join(per)}{pooled}"


LATER_DETECTORS = {"detector_audit": ("audit", Path("detector") / "audit"),
                   "detector_retired": ("retired", Path("detector") / "retired"),
                   "detector_retired_audit": ("retired_audit", Path("detector") / "retired" / "audit")}
"""Summary key -> (kind, folder under reports/) of the committed evaluations beside the default detector's
(detector/evaluation.json), each rendered where its folder's evaluation.json exists: the default of runs with
audit reward models (detector/audit/), then the first committed pair, retired when campaign 10's detector became
the default (detector/retired/: its held-out evaluation and its files; retired/audit/: the audit RMs' one, with
its families' ablation). The campaigns' evaluations are CAMPAIGNS'."""


def later_detectors(out: Path) -> dict[str, dict]:
    """Summary key -> evaluation of each LATER_DETECTORS folder under `out` that holds an evaluation.json."""
    found = {key: detector.load_summary(out / folder / "evaluation.json") for key, (_, folder) in LATER_DETECTORS.items()}
    return {key: ev for key, ev in found.items() if ev is not None}


@dataclass(frozen=True)
class Campaign:
    """A detector campaign's section of reports/README.md: its folder under reports/ holds its runs file
    (`runs.npz`) and, in a folder each, every detector's evaluation on those runs (`python -m analysis.detector
    evaluate --runs FOLDER/runs.npz --params FILE --out FOLDER/NAME`, or `families ... --out FOLDER/NAME`)."""

    folder: Path
    """Under reports/: detector/campaignN."""
    title: str
    """'campaign N', as bench/RESULTS.md names it."""
    note: str
    """What the runs are beside the detectors and when each detector was fixed (the table cannot say)."""


DECLARED = ("No detector here was fit on this world; the detectors fit on earlier campaigns were committed, with "
            "the rule for adopting them, before these runs were scored (bench/RESULTS.md).")
LONG = "Fig. 6 ran 480 steps and every other file 800, so a run called held held that long."
"""The budgets of campaigns 8 on (bench/detector_campaign.sh's defaults)."""
ABLATED = ("`families/` is `fit/`'s signal families ablated on the same runs after they were scored (its chosen "
           "detector is `fit/`'s), with the table below.")
CAMPAIGNS = {
    "detector_campaign": Campaign(
        Path("detector") / "campaign", "campaign 1",
        "Trained after the committed detectors were fit: on their fit world (figure files they were not fit on, "
        "the critic-free estimators among them) and on a bigger world (4 layers, 192 wide). `refit/` was fit on "
        "part of these runs after they were trained (its signal families chosen there) and is scored on the rest "
        "(its runs column)."),
    "detector_campaign2": Campaign(
        Path("detector") / "campaign2", "campaign 2",
        "No detector here was fit on this world; `refit/` was fit on every run of campaign 1 before these runs "
        "were trained."),
    "detector_campaign3": Campaign(Path("detector") / "campaign3", "campaign 3", f"{DECLARED} {ABLATED}"),
    "detector_campaign4": Campaign(Path("detector") / "campaign4", "campaign 4", DECLARED),
    "detector_campaign5": Campaign(Path("detector") / "campaign5", "campaign 5", DECLARED),
    "detector_campaign6": Campaign(Path("detector") / "campaign6", "campaign 6", f"{DECLARED} {ABLATED}"),
    "detector_campaign7": Campaign(
        Path("detector") / "campaign7", "campaign 7",
        f"{DECLARED} Every file but Fig. 6 ran 800 steps, so a run of theirs called held held for 800. Fig. 6 ran "
        "240; its configurations with a run called held were rerun to 480 steps after scoring "
        "(`reports/detector/budget480/`): two of its four false alarms fell later (steps 226 and 418), so `fit/` "
        "warned on 3 of the 21 runs that held that long."),
    "detector_campaign8": Campaign(
        Path("detector") / "campaign8", "campaign 8",
        f"{DECLARED} {LONG} `fit/` was fit on every run of campaigns 1-7; `campaign7_fit/` is campaign 7's declared "
        "detector (campaigns 1-6)."),
    "detector_campaign9": Campaign(
        Path("detector") / "campaign9", "campaign 9",
        f"{DECLARED} {LONG} No detector was fit for it: `campaign8_fit/` (declared) and `campaign8_fit_no_audit/` "
        "are campaign 8's, fit on campaigns 1-7."),
    "detector_campaign10": Campaign(
        Path("detector") / "campaign10", "campaign 10",
        f"{DECLARED} {LONG} `fit/` (declared) was fit on every run of campaigns 1-9; having met every target here, its "
        "files are now the defaults (`harness/`). `campaign8_fit/` is campaign 8's declared detector (campaigns 1-7), "
        "scored unchanged on its third new world; `audit/` and `no_audit/` are the first committed pair, then the "
        "defaults."),
    "detector_campaigns8_10": Campaign(
        Path("detector") / "campaigns8-10", "campaigns 8-10 pooled",
        "Campaigns 8, 9 and 10's runs scored together (each folder's evaluation.json also has a row per world): "
        "campaign 8's declared detector and its no-audit sibling, fit on campaigns 1-7, on three worlds whose runs came "
        "after they were committed."),
    "detector_campaign11": Campaign(
        Path("detector") / "campaign11", "campaign 11",
        f"{DECLARED} {LONG} `campaign10_fit/` and `campaign10_fit_no_audit/` are the defaults (`harness/`: campaign 10's "
        "declared detector, fit on campaigns 1-9), scored unchanged as declared; `retired_audit/` and `retired_no_audit/` "
        "the first committed pair; `campaign8_fit/` campaign 8's declared detector (campaigns 1-7)."),
}
"""Summary key -> each committed campaign, scored as one table (`campaign_text`)."""


def take_evaluations(summary: dict[str, Any], out: Path) -> None:
    """Put the committed evaluations under `out` (LATER_DETECTORS', CAMPAIGNS') into `summary`, dropping the
    keys of a layout no longer written (an older summary's per-detector campaign keys)."""
    for k in [k for k in summary if k.startswith("detector_") and k not in {*LATER_DETECTORS, *CAMPAIGNS}]:
        del summary[k]
    summary |= later_detectors(out) | campaign_evaluations(out)


def campaign_evaluations(out: Path) -> dict[str, dict[str, dict]]:
    """Summary key -> {detector folder name: evaluation} of each CAMPAIGNS folder under `out` with any, each
    evaluation kept to what `campaign_text` prints (its folder's evaluation.json has the curve and the rest)."""
    def kept(ev: dict) -> dict:
        det, prov = ev.get("detector", {}), ev.get("detector", {}).get("provenance", {})
        return {"line": ev["line"], "groups": ev["groups"], "baselines": ev.get("baselines", {}),
                **({"families": ev["families"]} if ev.get("families") else {}),
                "store": {k: ev.get("store", {}).get(k) for k in ("uri", "runs", "provenance")},
                "detector": {"file": det.get("file"), "threshold": det.get("threshold"), "provenance": {
                    "fit_runs": prov.get("fit_runs"), "split": prov.get("split", {}),
                    "selection": (prov.get("selection") or [{}])[:1]}}}
    found = {key: {p.parent.name: kept(detector.load_summary(p)) for p in sorted((out / c.folder).glob("*/evaluation.json"))}
             for key, c in CAMPAIGNS.items()}
    return {key: evs for key, evs in found.items() if evs}


def _nums(s: dict | None) -> str:
    """'recall / false alarms / median lead' of a group, without intervals (the narrower columns)."""
    if not s:
        return "–"
    return f"{fmt(s['recall'], 2)} / {fmt(s['fa_rate'], 2)} / {detector.fmt_steps(s['lead_median'])}"


def _runs_files(ev: dict) -> str:
    """The runs files an evaluation read (its store, as analysis.detector writes it: 'FILE (exported from ...) +
    FILE (exported from ...)'), comma-separated."""
    return ",".join(part.split(" (exported from")[0] for part in (ev.get("store", {}).get("uri") or "?").split(" + "))


def campaign_text(evs: dict[str, dict] | None, c: Campaign) -> list[str]:
    """One campaign's detectors on the same held-out runs: a row each (held out with intervals, with a critic,
    critic-free, the KL-threshold baseline fit on that detector's fit runs), then each one's line and command,
    then the signal families' table of each folder that ablated them."""
    if not evs:
        return []
    folder = f"reports/{c.folder.as_posix()}/"
    # the campaign's own runs: an `evaluate` folder's store is its runs file alone (a `families` one pools the fit runs)
    first = next((ev for ev in evs.values() if not ev.get("families")), next(iter(evs.values())))
    n, seen = first.get("store", {}).get("runs", "?"), first.get("store", {}).get("provenance", {})
    lines = [f"### The early warning on {c.title}: every detector on the same held-out runs", "",
             f"{n} runs of world {', '.join(w[:8] for w in seen.get('world.hash', []))}. {c.note} Recall, false alarms "
             "and median lead (steps; 95% CIs), then without intervals.", "",
             _row(["detector", "fit on", "runs", "recall", "false alarms", "median lead", "with a critic",
                   "critic-free", "KL threshold fit on the same runs"]), _row(["---"] * 9)]
    for name, ev in evs.items():
        det, g = ev.get("detector", {}), ev["groups"]
        prov = det.get("provenance", {})
        folds = (prov.get("selection") or [{}])[0].get("folds", "?")
        s = g["held-out (all)"]
        kl = ev.get("baselines", {}).get("KL above a threshold", {})
        lines.append(_row([f"`{name}/` ({det.get('file', '?')})", f"{prov.get('fit_runs', '?')} runs, world "
                           f"{_fit_worlds(prov, ', ')}; {folds}", f"{s['runs']} ({s['fell']} fell)",
                           detector.iv(s["recall"], s["recall_ci"]), detector.iv(s["fa_rate"], s["fa_ci"]),
                           detector.iv(s["lead_median"], s["lead_ci"], detector.fmt_steps),
                           _nums(g.get("held-out, with a critic")), _nums(g.get("held-out, critic-free")),
                           (f"{kl['threshold']:g} nats: " if kl.get("threshold") is not None else "")
                           + _nums(kl.get("held-out (all)"))]))
    lines.append("")
    for name, ev in evs.items():
        lines.append(f"- `{name}/`: `{ev['line']}` (`{command(ev, f'{folder}{name}/')}`)")
    lines.append("")
    for name, ev in evs.items():
        if ev.get("families"):
            head, *table = families_text(ev["families"], f"{folder}{name}/")
            lines += [f"`{name}/`: {head}", *table]
    return lines


def command(ev: dict, folder: str) -> str:
    """The command that writes an evaluation folder again from the runs files it read (`families` for a folder that
    ablated the signal families, else `evaluate`); one whose store was not a runs file is printed from its summary."""
    det, prov = ev.get("detector", {}), ev.get("detector", {}).get("provenance", {})
    if not _runs_files(ev).endswith(".npz"):
        return f"python -m analysis.detector evaluate --summary {folder}evaluation.json"
    if ev.get("families"):
        return (f"python -m analysis.detector families --runs {_runs_files(ev)} {_split_flags(prov)} --out {folder} "
                f"--save {det.get('file', '?')}")
    return f"python -m analysis.detector evaluate --runs {_runs_files(ev)} --params {det.get('file', '?')} --out {folder}"


def _fit_worlds(prov: dict, sep: str) -> str:
    """The fit world(s) of a detector's provenance, 8 characters each (what the tables print)."""
    world = prov.get("split", {}).get("world", "?")
    return sep.join(w[:8] for w in world) if isinstance(world, list) else str(world)[:8]


def fit_worlds_text(prov: dict) -> str:
    """'N worlds (a, b, ...)' or 'world a': where a detector was fit, as the README's sections and the combined report's
    page say it."""
    several = isinstance(prov.get("split", {}).get("world"), list)
    return (f"{len(prov['split']['world'])} worlds ({_fit_worlds(prov, ', ')})" if several
            else f"world {_fit_worlds(prov, ', ')}")


def _split_flags(prov: dict) -> str:
    split = prov.get("split", {})
    return (f"--fit-world {_fit_worlds(prov, ',')} --fit-files {','.join(split.get('files', []))} "
            f"--fit-seeds {','.join(map(str, split.get('seeds') or []))}")


DETECTOR_HEADS = {
    "base": ("The early warning against the gold truth (the default: `harness/detector_params_no_audit.json`)",
             "The detector a run without audit reward models uses (`collapse.detector: default`; the one `make run` "
             "logs), fit on campaigns 1-9 as declared before campaign 10 (`reports/detector/campaign10/fit/`) and "
             "scored here on the runs of every campaign since, on worlds it never saw"),
    "audit": ("The early warning with audit reward models (the default: `harness/detector_params.json`)",
              "The detector a run uses when it scores its samples with audit reward models "
              "(`model.audit_reward_paths`; on the world: `python -m harness.world build --audit-rms 3`), fit with "
              "the default above on the same runs and scored on the same held-out ones"),
    "retired": ("The first committed detector, retired (`reports/detector/retired/detector_params_no_audit.json`)",
                "The default of runs without audit reward models until campaign 10's detector met every target on "
                "runs it was not fit on and replaced it (the rule declared before campaign 10: bench/RESULTS.md, "
                "sessions 29 and 30); the reference reports' warned and lead columns come from it (their runs logged "
                "it)"),
    "retired_audit": ("The first audit RMs' detector, retired (`reports/detector/retired/detector_params.json`)",
                      "The default of runs with audit reward models until campaign 10's; its signal families' "
                      "ablation on its first held-out runs"),
}
"""kind -> (the section's title, what the detector is) of each detector section in reports/README.md."""


def detector_text(ev: dict | None, kind: str = "base", where: Path = Path("detector")) -> list[str]:
    """kind: base (the default detector, detector/) or a LATER_DETECTORS kind, `where` its folder."""
    if not ev:
        return []
    rows = detector.table_rows(ev)
    prov = ev.get("detector", {}).get("provenance", {})
    folder = f"reports/{where.as_posix()}/"
    title, what = DETECTOR_HEADS[kind]
    how = ("python -m analysis.detector evaluate --summary reports/reference.json" if kind == "base"
           else command(ev, folder))
    head = [f"### {title}", "", f"{what}: `{ev['line']}` (`{how}`). Fit on {prov.get('fit_runs', '?')} runs "
            f"({prov.get('fit_fell', '?')} whose gold fell) of {', '.join(prov.get('split', {}).get('files', []))} at "
            f"seeds {prov.get('split', {}).get('seeds')} on {fit_worlds_text(prov)}; every row but \"fit\" is scored on runs it was "
            f"not fit on (`{folder}`: the operating curve and lead times, `detector.png`)."]
    return (head + ["",
             _row(rows[0]), _row(["---"] * len(rows[0]))] + [_row(r) for r in rows[1:]] + [""]
            + families_text(ev.get("families"), folder))


def families_text(fam: dict | None, folder: str = "reports/detector/") -> list[str]:
    """The signal families ablated (`python -m analysis.detector families`): one detector per family set."""
    if not fam:
        return []
    rows = fam["rows"]
    return (["What each signal family adds, out of sample: a detector per family set, lead, patience and "
             "threshold chosen on the fit runs alone (cross-validated there), scored on the same held-out runs "
             f"(`{folder}families.png`: lead against false alarms). Chosen on the fit runs: {fam['chosen']}; "
             f"for runs without audit reward models: {fam.get('chosen_no_audit') or '-'}.", "",
             _row(rows[0]), _row(["---"] * len(rows[0]))] + [_row(r) for r in rows[1:]] + [""])


def readme(summary: dict) -> str:
    """README.template.md with the results section: per figure, the early warning, the provenance."""
    verdicts = [c["verdict"] for f in summary["figures"].values() for c in f["claims"]]
    counts = ", ".join(f"{verdicts.count(v)} {v}" for v in sorted(set(verdicts))) or "no claims"
    lines = ["## Results", "", f"Built at commit {summary['built_at_commit']} from the runs below; claims: {counts}.",
             ""]
    for name in summary.get("order") or summary["figures"]:  # the sections' order: the paper's
        lines += figure_text(name, summary["figures"][name])
    for name, t in sorted((summary.get("tricks") or {}).items()):
        lines += tricks_text(name, t)
    for kind, r in sorted((summary.get("redecided") or {}).items()):
        lines += [f"The `{kind}` claims of {', '.join(r['figures'])} were decided again at commit {r['at_commit']} from "
                  f"{r['from']} (`python -m reports.reference --redecide {kind}`): their rule changed, the runs did not.",
                  ""]
    if summary.get("merged"):
        lines += ["Put in after that build, from the stores they were run into (`python -m reports.build NAME "
                  "--reference --merge`): " + ", ".join(f"{n} (built at {c})" for n, c in sorted(summary["merged"].items()))
                  + ".", ""]
    if summary["not_run"]:
        lines += [f"Not yet run for the reference (no results here): {', '.join(summary['not_run'])}.", ""]
    lines += detector_text(summary.get("detector"))
    for key, (kind, where) in LATER_DETECTORS.items():
        lines += detector_text(summary.get(key), kind, where)
    for key, c in CAMPAIGNS.items():
        lines += campaign_text(summary.get(key), c)
    lines += ["### Provenance of the runs", ""]
    lines += [f"- {k}: {', '.join(v) if isinstance(v, list) else v}" for k, v in summary["provenance"].items()]
    return TEMPLATE.read_text().replace(MARK, "\n".join(lines).rstrip() + "\n")


def keep_order(summary: dict[str, Any]) -> None:
    """For a summary written before it kept its orders: the figures in the combined report's order (each
    file's `order:`, then by name) and each figure's variants in its file's order, read from the figure
    files; a figure whose file is gone goes last, its variants by name."""
    from harness.registry import find_ablation, load_registry

    files = {}
    for name in summary["figures"]:
        try:
            files[name] = load_registry(find_ablation(name), resolve=False)
        except (ConfigError, LookupError):  # LookupError: harness.registry.UnknownAblation
            pass

    def key(name: str) -> tuple[bool, int, str]:
        order = files[name].order if name in files else None
        return order is None, order or 0, name
    summary.setdefault("order", sorted(summary["figures"], key=key))
    for name, f in summary["figures"].items():
        listed = [v.name for v in files[name].variants] if name in files else []
        f.setdefault("variant_order", [v for v in listed if v in f["variants"]]
                     + sorted(set(f["variants"]) - set(listed)))


def write_reference(sections: list, out: Path, not_run: list[str], merge: bool = False) -> dict[str, Any]:
    """OUT/reference.json and OUT/README.md; returns the summary. merge: the sections' figures and studies
    put into the committed summary, the others kept (`merged`)."""
    summary = reference_summary(sections, not_run, detector.load_summary(out / "detector" / "evaluation.json"),
                                tricks_summaries(out))
    if merge and (out / "reference.json").is_file():
        summary = merged(json.loads((out / "reference.json").read_text()), summary, [s.spec.name for s in sections])
    take_evaluations(summary, out)  # the folder's committed evaluations, over a merged summary's older ones
    write_summary(summary, out)
    return summary


def write_summary(summary: dict[str, Any], out: Path) -> None:
    # atomically: analysis.compare reads reference.json back, and a half-written one would be no reference
    statefile.write_json(out / "reference.json", summary, indent=1, sort_keys=True, ensure_ascii=False)
    statefile.write_atomic(out / "README.md", readme(summary))


def main(argv: list[str] | None = None) -> int:
    """`python -m reports.reference --detector`: the committed summary takes the detector's committed
    evaluation (reports/detector/evaluation.json) and reports/README.md is written again from it, the
    figures' results untouched (they change only with a reference rebuild of their runs).
    `--redecide KIND`: the claims of that rule kind decided again from the summary's per-run numbers
    (after their rule changed), the verdicts that moved printed."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m reports.reference", description=main.__doc__)
    ap.add_argument("--detector", action="store_true", help="take reports/detector/evaluation.json (the default "
                    "detector's) and the other committed evaluations under reports/detector/ (the audit RMs' default, the "
                    "retired detectors, the campaigns) into the summary")
    ap.add_argument("--out", default=str(Path(__file__).parent), help="the reference folder (default: reports/)")
    ap.add_argument("--redecide", choices=list(RULES), metavar="KIND",
                    help="decide the claims of this rule kind again from the summary's per-run numbers (after their "
                         f"rule changed; the runs untouched), and say which verdicts moved; one of {', '.join(RULES)}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    summary = json.loads((out / "reference.json").read_text())
    if args.redecide:
        for name, claim, was, now in redecide(summary, args.redecide):
            print(f"{name}: {claim}\n    {was} -> {now}" + ("" if was != now else " (unchanged)"))
    if args.detector:
        ev = detector.load_summary(out / "detector" / "evaluation.json")
        if ev is None:
            print(f"error: {out / 'detector' / 'evaluation.json'} does not exist; write it with `python -m "
                  "analysis.detector evaluate --tracking-uri STORE --out reports/detector`", file=sys.stderr)
            return 2
        summary["detector"] = ev
        take_evaluations(summary, out)
        summary.pop("collapse_rule", None)  # the indicator rule, scored against the truth it miscounted; now a baseline
    if found := tricks_summaries(out):  # the folder's studies, beside those the summary holds
        summary["tricks"] = {**(summary.get("tricks") or {}), **found}
    keep_order(summary)
    write_summary(summary, out)
    print(f"{out / 'reference.json'} and {out / 'README.md'} written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
