"""analysis/: reading an ablation back from a synthetic MLflow store, figures, claim verdicts.

The store is written directly in the trainer's and ablation runner's formats
(analysis.synthetic), with a small registry in tmp_path, so these tests need no training.
"""
from __future__ import annotations

import re

import pytest

from analysis import claims as C
from analysis.figures import draw_ablation, figure_panels, legend_columns, make_figures
from analysis.figures import main as figures_main
from analysis.store import find_runs, load_ablation, resolve_spec
from analysis.synthetic import Curve, write_ablation, write_world_ablation
from harness import keys as K
from harness import tracking
from harness.registry import UnknownAblation, ablation_names, find_ablation, load_registry
from harness.rules import Claim, EvalScoresShift, Margin, PairsAboveChance, Similar
from reports.build import final_peak_table

from helpers import ETAS, SEEDS, fast_dir, sqlite_uri, store_uri, write_registry


def write_store(uri: str) -> None:
    """Grids where some claims hold, some fail, some cannot be told apart."""
    # KL falls with eta: "larger eta keeps KL lower" holds.
    write_ablation(uri, "kl_eta", "15", {
        ETAS[0]: Curve(kl_slope=0.006), ETAS[1]: Curve(kl_slope=0.004), ETAS[2]: Curve(kl_slope=0.002),
    }, seeds=SEEDS, steps=20)
    # APA drifts further than PPO: "APA keeps KL lower" fails; AWR has no runs.
    write_ablation(uri, "apa", "apa", {"PPO": Curve(kl_slope=0.002), "APA": Curve(kl_slope=0.008)},
                   seeds=SEEDS, steps=20)
    write_ablation(uri, "vanilla", "4", {"vanilla PPO": Curve(collapse_at=12)}, seeds=SEEDS, steps=20,
                   win_rate=True, old_seeds=(1,))  # seed 1 from before objective/ppl_tokens existed
    # Seeds scatter far more than the variants' KL differs: inconclusive; only reward scaling collapses.
    write_ablation(uri, "score_reparam", "6", {
        "reward scale": Curve(kl_slope=0.0041, seed_spread=4.0, collapse_at=15),
        "reward normalize, δ=0.8": Curve(kl_slope=0.004, seed_spread=4.0),
    }, seeds=SEEDS, steps=20, gold=False)
    write_ablation(uri, "rm_score_dist", "13", {"PPO-max": Curve(collapse_at=10)}, seeds=(0,), steps=20,
                   sample_every=0, eval_every=4)
    write_world_ablation(uri, "rm_scores", "2", {"reward model": 0.85, "reward model, 1/4 of the pairs": 0.7})
    write_world_ablation(uri, "rm_accuracy", "3", {"reward model": 0.8})
    # store-only ablations for the within-run rules' other outcomes
    write_world_ablation(uri, "rm_bad", "2", {"bad RM": 0.3})
    write_world_ablation(uri, "rm_coin", "2", {"coin RM": 0.55})  # 99 of 200 pairs: cannot tell
    for name, curve in (("eval_down", Curve(reward_slope=-0.05)), ("eval_flat", Curve(reward_slope=0.0))):
        write_ablation(uri, name, "13", {"PPO-max": curve}, seeds=(0,), steps=20, sample_every=0, eval_every=4)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root, cleanup = fast_dir(tmp_path_factory, "analysis")
    uri = store_uri(root)
    write_store(uri)
    yield {"uri": uri, "registry": write_registry(root / "ablations"), "root": root}
    cleanup()


def data_of(env, name):
    return load_ablation(name, env["uri"], env["registry"])


def lines_labeled(ax, label):
    return [ln for ln in ax.get_lines() if ln.get_label() == label]


# --------------------------------------------------------------------------------------------
# Registry view
# --------------------------------------------------------------------------------------------
def test_spec_expands_grid_and_inherit_without_resolving_configs(env):
    # resolve=False: no base file and no train config are read (the test files name settings
    # of an imagined config schema), so old stores still draw after the schema moves on
    kl = load_registry(find_ablation("kl_eta", env["registry"]), resolve=False)
    assert kl.variant_names == ETAS and kl.runs == [] and kl.common is None
    assert kl.variants[1].settings == {"ppo.kl_coef": 0.1}
    assert kl.shared == {"ppo.steps": 20} and kl.figure == "15" and kl.order == 15
    apa = load_registry(env["registry"] / "apa.yaml", resolve=False)
    assert apa.variants[2].settings == {"ppo.policy_loss": "apa", "ppo.apa_lambda": 0.1}
    assert [c.cited for c in apa.claims] == ["paper APA paper"] * 2 + ["ours"]
    assert "vanilla" in ablation_names(env["registry"]) and "bases" not in " ".join(ablation_names(env["registry"]))


def test_unknown_ablation_suggests_closest(env, capsys):
    with pytest.raises(UnknownAblation, match="did you mean kl_eta"):
        resolve_spec("kl_et", env["uri"], env["registry"])
    assert figures_main(["kl_et", "--tracking-uri", env["uri"], "--ablations-dir", str(env["registry"])]) == 2
    assert "did you mean kl_eta" in capsys.readouterr().err


def test_store_only_ablation_gets_spec_from_tags(env):
    spec = resolve_spec("kl_eta", env["uri"], env["root"] / "no-registry")
    assert spec.figure == "15" and sorted(spec.variant_names) == sorted(ETAS) and spec.claims == []
    assert draw_ablation(load_ablation(spec, env["uri"])).axes  # drawn with the standard curves


def test_ablation_without_runs_is_skipped_not_drawn(env, tmp_path, capsys):
    rc = figures_main(["policy_constraints", "--tracking-uri", env["uri"], "--ablations-dir", str(env["registry"]),
                       "--out", str(tmp_path)])
    assert rc == 1 and "no runs" in capsys.readouterr().out and not (tmp_path / "policy_constraints").exists()


def test_a_reader_given_a_missing_sqlite_store_says_it_holds_no_runs_and_creates_nothing(env, tmp_path, capsys):
    missing = tmp_path / "typo" / "mlflow.db"
    rc = figures_main(["kl_eta", "--tracking-uri", sqlite_uri(missing), "--ablations-dir", str(env["registry"]),
                       "--out", str(tmp_path / "out")])
    assert rc == 1 and "no runs" in capsys.readouterr().out
    assert not (tmp_path / "typo").exists()  # neither the database nor its folder


# --------------------------------------------------------------------------------------------
# Store
# --------------------------------------------------------------------------------------------
def test_runs_metrics_and_samples_from_the_store(env):
    d = data_of(env, "kl_eta")
    assert d.variants == ETAS and len(d.runs) == 15
    assert set(d.runs["seed"]) == set(SEEDS) and not d.runs["collapsed"].any()
    assert d.parent_run_id is not None
    m = d.metrics([K.KL, K.RM_SCORE])
    assert list(m.columns) == ["run_id", "variant", "seed", "metric", "step", "value"]
    assert len(m) == 15 * 2 * 20
    s = d.samples(per_run=2)
    assert set(s["step"]) == {20} and len(s) == 30

    v = data_of(env, "vanilla")
    assert v.runs["collapsed"].all() and set(v.runs["collapse_step"]) == {12.0}
    assert "great great" in v.samples(1)["response"].iloc[0]


def test_rerun_keeps_the_finished_run(env):
    """A second, unfinished run of (variant, seed) does not replace the finished one."""
    uri = env["uri"]
    before = find_runs(uri, "apa").set_index(["variant", "seed"])["run_id"]
    tracking.start_run(uri, "apa", "apa-rerun", tags={
        K.TAG_ROLE: "train", K.TAG_ABLATION: "apa", K.TAG_VARIANT: "PPO", K.TAG_SEED: "0"})
    after = find_runs(uri, "apa").set_index(["variant", "seed"])["run_id"]
    assert after.equals(before)
    assert len(find_runs(uri, "apa", dedupe=False)) == len(before) + 1


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------
def test_one_line_per_variant_in_every_metric_panel(env):
    d = data_of(env, "kl_eta")
    drawn = draw_ablation(d)
    # Gold reward follows reward because the runs log it; every run logs the token-pooled
    # perplexity, so it replaces the spiky per-sample one, on a log axis.
    assert list(drawn.axes) == [K.RM_SCORE, K.GOLD_SCORE, K.LENGTH, K.KL, K.PPL_TOKENS]
    assert drawn.axes[K.PPL_TOKENS].get_yscale() == "log" and drawn.axes[K.KL].get_yscale() == "linear"
    assert drawn.axes[K.KL].get_ylabel() == "nats/token" and drawn.axes[K.LENGTH].get_ylabel() == "tokens"
    for panel, ax in drawn.axes.items():
        for v in ETAS:
            assert len(lines_labeled(ax, v)) == 1, (panel, v)
        assert len(ax.collections) == len(ETAS)  # one min-max band per variant
    legend = [t.get_text() for t in drawn.fig.legends[0].get_texts()]
    assert legend[:3] == ETAS and any("min–max" in t for t in legend)


def test_collapse_markers_and_win_rate_on_the_reward_axis(env):
    d = data_of(env, "vanilla")
    assert K.EVAL_WIN_RATE not in figure_panels(d)  # moved onto the reward panel
    # one seed lacks the token-pooled perplexity: the figure keeps the per-sample one for all runs
    assert K.PPL in figure_panels(d) and K.PPL_TOKENS not in figure_panels(d)
    drawn = draw_ablation(d, smooth_k=3)
    reward = drawn.axes[K.RM_SCORE]
    markers = [ln for ln in reward.get_lines() if ln.get_label() == "_collapse"]
    assert len(markers) == 5 and markers[0].get_xdata()[0] == 12  # one per collapsed seed
    right = drawn.axes[f"{K.EVAL_WIN_RATE} (right axis)"]
    assert len(right.get_lines()) == 1 and right.get_ylim() == (0, 1)
    legend = [t.get_text() for t in drawn.fig.legends[0].get_texts()]
    assert "collapse: gold onset" in legend and any("rolling mean over 3" in t for t in legend)


def test_the_gold_onset_and_the_warning_have_their_own_markers_and_counts(tmp_path):
    from harness.registry import Registry, Variant

    uri = sqlite_uri(tmp_path / "m.db")
    write_ablation(uri, "warned", "4", {"early": Curve(collapse_at=30, warn_at=22), "silent": Curve(collapse_at=30),
                                        "false alarm": Curve(warn_at=15)}, seeds=[0, 1], steps=40, sample_every=0)
    d = load_ablation(Registry(name="warned", figure="4", variants=[Variant(v, {}) for v in ("early", "silent",
                      "false alarm")], panels=[K.RM_SCORE]), uri)
    drawn = draw_ablation(d)
    marks = [(ln.get_marker(), ln.get_xdata()[0]) for ln in drawn.axes[K.RM_SCORE].get_lines()
             if ln.get_label() == "_collapse"]
    assert sorted(marks) == sorted([("X", 30)] * 4 + [("^", 22)] * 2 + [("^", 15)] * 2)
    legend = [t.get_text() for t in drawn.fig.legends[0].get_texts()]
    assert "collapse: gold onset" in legend and "early warning (no gold used)" in legend
    table = final_peak_table(d).set_index("variant")
    assert table.loc["early", "warned"] == "2/2" and table.loc["early", "lead"] == "8"
    assert table.loc["silent", "warned"] == "0/2" and table.loc["silent", "lead"] == "–"
    assert table.loc["false alarm", "warned"] == "2/2" and table.loc["false alarm", "lead"] == "–"


def test_table_perplexity_follows_the_figure(env):
    assert data_of(env, "kl_eta").shown_metric(K.PPL) == K.PPL_TOKENS
    assert data_of(env, "vanilla").shown_metric(K.PPL) == K.PPL
    assert data_of(env, "kl_eta").shown_metric(K.KL) == K.KL
    pooled = final_peak_table(data_of(env, "kl_eta"))
    assert "final ppl (token-pooled)" in pooled.columns and "final ppl" not in pooled.columns
    per_sample = final_peak_table(data_of(env, "vanilla"))  # one seed predates ppl_tokens
    assert "final ppl" in per_sample.columns and "final ppl (token-pooled)" not in per_sample.columns


def test_legend_columns_shrink_for_long_variant_names():
    from matplotlib.lines import Line2D
    short = [Line2D([], [], label=f"η={x}") for x in (0.05, 0.1, 0.2, 0.4)]
    long = [Line2D([], [], label="reward norm δ_r=0.8, adv norm (no clip), value clip δ_vf=0.2")] + short
    assert legend_columns(short) == 3 and legend_columns(short[:2]) == 2 and legend_columns(long) == 1


def test_special_panels(env):
    diff = draw_ablation(data_of(env, "rm_scores")).axes["rm_score_diff_hist"]
    labels = [p.get_label() for p in diff.patches]
    assert labels.count("reward model") == 1 and labels.count("reward model, 1/4 of the pairs") == 1

    acc = draw_ablation(data_of(env, "rm_accuracy")).axes["rm_accuracy"]
    assert len(lines_labeled(acc, "train accuracy")) == 1 and len(lines_labeled(acc, "eval accuracy")) == 1

    ridges = draw_ablation(data_of(env, "rm_score_dist")).axes["eval_rm_score_hist:PPO-max"]
    steps = [ln.get_label() for ln in ridges.get_lines() if ln.get_label().startswith("step ")]
    assert steps == ["step 4", "step 8", "step 12", "step 16", "step 20"]


def test_make_figures_writes_png_pdf_and_logs_to_parent(env, tmp_path):
    res = make_figures("apa", env["uri"], out=tmp_path, ablations_dir=env["registry"])
    assert [p.name for p in res.paths] == ["figure.png", "figure.pdf"]
    assert all(p.is_file() and p.stat().st_size > 1000 for p in res.paths)
    assert res.paths[0].parent == tmp_path / "apa"
    logged = {a.path for a in tracking.client(env["uri"]).list_artifacts(res.logged_to, "figures")}
    assert logged == {"figures/figure.png", "figures/figure.pdf"}
    # AWR is in the registry but has no runs: drawn variants are the runs'.
    assert res.data.variants == ["PPO", "APA"] and res.data.missing_variants == ["AWR"]


# --------------------------------------------------------------------------------------------
# Claims
# --------------------------------------------------------------------------------------------
def verdicts(env, name):
    table = C.check_claims(data_of(env, name))
    assert not table.empty
    return {r.claim: r for r in table.itertuples()}


def test_compare_holds_fails_and_is_inconclusive(env):
    apa = verdicts(env, "apa")
    holds = apa["PPO keeps KL lower than APA."]
    assert holds.verdict == C.REPRODUCED and holds.n == "5 vs 5" and holds.statistic == "mean difference"
    assert 0 < holds.ci_low < holds.estimate < holds.ci_high and holds.p_value == pytest.approx(2 / 252)
    assert "permutation test" in holds.test and holds.effect_size > 1 and holds.min_detectable > 0
    assert re.search(r"APA [\d.]+ ± [\d.]+ vs PPO [\d.]+ ± ", holds.numbers) and "95% CI" in holds.numbers
    fails = apa["APA stays closer to the initial policy (lower KL) than PPO at equal samples."]
    assert fails.verdict == C.NOT_REPRODUCED and fails.ci_high < 0
    vs_awr = apa["APA reaches a higher RM score than AWR at equal samples."]
    assert vs_awr.verdict == C.INCONCLUSIVE and "'AWR' has no runs" in vs_awr.reason
    wide = verdicts(env, "score_reparam")["Reward normalization with δ=0.8 keeps KL below reward scaling alone."]
    assert wide.verdict == C.INCONCLUSIVE and wide.ci_low < 0 < wide.ci_high and wide.reason == ""


def test_trend_threshold_and_similar(env):
    kl_eta = verdicts(env, "kl_eta")
    kl = kl_eta["A larger KL penalty η keeps KL lower."]
    assert kl.verdict == C.REPRODUCED and kl.source == "paper App. B.2"
    assert kl.numbers.count("mean difference") == 2  # both neighbour pairs tested
    assert kl_eta["A larger η raises KL."].verdict == C.NOT_REPRODUCED
    assert kl_eta["A larger η lowers the RM score."].verdict == C.INCONCLUSIVE  # reward does not depend on η here
    assert kl_eta["KL ends above zero for every η."].verdict == C.REPRODUCED
    below = kl_eta["KL ends below 0.01 for η=0.05."]
    assert below.verdict == C.NOT_REPRODUCED and "t-test" in below.test and below.n == "5"
    assert kl_eta["Every η ends at the same RM score."].verdict == C.REPRODUCED
    assert kl_eta["η 0.05 and 0.2 end at the same KL."].verdict == C.NOT_REPRODUCED
    alike = verdicts(env, "score_reparam")["Both end at the same KL, as far as the seeds tell."]
    assert alike.verdict == C.INCONCLUSIVE and "TOST" in alike.test  # no difference found, but too wide for the margin
    assert "margin ±" in alike.numbers and alike.level == pytest.approx(0.9) and alike.margin > 0
    one_seed = verdicts(env, "rm_accuracy")["The RM's held-out accuracy beats chance."]
    assert one_seed.verdict == C.INCONCLUSIVE and "fewer than 5 runs" in one_seed.reason


def test_equivalence_resolves_the_margin_on_the_runs_judged_and_says_when_it_cannot():
    import numpy as np

    rule = Similar("objective/gold_score", ["a", "b"], Margin(share=0.1, of="b"), "a tenth of b")
    a, b = [np.array([2.0, 2.01, 1.99, 2.02, 1.98])], [np.array([2.0, 1.99, 2.01, 1.98, 2.02])]
    [(label, c)] = C.equivalence(rule, {"a": a, "b": b})
    assert c.margin == pytest.approx(0.2) and c.verdict == C.REPRODUCED and label.startswith("a ")
    with pytest.raises(C.Unjudged, match="needs that mean positive, got -2"):  # a share of a negative gold mean
        C.equivalence(rule, {"a": a, "b": [-x for x in b]})


def test_collapse_claims_binomial_and_rmst(env):
    vanilla = verdicts(env, "vanilla")
    collapses = vanilla["Vanilla PPO collapses."]
    assert collapses.verdict == C.REPRODUCED and "5/5 seeds collapsed" in collapses.numbers
    assert collapses.p_value == pytest.approx(1 / 32) and "binomial" in collapses.test
    assert vanilla["Vanilla PPO stays stable."].verdict == C.NOT_REPRODUCED
    sr = verdicts(env, "score_reparam")
    assert sr["Reward normalization with δ=0.8 keeps training stable (no collapse)."].verdict == C.REPRODUCED
    assert sr["Reward normalization with δ=0.8 collapses."].verdict == C.NOT_REPRODUCED
    later = sr["Reward normalization collapses later than reward scaling."]  # censored at the 20-step budget
    assert later.verdict == C.REPRODUCED and later.estimate == pytest.approx(5.0)
    few = verdicts(env, "rm_score_dist")["PPO-max collapses."]
    assert few.verdict == C.INCONCLUSIVE and "fewer than 5 runs" in few.reason


def test_within_run_claims(env):
    assert all(r.verdict == C.REPRODUCED for r in verdicts(env, "rm_scores").values())
    pairs = Claim("above chance", "ours", PairsAboveChance())
    assert C.check_claims(data_of(env, "rm_bad"), [pairs]).verdict[0] == C.NOT_REPRODUCED
    assert C.check_claims(data_of(env, "rm_coin"), [pairs]).verdict[0] == C.INCONCLUSIVE
    dist = verdicts(env, "rm_score_dist")
    assert dist["The held-out RM-score distribution moves up."].verdict == C.REPRODUCED
    assert dist["The held-out RM-score distribution grows a long tail."].verdict == C.REPRODUCED
    assert "step 4" in dist["The held-out RM-score distribution moves up."].numbers
    shift = [Claim(w, "ours", EvalScoresShift(what=w)) for w in ("mean", "sd")]
    assert C.check_claims(data_of(env, "eval_down"), shift[:1]).verdict[0] == C.NOT_REPRODUCED
    assert list(C.check_claims(data_of(env, "eval_flat"), shift).verdict) == [C.INCONCLUSIVE, C.INCONCLUSIVE]


def test_no_runs_is_inconclusive(env):
    d = load_ablation("policy_constraints", env["uri"], env["registry"])
    assert d.runs.empty and d.missing_variants == ["KL penalty"]
    table = C.check_claims(d)
    assert set(table["verdict"]) == {C.INCONCLUSIVE} and set(table["reason"]) == {"no runs in the store"}


@pytest.mark.parametrize("module", ["analysis.figures", "analysis.claims", "analysis.synthetic", "reports.build"])
def test_every_command_has_help(module, capsys):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(["--help"])
    assert e.value.code == 0 and "usage: python -m " + module in capsys.readouterr().out
