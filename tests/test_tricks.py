"""analysis.tricks on synthetic design studies written into a real Optuna storage and MLflow store
(analysis.synthetic_tricks: the sweep file's own Sobol design, one choice planted to matter): the
conditional percentiles, collapse rates and top-5% shares single out the planted value; the planted
choice ranks first in importance and every other choice's interval holds 0; a planted pure interaction
is the strongest pair; the ranking holds across worlds when the effects do and not when they flip; the
one-factor claims are set against the design (agrees, contradicts, cannot say and why); the CLI, the
report pages and the best-configuration figure file."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy.stats import binomtest

from analysis import synthetic_tricks as syn
from analysis import tricks
from analysis.tricks_claims import claims_table
from harness import design, sweepfile, sweepstore
from harness.schema import ConfigError

from helpers import store_uri, study_storage

REPO = Path(__file__).resolve().parents[1]
VANILLA = REPO / "ablations" / "bases" / "vanilla.yaml"
PLANTED = "ppo.adv_normalize"


def study_yaml(folder: Path, name: str, trials: int) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(f"""\
name: {name}
base: {VANILLA}
steps: 10
seeds: [0]
worlds: [0, 1]
trials: {trials}
sampler: {{name: sobol, seed: 0}}
pruner: none
objectives:
  - {{name: final_gold, stat: final, metric: objective/gold_score}}
  - {{name: gold_auc, stat: mean, metric: objective/gold_score}}
  - {{name: collapsed, stat: collapsed}}
  - {{name: final_kl, stat: final, metric: objective/kl}}
search_space:
  reward: {{group: {{raw: {{reward.normalize: false}}, normalize: {{reward.normalize: true}}}}}}
  reward.clip: {{choices: [0.3, 0.8], when: {{reward: normalize}}, otherwise: null}}
  ppo.adv_normalize: [false, true]
  ppo.kl_coef: [0.0, 0.1]
  ppo.entropy_coef: [0.0, 0.01]
  ppo.max_grad_norm: [0.0, 0.5, 1.0]
""")
    return path


class Store:
    def __init__(self, folder: Path):
        self.folder, self.uri = folder, store_uri(folder)
        self.storage = study_storage(folder)

    def write(self, name: str, model, trials: int = 64, collapse_below: float = 0.5) -> tricks.StudyData:
        spec = sweepfile.load_sweep(study_yaml(self.folder, name, trials), tracking_uri=self.uri)
        syn.write_study(spec, self.uri, self.storage, model, trials=trials, collapse_below=collapse_below)
        return tricks.load_study(name, self.uri, self.storage)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store(tmp_path_factory.mktemp("tricks"))


@pytest.fixture(scope="module")
def planted(store):
    """ppo.adv_normalize=true adds 1 to final gold (noise sd 0.3); runs below 0.5 collapse; KL = 1 - 5 eta."""
    return store.write("syn_planted", syn.planted(PLANTED, True))


def test_the_synthetic_store_holds_the_design_of_its_file(planted):
    spec = sweepfile.load_sweep(Path(planted.attr["sweep_file"]))
    assert len(planted.configs) == 64 and len(planted.runs) == 128 and planted.worlds() == [0, 1]
    assert [planted.configs[c].tolist() for c in planted.choices] == [
        [design.label(p[c]) if c in p else tricks.NOT_DRAWN for p in spec.design[:64]] for c in planted.choices]


def test_percentiles_collapse_rates_and_top_shares_single_out_the_planted_value(planted):
    vt = tricks.value_table(planted, B=300).set_index(["choice", "value"])
    on, off = vt.loc[(PLANTED, "true")], vt.loc[(PLANTED, "false")]
    assert on.ci_low > off.ci_high  # the 95th-percentile intervals do not overlap
    x = planted.configs.loc[planted.configs[PLANTED] == "true", "final_gold"]
    assert on.n == len(x) == 32 and on.percentile == pytest.approx(np.percentile(x, 95))
    assert on.top_share == 1.0 and on.share == 0.5 and on.top_low > on.share  # every top-5% configuration has it
    assert off.collapse_low > 0.7 and on.collapse_high < 0.3
    ci = binomtest(int(off.collapsed), int(off.runs)).proportion_ci(0.95, method="exact")
    assert (off.collapse_low, off.collapse_high) == pytest.approx((ci.low, ci.high))
    clip = vt.loc["reward.clip"]
    assert list(clip.index) == ["0.3", "0.8", tricks.NOT_DRAWN]
    assert clip.loc[tricks.NOT_DRAWN, "n"] == (planted.configs["reward"] == "raw").sum()
    others = vt.drop(PLANTED, level="choice")
    assert (others["top_low"] <= others["share"]).all()  # no other value is over-represented among the best


@pytest.mark.parametrize("evaluator", ["anova", "ped_anova"])
def test_the_planted_choice_ranks_first_and_the_others_intervals_hold_zero(planted, evaluator):
    imp = tricks.importances(planted, evaluator=evaluator, B=400 if evaluator == "anova" else 10)
    assert imp.iloc[0]["choice"] == PLANTED
    if evaluator == "anova":  # the Bonferroni intervals: the planted one above 0, each other one holding 0
        assert imp.iloc[0]["ci_low"] > 0
        rest = imp.iloc[1:]
        assert ((rest["ci_low"] <= 0) & (rest["ci_high"] >= 0)).all(), rest


def test_a_planted_interaction_is_the_strongest_pair_and_a_main_effect_is_none(store):
    def model(params, world, rng):
        xor = (params["ppo.kl_coef"] == 0.1) != (params["ppo.entropy_coef"] == 0.01)
        return float(params[PLANTED]) + 1.0 * xor + rng.normal(0, 0.3), 1.0

    d = store.write("syn_pair", model)
    inter = tricks.interactions(d)
    top = inter.iloc[0]
    assert {top.a, top.b} == {"ppo.kl_coef", "ppo.entropy_coef"} and top.bonferroni and top.share > 0.3
    assert not inter.iloc[1:]["bonferroni"].any()  # the planted main effect makes no interaction of its pairs
    mean, count = tricks.pair_table(d, "ppo.kl_coef", "ppo.entropy_coef")
    assert mean.shape == (2, 2) and count.to_numpy().sum() == 64
    assert mean.loc["0.1", "0.0"] - mean.loc["0.0", "0.0"] > 0.6  # XOR: one on, the other off
    imp = tricks.importances(d, B=200).set_index("choice")
    assert imp.loc["ppo.kl_coef", "ci_low"] <= 0 <= imp.loc["ppo.kl_coef", "ci_high"]  # no main effect of its own


def test_the_ranking_holds_across_worlds_when_the_effects_do_and_not_when_they_flip(store):
    def graded(flip: bool):
        def model(params, world, rng):
            gold = (1.0 * params[PLANTED] + 0.6 * params["ppo.max_grad_norm"] + 4.0 * params["ppo.kl_coef"]
                    + 20.0 * params["ppo.entropy_coef"])
            return float((-gold if flip and world == 1 else gold) + rng.normal(0, 0.1)), 1.0
        return model

    same = tricks.world_agreement(store.write("syn_same", graded(False), trials=32), B=200).iloc[0]
    flipped = tricks.world_agreement(store.write("syn_flip", graded(True), trials=32), B=200).iloc[0]
    assert (same.world_a, same.world_b, same.configs) == (0, 1, 32)
    assert same.rho > 0.7 and same.ci_low > 0.3 and same.importance_rho > 0.5
    assert flipped.rho < 0 and flipped.ci_high < 0.3


CLAIMS = """\
name: syn_claims
figure: "syn"
base: {base}
seeds: [0]
variants:
  - name: "no KL"
  - name: "KL"
    set: {{ppo.kl_coef: 0.1}}
  - name: "KL, pretrained"
    set: {{ppo.kl_coef: 0.1, model.policy_init: pretrained}}
  - name: "KL 0.2"
    set: {{ppo.kl_coef: 0.2}}
  - name: "adv norm"
    set: {{ppo.adv_normalize: true}}
claims:
  - statement: "The KL penalty keeps KL lower."
    source: ours
    rule: {{kind: compare, metric: objective/kl, lower: "KL", higher: "no KL"}}
  - statement: "The KL penalty raises KL."
    source: ours
    rule: {{kind: compare, metric: objective/kl, lower: "no KL", higher: "KL"}}
  - statement: "A pretrained policy with KL reaches more gold."
    source: ours
    rule: {{kind: compare, metric: objective/gold_score, lower: "no KL", higher: "KL, pretrained"}}
  - statement: "A larger KL penalty keeps KL lower still."
    source: ours
    rule: {{kind: compare, metric: objective/kl, lower: "KL 0.2", higher: "no KL"}}
  - statement: "Advantage normalization does not collapse."
    source: ours
    rule: {{kind: collapses, variant: "adv norm", expected: false}}
  - statement: "Advantage normalization ends above 0.5 gold."
    source: ours
    rule: {{kind: threshold, metric: objective/gold_score, op: ">", value: 0.5, variant: "adv norm"}}
  - statement: "The KL penalty raises the RM score."
    source: ours
    rule: {{kind: compare, metric: objective/rm_score, lower: "no KL", higher: "KL"}}
  - statement: "No KL collapses."
    source: ours
    rule: {{kind: collapses, variant: "no KL"}}
  - statement: "The KL penalty leaves KL where it was."
    source: ours
    rule: {{kind: similar, metric: objective/kl, variants: ["KL", "no KL"], margin: {{share: 0.1, of: "no KL"}},
            margin_reason: "a tenth of the KL without a penalty"}}
  - statement: "The KL penalty's KL is no KL's within a mile."
    source: ours
    rule: {{kind: similar, metric: objective/kl, variants: ["KL", "no KL"], margin: {{abs: 1000.0}},
            margin_reason: "nothing below a thousand nats matters"}}
"""


def test_the_one_factor_claims_against_the_design(planted, tmp_path):
    folder = tmp_path / "ablations"
    folder.mkdir()
    (folder / "syn_claims.yaml").write_text(CLAIMS.format(base=VANILLA))
    ref = tmp_path / "reference.json"
    ref.write_text(json.dumps({"figures": {"syn_claims": {"claims": [
        {"claim": "The KL penalty keeps KL lower.", "verdict": "reproduced"}]}}}))
    table = claims_table(planted, ablations_dir=folder, reference=ref).set_index("claim")
    says = table["says"].to_dict()
    assert says == {"The KL penalty keeps KL lower.": "agrees", "The KL penalty raises KL.": "contradicts",
                    "A pretrained policy with KL reaches more gold.": "cannot say",
                    "A larger KL penalty keeps KL lower still.": "cannot say",
                    "Advantage normalization does not collapse.": "agrees",
                    "Advantage normalization ends above 0.5 gold.": "agrees",
                    "The KL penalty raises the RM score.": "cannot say", "No KL collapses.": "cannot say",
                    "The KL penalty leaves KL where it was.": "contradicts",  # equivalence, beyond a tenth
                    "The KL penalty's KL is no KL's within a mile.": "agrees"}
    assert "alike within ±10% of the mean of 'no KL'" in table.loc["The KL penalty leaves KL where it was.", "test"]
    why = table["reason"].to_dict()
    assert "model.policy_init, which the study does not vary" in why["A pretrained policy with KL reaches more gold."]
    assert "a value the design does not draw: ppo.kl_coef (ppo.kl_coef=0.2)" in why["A larger KL penalty keeps KL lower still."]
    assert why["The KL penalty raises the RM score."] == "the study's runs log no objective/rm_score"
    assert why["No KL collapses."] == "not about a trick (the variant is the figure's base)"
    assert table.loc["The KL penalty keeps KL lower.", "one_factor"] == "reproduced"
    assert table.loc["The KL penalty raises KL.", "one_factor"] == "–"
    assert "ppo.kl_coef=0.0 (n=32)" in table.loc["The KL penalty keeps KL lower.", "design"]

    real = claims_table(planted)  # every claim of the repo's figure files gets an answer, none an exception
    assert len(real) > 40 and set(real["says"]) <= {"agrees", "contradicts", "cannot say"}
    assert (real.loc[real["says"] == "cannot say", "reason"] != "").all()


def test_the_cli_writes_tables_figures_json_and_the_report_pages(planted, store, tmp_path, capsys):
    out = tmp_path / "out"
    assert tricks.main(["syn_planted", "--tracking-uri", store.uri, "--storage", store.storage, "--out-dir", str(out),
                        "--bootstrap", "100", "--importance-bootstrap", "100", "--no-claims"]) == 0
    printed = capsys.readouterr().out
    assert f"| {PLANTED} |" in printed and "matters" in printed and "runs/h" in printed
    names = {p.name for p in out.iterdir()}
    assert {"tricks.json", "tricks_values.csv", "tricks_importances.csv", "tricks_interactions.csv",
            "tricks_worlds_agreement.csv", "tricks_violins.png", "tricks_importances.png",
            "tricks_interactions.png", "tricks_worlds.png"} <= names
    summary = json.loads((out / "tricks.json").read_text())
    assert summary["importances"][0]["choice"] == PLANTED and summary["configs"] == 64
    assert summary["best"]["values"][PLANTED] == "true"

    from pypdf import PdfReader
    from reportlab.platypus import SimpleDocTemplate

    from reports import build
    from reports.tricks import design_summary, flowables

    summary = design_summary("syn_planted", store.uri, tmp_path / "report")
    SimpleDocTemplate(str(tmp_path / "t.pdf")).build(flowables(summary, build.make_styles(), build))
    text = " ".join(p.extract_text() for p in PdfReader(tmp_path / "t.pdf").pages)
    assert "Which tricks matter (syn_planted)" in text and "The one-factor claims against the design" in text
    assert f"{PLANTED} " in text and "matters" in text
    assert design_summary("nope", store.uri, tmp_path / "report") is None  # no such design study: no pages


def test_bad_input_of_the_cli_is_refused(store, planted, tmp_path, capsys):
    assert tricks.main(["nope", "--tracking-uri", store.uri, "--storage", store.storage]) == 2
    assert "no Optuna study named 'nope'" in capsys.readouterr().err
    import optuna

    plain = optuna.create_study(storage=store.storage, study_name="plain_sweep")
    plain.set_user_attr(sweepstore.ATTR_SWEEP, {"name": "plain_sweep", "search_space": {}})
    assert tricks.main(["plain_sweep", "--tracking-uri", store.uri, "--storage", store.storage]) == 2
    assert "has no `objectives`" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tricks.main(["syn_planted", "--bootstrap", "-1"])


def test_the_best_configuration_becomes_a_figure_file_against_ppo_max_elsewhere(planted, tmp_path):
    from analysis.tricks_best import best_figure
    from harness.registry import load_registry

    path = best_figure(planted, world=2, out=tmp_path / "syn_planted_best.yaml")
    reg = load_registry(path)
    best = tricks.best_config(planted)
    assert reg.variant_names == ["PPO-max", f"best of syn_planted (trial {best['number']})"]
    assert reg.seeds == [1, 2, 3, 4, 5] and sorted(reg.worlds) == [2] and len(reg.runs) == 10
    changed = reg.variants[1].settings  # where it differs from PPO-max (which normalizes advantages already)
    assert "ppo.adv_normalize" not in changed and changed["ppo.kl_coef"] == float(best["values"]["ppo.kl_coef"])
    assert [type(c.rule).__name__ for c in reg.claims] == ["Compare", "Collapses"]
    data = yaml.safe_load(path.read_text())
    assert data["base"] == "bases/ppo_max.yaml" and data["set"]["ppo.steps"] == 10
    with pytest.raises(ConfigError, match="--world 1: the study ran on world"):
        best_figure(planted, world=1, out=tmp_path / "x.yaml")
    with pytest.raises(ConfigError, match=r"--seeds \[0, 7\]: the study used seeds \[0\]"):
        best_figure(planted, world=2, seeds=[0, 7], out=tmp_path / "x.yaml")


def test_reports_build_gives_a_design_study_its_pages(planted, store, tmp_path):
    from pypdf import PdfReader

    from reports.build import build

    res = build([planted.attr["sweep_file"]], store.uri, tmp_path / "out", log_figures=False)
    assert not res.errors and set(res.reports) == {"syn_planted"}
    text = " ".join(p.extract_text() for p in PdfReader(res.reports["syn_planted"]).pages)
    assert "Which tricks matter (syn_planted)" in text and "Per choice value" in text
    assert (tmp_path / "out" / "syn_planted" / "tricks.json").is_file()


def test_a_design_study_merged_into_the_committed_reference_keeps_every_figure(planted, store, tmp_path):
    """reports.build STUDY --reference --merge: the study's pages, tricks.json and README section go into a
    committed reference folder whose figures (run into another store) stay as they were."""
    import shutil

    from harness.registry import REPO_ROOT
    from reports import reference
    from reports.build import build

    ref = tmp_path / "ref"
    ref.mkdir()
    shutil.copy(REPO_ROOT / "reports" / "reference.json", ref)
    shutil.copytree(REPO_ROOT / "reports" / "detector", ref / "detector")
    before = json.loads((ref / "reference.json").read_text())
    res = build([planted.attr["sweep_file"]], store.uri, ref, log_figures=False, reference=True, merge=True)
    assert not res.errors and res.combined is None and not (ref / "harness-report.pdf").exists()  # needs every run
    after = json.loads((ref / "reference.json").read_text())
    assert after["figures"] == before["figures"] and after["detector"] == before["detector"]
    assert after["tricks"]["syn_planted"]["importances"][0]["choice"] == PLANTED
    assert set(after["tricks"]) == set(before.get("tricks") or {}) | {"syn_planted"}  # the committed ones kept
    assert set(after["merged"]) == set(before.get("merged") or {}) | {"syn_planted"} and after["order"] == before["order"]
    def values(v):
        return set(v) if isinstance(v, list) else {v}
    assert values(before["provenance"]["cpu.model"]) <= values(after["provenance"]["cpu.model"])  # joined, not replaced
    readme = (ref / "README.md").read_text()
    assert "(`syn_planted`)" in readme and f"| {PLANTED} |" in readme and "| matters |" in readme
    assert "(`score_reparam`)" in readme and "Put in after that build" in readme
    assert reference.main(["--out", str(ref)]) == 0 and (ref / "README.md").read_text() == readme  # idempotent
