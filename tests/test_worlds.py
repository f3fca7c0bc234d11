"""Claims across worlds: runs of one grid on three worlds (analysis.synthetic.write_worlds), each
claim judged per world and pooled by tests stratified by world (analysis.stats, analysis.claims),
and a reproduction on another world judged against the reference's world-to-world spread
(analysis.compare). Each world moves every variant's KL by a level far larger than the effects
claimed, so only a test that compares runs within their world can see them."""
from __future__ import annotations

import itertools
import json
import math
import re

import numpy as np
import pytest

from analysis import claims as C
from analysis.compare import agreement, main, provenance_values, summarize, world_band
from analysis.stats import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    WORLD_DEPENDENT,
    compare,
    compare_strata,
    compare_to,
    compare_to_strata,
    rate_strata,
    rate_vs_half,
)
from analysis.store import load_ablation, one_or_sorted
from analysis.synthetic import Curve, world_hash, write_ablation, write_world_ablation, write_worlds
from harness import keys as K
from harness.rules import Claim, EvalScoresShift, PairsAboveChance
from reports.reference import figure_text

from helpers import fast_dir, sqlite_uri

WORLDS_YAML = """
name: worlds
figure: "W"
title: "Effects that hold, move and flip across worlds"
kind: train
seeds: [0, 1, 2, 3, 4]
variants:
  - name: base
  - name: every
  - name: one
  - name: flip
  - name: none
  - name: collapse
panels: [objective/kl]
claims:
  - {statement: "every drifts further than base.", source: ours,
     rule: {kind: compare, metric: objective/kl, lower: base, higher: every}}
  - {statement: "one drifts further than base.", source: ours,
     rule: {kind: compare, metric: objective/kl, lower: base, higher: one}}
  - {statement: "flip drifts further than base.", source: ours,
     rule: {kind: compare, metric: objective/kl, lower: base, higher: flip}}
  - {statement: "none drifts further than base.", source: ours,
     rule: {kind: compare, metric: objective/kl, lower: base, higher: none}}
  - {statement: "collapse collapses.", source: ours, rule: {kind: collapses, variant: collapse}}
  - {statement: "every ends with KL above 0.", source: ours,
     rule: {kind: threshold, metric: objective/kl, op: ">", value: 0.0, variant: every}}
"""
STEPS = 5  # final KL = KL at the last step = 5 x kl_slope + noise (sd 0.002)
LEVEL = 0.008  # world w adds w x LEVEL to every kl_slope: 0.04 more final KL per world
EFFECT = 0.002  # +0.01 final KL, 5 seed sds
SHIFTS = {"every": (1, 1, 1), "one": (1, 0, 0), "flip": (1, -1, 1), "none": (0, 0, 0)}
"""Per variant, the effect on each of the three worlds (in EFFECTs)."""


def curves(world: float, shifts: dict[str, float], collapse: bool | None = None) -> dict[str, Curve]:
    """One world's grid: base, the variants shifted from it, and a variant that collapses or not
    (None: no such variant)."""
    base = 0.004 + world * LEVEL
    return {"base": Curve(kl_slope=base), **{v: Curve(kl_slope=base + d * EFFECT) for v, d in shifts.items()},
            **({} if collapse is None else {"collapse": Curve(kl_slope=base, collapse_at=3 if collapse else None)})}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root, cleanup = fast_dir(tmp_path_factory, "worlds")
    (root / "ablations").mkdir()
    (root / "ablations" / "worlds.yaml").write_text(WORLDS_YAML)
    uris = {k: sqlite_uri(root / f"{k}.db") for k in ("ref", "other", "same")}
    write_worlds(uris["ref"], "worlds", "W", [curves(w, {v: s[w] for v, s in SHIFTS.items()}, collapse=w < 2)
                                              for w in range(3)], seeds=range(5), steps=STEPS, sample_every=0)
    # store-only figures for the within-run rules: two RMs per world, a Fig. 13-like run per world
    for w in range(2):
        write_world_ablation(uris["ref"], "rm_worlds", "2", {"good RM": 0.8, "coin RM": 0.55}, world_seed=w)
        write_ablation(uris["ref"], "eval_worlds", "13", {"PPO-max": Curve(reward_slope=0.1, offset=2.0 * w)},
                       seeds=(0,), steps=8, sample_every=0, eval_every=4, world_seed=w)
    whole = load_ablation("worlds", uris["ref"], root / "ablations")
    table = C.check_claims(whole)
    seen = provenance_values([whole.runs])  # as reports.reference writes it: one value, or the sorted values
    ref = {"figures": {"worlds": summarize(whole, table)},
           "provenance": one_or_sorted(seen)}
    (root / "reference.json").write_text(json.dumps(ref))
    # another CPU: world seed 0's config (same hash), another build (another RM accuracy), its level
    # between the reference's worlds 1 and 2; the effects hold ("flip" too)
    other = {"world.hash": world_hash(0), "world.rm/eval_acc": "0.717", "cpu.model": "Intel(R) Xeon(R)"}
    write_ablation(uris["other"], "worlds", "W", curves(1.5, {"every": 1, "flip": 1}), seeds=range(5), steps=STEPS,
                   sample_every=0, world_seed=0, provenance=other)
    # the reference's world 1 itself (same hash, same build), other seeds: "flip" fails there
    write_ablation(uris["same"], "worlds", "W", curves(1, {"every": 1, "flip": -1}), seeds=range(5, 10),
                   steps=STEPS, sample_every=0, world_seed=1)
    yield {"root": root, "registry": root / "ablations", **uris, "ref_doc": ref, "data": whole,
           "table": {r.claim: r for r in table.itertuples()}}
    cleanup()


def data(env, name="worlds", store="ref"):
    return env["data"] if (name, store) == ("worlds", "ref") else load_ablation(name, env[store], env["registry"])


def rows(env, name="worlds", claims=None):
    if name == "worlds" and claims is None:
        return env["table"]
    return {r.claim: r for r in C.check_claims(data(env, name), claims).itertuples()}


# --------------------------------------------------------------------------------------------
# The stratified tests
# --------------------------------------------------------------------------------------------
def test_one_stratum_is_exactly_the_one_world_test():
    rng = np.random.default_rng(5)
    a, b = rng.normal(1, 1, 5), rng.normal(0, 1, 6)
    assert compare_strata([a], [b]) == compare(a, b)
    assert compare_strata([a], [b], "equal", margin=0.5) == compare(a, b, "equal", margin=0.5)
    assert compare_to_strata([a], 0.2, "less") == compare_to(a, 0.2, "less")
    assert rate_strata([(4, 5)], "greater", "collapse rate") == rate_vs_half(4, 5, "greater", "collapse rate")


def test_stratified_p_value_is_the_count_over_within_world_relabellings():
    """Brute force: every joint relabelling within the worlds, the size-weighted mean difference."""
    strata = [([1.0, 2.5, 3.0], [0.0, 0.4]), ([10.0, 10.2], [9.0, 9.9, 10.1]), ([5.0, 6.0], [4.0, 4.5])]
    c = compare_strata([a for a, _ in strata], [b for _, b in strata])
    h = [len(a) * len(b) / (len(a) + len(b)) for a, b in strata]

    def stat(split):
        return sum(w * (np.mean(a) - np.mean(b)) for w, (a, b) in zip(h, split)) / sum(h)

    relabel = [[(list(pick), [x for i, x in enumerate(a + b) if i not in idx])
                for idx in itertools.combinations(range(len(a + b)), len(a))
                for pick in [[(a + b)[i] for i in idx]]] for a, b in strata]
    observed = stat(strata)
    dist = [stat(split) for split in itertools.product(*relabel)]
    assert len(dist) == 10 * 10 * 6
    assert c.estimate == pytest.approx(observed)
    assert c.p_value == pytest.approx(np.mean(np.abs(dist) >= abs(observed) - 1e-12))
    assert c.n_a == 7 and c.n_b == 7 and "stratified by world (3 worlds" in c.test
    assert c.ci_low <= c.estimate <= c.ci_high
    assert (c.ci_low <= 0 <= c.ci_high) == (c.p_value > 0.05)


def test_a_world_level_cancels_within_worlds_but_drowns_the_unstratified_test():
    rng = np.random.default_rng(0)
    a = [rng.normal(1.0, 0.3, 5) + 10 * w for w in range(3)]
    b = [rng.normal(0.0, 0.3, 5) + 10 * w for w in range(3)]
    pooled = compare_strata(a, b)
    moved = compare_strata([x + 7 * w for w, x in enumerate(a)], [x + 7 * w for w, x in enumerate(b)])
    assert pooled.verdict == REPRODUCED and pooled.ci_low > 0.5
    assert (moved.estimate, moved.p_value) == pytest.approx((pooled.estimate, pooled.p_value))
    assert compare(np.concatenate(a), np.concatenate(b)).verdict == INCONCLUSIVE  # the worlds' spread as noise
    # the effect size and power use the within-world sd (about 0.3), not the worlds' spread
    assert pooled.effect_size > 2 and pooled.min_detectable < 0.6


def test_stratified_test_keeps_its_level():
    rng = np.random.default_rng(1)
    trials = 200
    decided = sum(compare_strata([rng.normal(w, 1, 3) for w in (0, 5)], [rng.normal(w, 1, 3) for w in (0, 5)]).verdict
                  != INCONCLUSIVE for _ in range(trials))
    assert decided / trials <= 0.09  # about 5% (binomial sd 1.5%)


def test_one_sample_and_rate_pooled_over_worlds_by_hand():
    c = compare_to_strata([[1, 2, 3], [11, 12, 13]], 0.0)
    half = 2.7764451051977987 / math.sqrt(6)  # t(0.975, 6 - 2 df) x within-world sd 1 / sqrt(6)
    assert c.estimate == 7 and (c.ci_low, c.ci_high) == pytest.approx((7 - half, 7 + half)) and "4 df" in c.test
    r = rate_strata([(5, 5), (5, 5), (0, 5)], "greater", "collapse rate")
    assert (r.estimate, r.n_a) == (pytest.approx(2 / 3), 15) and r.verdict == INCONCLUSIVE  # 10/15: p = 0.15
    assert "summed over 3 worlds" in r.test
    lacking = compare_strata([[1.0, 2.0], []], [[0.0, 0.5], [3.0]])  # the second world lacks a group
    assert lacking.n_a == 2 and "one world of 2 has both groups" in lacking.test


# --------------------------------------------------------------------------------------------
# Claims per world and pooled
# --------------------------------------------------------------------------------------------
def test_runs_of_one_seed_on_several_worlds_are_kept_apart(env):
    d = data(env)
    assert len(d.runs) == 6 * 3 * 5 and d.worlds == [world_hash(w) for w in range(3)]
    assert d.world_label(d.worlds[1]) == f"world seed 1 ({world_hash(1)[:8]})"
    assert len(d.in_world(d.worlds[2]).runs) == 30 and set(d.in_world(d.worlds[2]).runs["seed"]) == set(range(5))


def test_an_effect_on_every_world(env):
    r = rows(env)["every drifts further than base."]
    assert r.verdict == REPRODUCED and r.world_verdicts == [REPRODUCED] * 3
    assert r.worlds == "reproduced on 3 of 3 worlds"
    assert r.n == "15 vs 15" and r.estimate == pytest.approx(STEPS * EFFECT, abs=0.003) and r.ci_low > 0
    assert "stratified by world" in r.test and "per world: world seed 0" in r.numbers
    # the same runs, unstratified: the worlds' levels (0.04 apart) swamp the 0.01 effect
    hi, lo = (np.concatenate(C._values(data(env), C.Compare(metric=K.KL, lower="base", higher="every"), v))
              for v in ("every", "base"))
    assert compare(hi, lo).verdict == INCONCLUSIVE
    kl = rows(env)["every ends with KL above 0."]
    assert kl.verdict == REPRODUCED and kl.worlds == "reproduced on 3 of 3 worlds" and "within-world sd" in kl.test


def test_an_effect_on_one_world_only(env):
    r = rows(env)["one drifts further than base."]
    # a third of the effect on average is still found pooled; the count says where it lives
    assert r.world_verdicts == [REPRODUCED, INCONCLUSIVE, INCONCLUSIVE] and r.worlds == "reproduced on 1 of 3 worlds"
    assert r.verdict == r.pooled_verdict == REPRODUCED
    assert r.estimate == pytest.approx(STEPS * EFFECT / 3, abs=0.0015)


def test_an_effect_that_flips_is_world_dependent_not_averaged_away(env):
    r = rows(env)["flip drifts further than base."]
    assert r.world_verdicts == [REPRODUCED, NOT_REPRODUCED, REPRODUCED]
    # pooled: no shift common to every world fits a world where the effect flips: the interval widens
    assert r.pooled_verdict == INCONCLUSIVE and r.verdict == WORLD_DEPENDENT
    assert r.worlds == "reproduced on 2 of 3 worlds (not reproduced on 1)"
    collapse = rows(env)["collapse collapses."]  # 5/5, 5/5, 0/5: pooled 10/15 decides nothing
    assert collapse.world_verdicts == [REPRODUCED, REPRODUCED, NOT_REPRODUCED]
    assert collapse.verdict == WORLD_DEPENDENT and collapse.pooled_verdict == INCONCLUSIVE


def test_no_effect_on_any_world(env):
    r = rows(env)["none drifts further than base."]
    assert r.world_verdicts == [INCONCLUSIVE] * 3 and r.verdict == r.pooled_verdict == INCONCLUSIVE
    assert r.worlds == "reproduced on 0 of 3 worlds" and r.ci_low < 0 < r.ci_high


def test_within_run_rules_pool_over_worlds(env):
    pairs = rows(env, "rm_worlds", [Claim("above chance", "ours", PairsAboveChance())])["above chance"]
    assert pairs.world_verdicts == [INCONCLUSIVE, INCONCLUSIVE]  # the coin RM decides each world
    assert "good RM: " in pairs.numbers and "summed over 2 worlds" in pairs.test and pairs.n == "400"
    shift = rows(env, "eval_worlds", [Claim("up", "ours", EvalScoresShift(what="mean"))])["up"]
    assert shift.verdict == REPRODUCED and shift.world_verdicts == [REPRODUCED, REPRODUCED]
    assert "stratified by world (2 worlds" in shift.test and "step 4 " in shift.numbers


def test_one_world_store_has_no_world_columns(env):
    one = rows(env, "worlds", None)
    single = C.check_claims(data(env, store="same"))
    assert set(single["worlds"]) == {""} and set(single["pooled_verdict"]) == {""}
    assert single["world_verdicts"].isna().all() and "stratified" not in " ".join(map(str, single["test"]))
    assert len(one) == len(single)


def test_claims_cli_prints_the_worlds(env, capsys):
    assert C.main(["worlds", "--tracking-uri", env["ref"], "--ablations-dir", str(env["registry"])]) == 0
    out = capsys.readouterr().out
    assert "[world-dependent] flip drifts further than base." in out
    assert "worlds: reproduced on 2 of 3 worlds (not reproduced on 1); pooled over them: inconclusive" in out


# --------------------------------------------------------------------------------------------
# The reference and a reproduction on another world
# --------------------------------------------------------------------------------------------
def test_reference_summary_keeps_the_worlds_compact(env):
    f = env["ref_doc"]["figures"]["worlds"]
    assert [w["hash"] for w in f["worlds"]] == [world_hash(w) for w in range(3)]
    assert [w["seed"] for w in f["worlds"]] == [0, 1, 2] and f["worlds"][1]["rm/eval_acc"] == "0.73"
    base = f["variants"]["base"]
    assert base["world"] == [0] * 5 + [1] * 5 + [2] * 5 and base["seeds"] == list(range(5)) * 3
    assert len(base["metrics"]["final objective/kl"]) == 15
    flip = next(c for c in f["claims"] if c["claim"].startswith("flip"))
    assert flip["verdict"] == WORLD_DEPENDENT and flip["pooled_verdict"] == INCONCLUSIVE
    assert flip["world_verdicts"] == [REPRODUCED, NOT_REPRODUCED, REPRODUCED]
    text = "\n".join(figure_text("worlds", f))
    assert "| worlds |" in text and "Worlds (3): world seed 0 (" in text
    assert ("| **world-dependent** | reproduced on 2 of 3 worlds (not reproduced on 1): reproduced, not reproduced, "
            "reproduced; pooled test: inconclusive |") in text


def test_world_band_is_a_prediction_interval_over_the_world_means():
    lo, hi = world_band([[1.0, 1.2], [2.0, 2.2], [3.0, 3.2]])  # means 1.1, 2.1, 3.1: sd 1
    half = 4.302652729911275 * math.sqrt(1 + 1 / 3)  # t(0.975, 2)
    assert (lo, hi) == pytest.approx((2.1 - half, 2.1 + half))


def run(env, store, capsys):
    rc = main(["worlds", "--tracking-uri", env[store], "--reference", str(env["root"] / "reference.json"),
               "--ablations-dir", str(env["registry"])])
    return rc, capsys.readouterr().out


def test_another_world_is_judged_by_the_worlds_spread(env, capsys):
    rc, out = run(env, "other", capsys)
    assert rc == 0
    # the same config hash built on another CPU is another world: the world-to-world band decides
    line = next(x for x in out.splitlines() if "base / final objective/kl" in x)
    assert line.startswith("  [in band]") and "world-to-world band [" in line
    assert re.search(r"seed band of world seed 0 \(\w+\) \[[-\d.e]+, [-\d.e]+\]: outside", line)
    assert "[same] every drifts further than base. — reference reproduced (reproduced on 3 of 3 worlds)" in out
    assert ("[DIFFERS] flip drifts further than base. — reference world-dependent (reproduced on 2 of 3 worlds "
            "(not reproduced on 1)), yours reproduced — a verdict one of the reference's worlds gives") in out
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(r"(\d+) of (\d+) claims agree, (\d+) of (\d+) metrics in band \((\d+) against the reference's "
                     r"world-to-world band \(your world is none of its worlds; (\d+) of them in the seed band of one "
                     r"world\); (\d+) of the (\d+) differing verdicts are one a reference world gives\)", last)
    assert m, last
    agree, claims, inside, metrics, by_world, in_seed, within, differ = map(int, m.groups())
    assert by_world == metrics == inside and in_seed < inside  # outside one world's seed band, inside the spread
    assert differ == claims - agree == out.count("[DIFFERS]") and within == out.count("reference's worlds gives")
    # the world hash is one of the reference's, its RM accuracy none of them: only that is named
    assert "world.rm/eval_acc: reference 0.72 | 0.73 | 0.74, yours 0.717" in out and "  world.hash:" not in out


def test_the_reference_world_itself_is_judged_by_its_own_seeds(env, capsys):
    rc, out = run(env, "same", capsys)
    assert rc == 0 and "world-to-world band" not in out.split("\n\n")[1]
    assert ("[same] flip drifts further than base. — reference not reproduced on your world (world seed 1 (" in out)
    assert "seed band of your world in the reference, world seed 1 (" in out
    assert re.search(r"metrics in band \(\d+ against the seed band of your own world in the reference\)$", out.strip())
    assert "your runs come from another machine or world" not in out  # world 1 is one of the reference's


def test_an_old_reference_without_worlds_compares_as_before(env):
    f = env["ref_doc"]["figures"]["worlds"]
    old = {k: v for k, v in f.items() if k != "worlds"}
    old["variants"] = {v: {k: x for k, x in d.items() if k != "world"} for v, d in f["variants"].items()}
    old["claims"] = [{k: x for k, x in c.items() if k not in ("world_verdicts", "pooled_verdict")} for c in f["claims"]]
    user = summarize(data(env, store="same"))
    claims, metrics = agreement(old, user)
    assert all("worlds" not in c for c in claims) and {m["band"] for m in metrics} == {"seed"}
    assert all(m["seed_world"] == "" for m in metrics)  # one band over every reference seed, as before


def test_report_shows_the_worlds_beside_the_pooled_test(env, tmp_path):
    from reports.build import Section, make_styles, write_pdf

    from helpers import pdf_text

    d = data(env)  # the report's claims pages; no figure, no samples (they do not depend on worlds)
    sec = Section(spec=d.spec, data=d, claims=C.check_claims(d))
    _, text = pdf_text(write_pdf(tmp_path / "report.pdf", [sec], {"git commit": "abc1234"}, make_styles()))
    assert "reproduced on 3 of 3 worlds" in text and "world-dependent" in text
    assert "reproduced on 2 of 3 worlds (not reproduced on 1); pooled test: inconclusive" in text
    assert "stratified by world" in text and "Runs on several worlds" in text
    assert "(+2 world-dependent)" in text  # the contents' claim counts


def test_a_monte_carlo_p_value_counts_the_observed_labelling_and_is_never_zero():
    """3 worlds of 5 vs 5 have 252^3 joint relabellings: sampled. With every a above every b in each
    world no sampled relabelling reaches the observed difference, and p is 1 / (m + 1), not 0."""
    from analysis.stats import EXACT_LIMIT, MC_SAMPLES

    assert 252 ** 3 > EXACT_LIMIT
    a = [np.arange(5.0) + 100 for _ in range(3)]
    b = [np.arange(5.0) for _ in range(3)]
    c = compare_strata(a, b)
    assert c.p_value == pytest.approx(1 / (MC_SAMPLES + 1)) and c.verdict == REPRODUCED
