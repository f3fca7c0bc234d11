"""reports/build.py: PDFs from a synthetic store, read back with pypdf."""
from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pandas as pd
import pytest

from analysis.synthetic import Curve, write_ablation, write_world_ablation
from harness import keys as K
from harness import tracking
from harness.registry import REPO_ROOT
from reports.build import COMBINED, build
from reports.build import main as build_main

from helpers import ETAS, fast_dir, pdf_text, sqlite_uri, store_uri, write_registry

SWEEP_YAML = """
name: sweep_x
kind: sweep
title: "Sweep: delta_r x eta"
search_space:
  reward.clip: {low: 0.1, high: 10.0, log: true}
  ppo.kl_coef: {low: 0.001, high: 0.5, log: true}
"""


def fake_sweep_module(png) -> types.ModuleType:
    """Stands in for analysis.sweep_plots (owned by the sweep engineer) with its contract."""
    mod = types.ModuleType("analysis.sweep_plots")

    def sweep_summary(sweep_yaml_path, tracking_uri, storage_url=None, *, out_dir=None):
        cols = {"trial": [0, 1, 2], "value": [0.51, 0.72, 0.33], "state": ["COMPLETE"] * 3}
        cols.update({f"param_{i}": [0.1 * i] * 3 for i in range(9)})  # wider than one table
        return {"figures": [str(png)], "table": pd.DataFrame(cols),
                "best": {"number": 1, "value": 0.72, "params": {"reward.clip": 0.8, "ppo.kl_coef": 0.05}}}

    mod.sweep_summary = sweep_summary
    return mod


def write_detector_evaluation(folder: Path) -> dict:
    """An evaluation of a hand-set detector on synthetic runs, as `python -m analysis.detector evaluate
    --out FOLDER` writes it (the reports read folder/evaluation.json and folder/detector.png)."""
    from analysis import detector as D

    from helpers import stream, write_detector

    folder.mkdir(parents=True, exist_ok=True)
    params = D.load_params(write_detector(folder / "d.json"))
    runs = [D.RunData(f"r{i}", "f", v, i, "w0", "h", list(enumerate(stream(80, at=at, seed=i), 1)), onset, 80, 24,
                      group="fit" if i < 4 else "held-out seeds")
            for i in range(8) for v, at, onset in (("falls", 40, 50), ("holds", None, None))]
    for i, r in enumerate(runs):
        r.run_id = f"r{i}"
    ev = D.evaluate(runs, params)
    (folder / "evaluation.json").write_text(json.dumps(D.to_summary(ev), default=float))
    D.draw(ev, folder)
    return ev


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root, cleanup = fast_dir(tmp_path_factory, "reports")
    uri = store_uri(root)
    write_ablation(uri, "kl_eta", "15", {
        ETAS[0]: Curve(kl_slope=0.006), ETAS[1]: Curve(kl_slope=0.004), ETAS[2]: Curve(kl_slope=0.002),
    }, seeds=(0, 1), steps=20)
    write_ablation(uri, "vanilla", "4", {"vanilla PPO": Curve(collapse_at=12)}, seeds=(0, 1), steps=20, win_rate=True)
    write_world_ablation(uri, "rm_scores", "2", {"reward model": 0.85, "reward model, 1/4 of the pairs": 0.7})
    registry = write_registry(root / "ablations")
    (registry / "sweep_x.yaml").write_text(SWEEP_YAML)
    tracking.ensure_experiment(uri, "sweep_x")  # a sweep logs its trials' runs there

    from matplotlib.figure import Figure

    png = root / "sweep.png"
    fig = Figure(figsize=(4, 3))
    fig.add_subplot().plot([0, 1], [0, 1])
    fig.savefig(png)

    out = root / "reports"
    write_detector_evaluation(out / "detector")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "analysis.sweep_plots", fake_sweep_module(png))
        res = build(["kl_eta", "vanilla", "rm_scores", "sweep_x"], uri, out, ablations_dir=registry)
    yield {"res": res, "out": out, "uri": uri, "registry": registry}
    cleanup()


def test_one_pdf_per_ablation_and_a_combined_one(built):
    res, out = built["res"], built["out"]
    assert res.errors == {}
    assert set(res.reports) == {"kl_eta", "vanilla", "rm_scores", "sweep_x"}
    for name, path in res.reports.items():
        assert path == out / name / "report.pdf" and path.is_file()
    assert res.combined == out / COMBINED
    assert (out / "kl_eta" / "figure.png").is_file() and (out / "kl_eta" / "figure.pdf").is_file()


def test_ablation_report_holds_every_section(built):
    pages, text = pdf_text(built["res"].reports["kl_eta"])
    assert pages >= 3  # title page + the section (figure and tables do not fit one page)
    for heading in ("git commit", "machine", "torch", "Grid: what each variant changes", "Figure",
                    "Final and peak metrics", "Claims", "Sample responses (last sampled step)"):
        assert heading in text, heading
    for variant in ETAS:  # Greek letters survive (embedded DejaVu font)
        assert variant in text, variant
    assert "ppo.kl_coef = 0.05" in text
    assert "A larger KL penalty η keeps KL lower." in text and "reproduced" in text and "paper App. B.2" in text
    assert "Ablation report: Fig. 15: KL penalty eta" in text  # a one-ablation report's title names it
    assert "exact permutation test" in text and "95% CI" in text and "fewer than 5 runs per variant" in text
    assert str(built["registry"]) not in text and "registry file kl_eta.yaml" in text  # no machine paths
    assert "MLflow store sqlite:///mlflow.db" in text and str(built["uri"]) not in text


def test_header_columns_fit_their_longest_word(built):
    from reportlab.pdfbase.pdfmetrics import stringWidth

    from reports.build import FRAME_W, _fit_header, make_styles

    st = make_styles()
    head = ["variant", "final RM train acc", "final RM eval acc", "final RM train loss", "accuracy"]
    widths = _fit_header([head], [0.6, 0.1, 0.1, 0.1, 0.1], st)
    assert sum(widths) == pytest.approx(FRAME_W)
    for h, w in zip(head, widths):
        assert w >= max(stringWidth(x, "DejaVuSans-Bold", 7.5) for x in h.split()) + 6


def test_collapsed_samples_show_it_and_long_text_wraps(built):
    _, text = pdf_text(built["res"].reports["vanilla"])
    assert "COLLAPSED at step 12" in text
    assert "Vanilla PPO collapses." in text and "2/2 seeds collapsed" in text
    assert "inferred (not stated by the paper)" in text and "Two seeds stand for the paper's one run." in text
    assert "more characters]" in text  # the run-on response is clipped with a note, not cut off


def test_world_report_has_no_samples_section(built):
    _, text = pdf_text(built["res"].reports["rm_scores"])
    assert "reward model, 1/4 of the pairs" in text and "final RM eval acc" in text
    assert "Sample responses" not in text


def test_sweep_section_from_sweep_plots(built):
    _, text = pdf_text(built["res"].reports["sweep_x"])
    assert "Best trial" in text and "Trials (3 of 3 shown)" in text
    assert "param_0" in text and "param_8" in text  # wide trial tables are split, not cut


def test_combined_report_has_all_sections_in_paper_order(built):
    pages, text = pdf_text(built["res"].combined)
    per_ablation = sum(pdf_text(p)[0] - 1 for p in built["res"].reports.values())  # minus their title pages
    assert pages == per_ablation + 2  # the title page and the early warning's page
    order = [text.index(t) for t in ("Fig. 2: RM score difference", "Fig. 4: vanilla PPO collapses",
                                     "Fig. 15: KL penalty eta", "Sweep: delta_r x eta",
                                     "The early warning against the gold truth")]
    assert "held-out: recall" in text
    assert order == sorted(order) and "Contents" in text


def test_broken_sweep_section_is_a_note_not_a_failed_build(built, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "analysis.sweep_plots", types.ModuleType("analysis.sweep_plots"))
    res = build(["sweep_x"], built["uri"], tmp_path, ablations_dir=built["registry"])
    _, text = pdf_text(res.reports["sweep_x"])
    assert "sweep_summary failed: AttributeError" in text


def test_unknown_ablation_exits_2_with_suggestion(built, tmp_path, capsys):
    code = build_main(["kl_etaa", "--tracking-uri", built["uri"], "--out", str(tmp_path),
                       "--ablations-dir", str(built["registry"])])
    assert code == 2 and "did you mean kl_eta" in capsys.readouterr().err


def test_one_named_ablation_leaves_the_combined_report_alone(built, tmp_path):
    # the main job builds one ablation's report; it must not overwrite the combined report with it
    res = build(["vanilla"], built["uri"], tmp_path, ablations_dir=built["registry"], log_figures=False)
    assert set(res.reports) == {"vanilla"} and res.combined is None
    assert not (tmp_path / COMBINED).exists()


def test_cli_with_one_name_says_the_combined_report_was_kept(built, tmp_path, capsys):
    rc = build_main(["vanilla", "--tracking-uri", built["uri"], "--out", str(tmp_path),
                     "--ablations-dir", str(built["registry"]), "--no-log"])
    out = capsys.readouterr().out
    assert rc == 0 and f"vanilla: {tmp_path / 'vanilla' / 'report.pdf'}" in out
    assert "combined report left as it was" in out and "nothing to report" not in out


def test_an_ablation_asked_for_by_name_without_runs_fails_naming_the_store(built, tmp_path, capsys):
    base = ["--tracking-uri", built["uri"], "--out", str(tmp_path), "--ablations-dir", str(built["registry"]), "--no-log"]
    assert build_main(["apa", *base]) == 1
    err = capsys.readouterr().err
    assert f"error: nothing to report: the store {built['uri']} holds no runs of apa" in err and not (tmp_path / "apa").exists()
    assert build_main(["vanilla", "apa", *base]) == 1  # the one with runs is built; the command still fails
    out = capsys.readouterr()
    assert f"error: no report of apa: the store {built['uri']} holds no runs of it" in out.err
    assert (tmp_path / "vanilla" / "report.pdf").is_file()
    from analysis.claims import main as claims_main

    assert claims_main(["apa", "--tracking-uri", built["uri"], "--ablations-dir", str(built["registry"])]) == 1
    assert f"error: apa: the store {built['uri']} holds no runs of it" in capsys.readouterr().err


def test_partial_store_skips_ablations_without_runs_and_keeps_the_combined_report(built, tmp_path, capsys):
    # every registry entry by default; apa, score_reparam, ... have no runs in this store
    res = build(None, built["uri"], tmp_path, ablations_dir=built["registry"], log_figures=False)
    assert {"apa", "score_reparam", "policy_constraints", "rm_accuracy", "rm_score_dist"} <= set(res.skipped)
    assert set(res.reports) == {"kl_eta", "vanilla", "rm_scores", "sweep_x"}
    assert res.combined is None and not (tmp_path / COMBINED).exists()
    assert not (tmp_path / "apa").exists()  # never drawn as empty panels
    assert "skipped apa: no runs" in capsys.readouterr().err
    rc = build_main(["--tracking-uri", built["uri"], "--out", str(tmp_path), "--ablations-dir", str(built["registry"]),
                     "--no-log"])
    assert rc == 0 and "combined report not built: no runs of " in capsys.readouterr().out


def test_default_output_is_results_only_and_reference_writes_summary_and_readme(built, tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    args = ["vanilla", "kl_eta", "--tracking-uri", built["uri"], "--ablations-dir", str(built["registry"]), "--no-log"]
    assert build_main(args) == 0
    assert os.listdir(tmp_path) == ["results"]  # nothing beside the ignored results/ folder
    assert (tmp_path / "results" / "vanilla" / "report.pdf").is_file() and (tmp_path / "results" / COMBINED).is_file()
    assert "/results/" in (REPO_ROOT / ".gitignore").read_text().split()  # a user's build leaves git status clean
    write_detector_evaluation(tmp_path / "ref" / "detector")
    write_detector_evaluation(tmp_path / "ref" / "detector" / "audit")  # the audit RMs' detector, beside it
    res = build(["vanilla", "kl_eta"], built["uri"], tmp_path / "ref", ablations_dir=built["registry"],
                log_figures=False, reference=True)
    text = (tmp_path / "ref" / "reference.json").read_text()
    ref = json.loads(text)
    assert res.combined is not None and text == json.dumps(ref, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    van = ref["figures"]["vanilla"]
    assert van["run_commits"] == ["synthetic"] and van["inferred"] == ["Two seeds stand for the paper's one run."]
    assert van["variants"]["vanilla PPO"]["n"] == 2 and van["variants"]["vanilla PPO"]["collapsed"] == 2
    seeds = van["variants"]["vanilla PPO"]["metrics"]["final objective/kl"]
    assert len(seeds) == 2 and all(x == float(f"{x:.4g}") for x in seeds)  # rounded: a stable file
    claim = van["claims"][0]
    assert claim["source"] == "paper 5.2" and claim["verdict"] == "inconclusive" and claim["n"] == "2"
    assert set(ref["figures"]["kl_eta"]["variants"][ETAS[0]]["metrics"]) == {
        "final objective/kl", "final objective/rm_score", "final objective/gold_score"}
    assert ref["provenance"] == {"commit": "synthetic"}
    assert ref["detector"]["line"].startswith("held-out: recall ") and "collapse_rule" not in ref
    readme = (tmp_path / "ref" / "README.md").read_text()
    # the committed prose, then results written from the summary: the claim with its section, verdict and n
    assert readme.startswith("# Reports") and "<!-- results" not in readme
    assert "| Vanilla PPO collapses. | paper 5.2 | **inconclusive**: fewer than 5 runs per variant: no verdict | 2 |" in readme
    assert "Inferred (not stated by the paper): Two seeds stand for the paper's one run." in readme
    assert "### The early warning against the gold truth" in readme and "- commit: synthetic" in readme
    assert f"`{ref['detector']['line']}`" in readme
    assert ref["detector_audit"]["line"].startswith("held-out: recall ")
    audit = readme.split("### The early warning with audit reward models")[1].split("### Provenance")[0]
    assert f"`{ref['detector_audit']['line']}`" in audit and "reports/detector/audit/" in audit


def test_reference_of_a_partial_store_holds_only_its_figures(built, tmp_path):
    """--reference over every figure: those with runs are drawn and combined; a figure without runs
    loses its old folder (no report of older code passes for a reference result) and is listed."""
    import json

    stale = tmp_path / "ref" / "apa"
    stale.mkdir(parents=True)
    (stale / "report.pdf").write_bytes(b"%PDF old")
    res = build(None, built["uri"], tmp_path / "ref", ablations_dir=built["registry"], log_figures=False, reference=True)
    assert "apa" in res.skipped and not stale.exists() and res.combined is not None
    ref = json.loads((tmp_path / "ref" / "reference.json").read_text())
    assert "apa" in ref["not_run"] and set(ref["figures"]) >= {"kl_eta", "vanilla"}
    assert "Not yet run for the reference (no results here): " in (tmp_path / "ref" / "README.md").read_text()


def test_the_reference_readme_rewritten_from_its_summary_keeps_the_paper_order(tmp_path):
    """reference.json's keys are sorted; `python -m reports.reference --detector` writes README.md again
    from it: figures in the combined report's order and each figure's variants in its file's order,
    also from a summary written before it kept them (read from the figure files)."""
    import json
    import shutil

    from reports import reference

    ref = json.loads((REPO_ROOT / "reports" / "reference.json").read_text())
    ref.pop("order", None)
    for f in ref["figures"].values():
        f.pop("variant_order", None)
    (tmp_path / "reference.json").write_text(json.dumps(ref, sort_keys=True))
    shutil.copytree(REPO_ROOT / "reports" / "detector", tmp_path / "detector")
    assert reference.main(["--detector", "--out", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    heads = [line.rsplit("(`", 1)[1].rstrip("`)") for line in readme.splitlines() if line.startswith("### ") and "(`" in line]
    assert heads[:4] == ["rm_scores", "rm_accuracy", "vanilla", "score_reparam"]  # Figs. 2, 3, 4, 6: not by name
    per_variant = [line for line in readme.split("(`score_reparam`)")[1].splitlines() if line.startswith("Per variant")][0]
    assert per_variant.split(": ", 1)[1].startswith("vanilla PPO: ")  # the file's first variant, not the first by name
    assert readme == (REPO_ROOT / "reports" / "README.md").read_text()  # as the committed one, written with the orders kept


def test_merge_asks_for_the_reference_and_the_names_to_put_in(tmp_path, capsys):
    uri = store_uri(tmp_path)
    for args in (["--merge"], ["vanilla", "--merge"], ["--reference", "--merge"]):
        assert build_main([*args, "--tracking-uri", uri, "--out", str(tmp_path / "out")]) == 2
        assert "--merge: needs --reference and the ABLATION names" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()


ALIKE_YAML = """
name: alike
figure: "x"
order: 99
variants: ["a", "b"]
panels: [objective/rm_score]
claims:
  - statement: "a and b end alike."
    source: ours
    rule: {kind: similar, metric: objective/rm_score, variants: ["a", "b"], margin: {abs: 0.1}, margin_reason: "small"}
  - statement: "b ends lower than a."
    source: ours
    rule: {kind: compare, metric: objective/rm_score, lower: "b", higher: "a"}
"""


def test_similar_claims_are_decided_again_from_the_summarys_per_run_numbers(tmp_path):
    """`python -m reports.reference --redecide similar`: the summary's per-run numbers, grouped by their world,
    go through the claims code again (a rule changed, the runs did not); the other claims stay as they were."""
    from reports.reference import readme, redecide

    (tmp_path / "alike.yaml").write_text(ALIKE_YAML)
    noise = [0.01, -0.02, 0.0, 0.02, -0.01]
    per_world = {"a": [o + 0.03 + e for o in (0.0, 5.0) for e in noise], "b": [o + e for o in (0.0, 5.0) for e in noise[::-1]]}
    variants = {v: {"n": 10, "seeds": [0, 1, 2, 3, 4] * 2, "world": [0] * 5 + [1] * 5, "collapsed": 0, "best_step": [],
                    "metrics": {"final objective/rm_score": x}} for v, x in per_world.items()}
    kept = {"claim": "b ends lower than a.", "source": "ours", "verdict": "inconclusive", "estimate": 1.0}
    summary = {"figures": {"alike": {
        "title": "alike", "figure": "x", "inferred": [], "run_commits": [], "variants": variants,
        "worlds": [{"hash": "w0", "seed": 0}, {"hash": "w1", "seed": 1}],
        "claims": [{"claim": "a and b end alike.", "source": "ours", "verdict": "not reproduced"}, kept]}},
        "not_run": [], "provenance": {}, "built_at_commit": "abc"}
    assert redecide(summary, "similar", tmp_path) == [("alike", "a and b end alike.", "not reproduced", "reproduced")]
    alike, other = summary["figures"]["alike"]["claims"]
    assert other == kept
    assert alike["margin"] == 0.1 and alike["level"] == pytest.approx(0.9) and alike["n"] == "10 vs 10"
    assert alike["estimate"] == pytest.approx(0.03, abs=1e-9) and -0.1 < alike["ci_low"] < alike["ci_high"] < 0.1
    assert alike["world_verdicts"] == ["reproduced"] * 2 and alike["statistic"] == "mean within-world difference"
    assert summary["redecided"]["similar"]["figures"] == ["alike"]
    text = readme(summary)
    assert "(90% CI; margin ±0.1)" in text and "The `similar` claims of alike were decided again" in text


def test_a_campaigns_detectors_are_one_table_of_every_folder_scored_on_its_runs(tmp_path):
    """reports.reference's CAMPAIGNS: each detector folder under a campaign's with an evaluation.json is one
    row (its held-out numbers, fit runs, folds) and its line; a folder without one is no row."""
    import json
    import shutil

    from reports import reference

    src = REPO_ROOT / "reports" / "detector" / "campaign4"
    shutil.copytree(src, tmp_path / "detector" / "campaign4")
    shutil.rmtree(tmp_path / "detector" / "campaign4" / "audit")
    evs = reference.campaign_evaluations(tmp_path)["detector_campaign4"]
    assert sorted(evs) == sorted(p.parent.name for p in src.glob("*/evaluation.json") if p.parent.name != "audit")
    text = "\n".join(reference.campaign_text(evs, reference.CAMPAIGNS["detector_campaign4"]))
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(evs) and not any("`audit/`" in r for r in rows)
    for name in evs:
        full = json.loads((src / name / "evaluation.json").read_text())
        s = full["groups"]["held-out (all)"]
        row = next(r for r in rows if r.startswith(f"| `{name}/`"))
        assert f"{s['runs']} ({s['fell']} fell)" in row and full["detector"]["file"] in row
        assert f"`{full['line']}`" in text


def test_a_campaigns_families_folder_adds_its_table_and_an_older_layouts_keys_are_dropped(tmp_path):
    """reports.reference.take_evaluations: a summary's detector keys of the per-detector layout (campaigns 1-3
    before they were one table each) go, the campaign's table comes in; a folder written by `families` adds
    its family sets' table and is named with the families command that wrote it."""
    import json
    import shutil

    from reports import reference

    src = REPO_ROOT / "reports" / "detector" / "campaign3"
    shutil.copytree(src, tmp_path / "detector" / "campaign3")
    summary = {"figures": {}, "detector_campaign3_declared": {"line": "old"}, "detector_campaign3": {"line": "old"}}
    reference.take_evaluations(summary, tmp_path)
    assert [k for k in summary if k.startswith("detector_")] == ["detector_campaign3"]
    evs = summary["detector_campaign3"]
    assert sorted(evs) == sorted(p.parent.name for p in src.glob("*/evaluation.json"))
    text = "\n".join(reference.campaign_text(evs, reference.CAMPAIGNS["detector_campaign3"]))
    fam = json.loads((src / "families" / "evaluation.json").read_text())["families"]
    assert "`families/`: What each signal family adds" in text
    assert all(reference._row(row) in text for row in fam["rows"][1:])
    assert ("`python -m analysis.detector families --runs reports/detector/campaign/runs.npz,"
            "reports/detector/campaign2/runs.npz,reports/detector/campaign3/runs.npz --fit-world 4bde1a81,") in text
    assert text.count("What each signal family adds") == 1  # the evaluate folders add none
    # the campaign's runs are counted from an evaluate folder's store, not a families one's (the fit runs pooled in)
    assert "46 runs of world 3d8413f0. " in text
    no_audit_first = {k: v for k, v in evs.items() if k != "audit"}  # families/ now the first folder
    assert "46 runs of world 3d8413f0. " in "\n".join(reference.campaign_text(no_audit_first, reference.CAMPAIGNS["detector_campaign3"]))


def test_the_warned_column_names_the_detector_its_runs_ran_with(tmp_path):
    """The metrics table's note names the detector(s) of the runs' tag provenance.detector (harness.detector.fingerprint),
    so a committed page and a fresh run with another default say which detector each warned with; older runs: none."""
    from analysis.store import load_ablation
    from analysis.synthetic import Curve, write_ablation
    from harness.registry import Registry, Variant
    from reports.build import warned_note

    reg = Registry(name="warned", figure="4", variants=[Variant("early", {})], panels=[K.RM_SCORE])
    old, new = sqlite_uri(tmp_path / "old.db"), sqlite_uri(tmp_path / "new.db")
    write_ablation(old, "warned", "4", {"early": Curve(collapse_at=30, warn_at=22)}, seeds=[0, 1], steps=40, sample_every=0)
    write_ablation(new, "warned", "4", {"early": Curve(collapse_at=30, warn_at=22)}, seeds=[0, 1], steps=40, sample_every=0,
                   provenance={"detector": "fit at 8fd8cc6, sha256 0123456789ab"})
    assert "the detector" not in warned_note(load_ablation(reg, old).runs)
    assert "; the detector fit at 8fd8cc6, sha256 0123456789ab)" in warned_note(load_ablation(reg, new).runs)
