"""analysis.compare: a user's store against a reference summary, both written as synthetic runs."""
from __future__ import annotations

import json
import re

import pytest

from analysis.compare import band, main, summarize
from analysis.store import load_ablation
from analysis.synthetic import Curve, write_ablation

from helpers import ETAS, fast_dir, sqlite_uri, write_registry

KL_CURVES = {ETAS[0]: Curve(kl_slope=0.006), ETAS[1]: Curve(kl_slope=0.004), ETAS[2]: Curve(kl_slope=0.002)}
LOWER_KL = "A larger KL penalty η keeps KL lower."
MACHINE_A = {"cpu.model": "AMD EPYC", "cpu.flags": "avx2 avx512f", "world.hash": "4bde", "world.rm/eval_acc": "0.74"}
MACHINE_B = {**MACHINE_A, "cpu.model": "Intel(R) Xeon(R)", "world.rm/eval_acc": "0.717"}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root, cleanup = fast_dir(tmp_path_factory, "compare")
    registry = write_registry(root / "ablations")
    uris = {k: sqlite_uri(root / f"{k}.db") for k in ("ref", "same", "other")}
    write_ablation(uris["ref"], "kl_eta", "15", KL_CURVES, seeds=range(5), steps=20, eval_every=5, provenance=MACHINE_A)
    write_ablation(uris["ref"], "vanilla", "4", {"vanilla PPO": Curve(collapse_at=12)}, seeds=range(5), steps=20)
    ref = {"figures": {n: summarize(load_ablation(n, uris["ref"], registry)) for n in ("kl_eta", "vanilla")},
           "provenance": {"commit": "abc1234", **MACHINE_A}}
    (root / "reference.json").write_text(json.dumps(ref))
    # other seeds, same machine and world
    write_ablation(uris["same"], "kl_eta", "15", KL_CURVES, seeds=range(5, 10), steps=20, provenance=MACHINE_A)
    # another CPU, so another world: the largest η drifts furthest ("larger η keeps KL lower" now
    # fails); apa is not in the reference
    write_ablation(uris["other"], "kl_eta", "15", {**KL_CURVES, ETAS[2]: Curve(kl_slope=0.01)}, seeds=range(5), steps=20,
                   provenance=MACHINE_B)
    write_ablation(uris["other"], "apa", "apa", {"PPO": Curve()}, seeds=range(5), steps=20)
    yield {"root": root, "registry": registry, **uris}
    cleanup()


def run(stores, store, *names, capsys):
    rc = main([*names, "--tracking-uri", stores[store], "--reference", str(stores["root"] / "reference.json"),
               "--ablations-dir", str(stores["registry"])])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_reference_summary_holds_per_seed_numbers_and_best_steps(stores):
    eta = json.loads((stores["root"] / "reference.json").read_text())["figures"]["kl_eta"]["variants"][ETAS[0]]
    assert eta["n"] == 5 and eta["seeds"] == [0, 1, 2, 3, 4] and len(eta["metrics"]["final objective/kl"]) == 5
    assert len(eta["best_step"]) == 5 and set(eta["best_step"]) <= {5, 10, 15, 20}  # the eval steps


def test_band_is_the_seed_range_widened_by_the_standard_error():
    lo, hi = band([1.0, 2.0, 3.0])  # sd 1, se 1/sqrt(3)
    assert (lo, hi) == pytest.approx((1 - 3 ** -0.5, 3 + 3 ** -0.5))
    assert band([2.0]) == (2.0, 2.0)


def test_same_world_other_seeds_agree_only_shared_figures_compared(stores, capsys):
    rc, out, _ = run(stores, "same", capsys=capsys)
    n_claims = len(json.loads((stores["root"] / "reference.json").read_text())["figures"]["kl_eta"]["claims"])
    assert rc == 0 and "vanilla" not in out  # not in this store: not compared
    assert f"{n_claims} of {n_claims} claims agree" in out and "DIFFERS" not in out
    assert f"[in band] {ETAS[2]} / final objective/kl" in out
    assert "another machine or world" not in out  # same CPU and world: nothing to warn about


def test_runs_from_another_cpu_and_world_are_named_as_such(stores, capsys):
    rc, out, _ = run(stores, "other", "kl_eta", capsys=capsys)
    assert rc == 0 and "your runs come from another machine or world than the reference's:" in out
    assert "cpu.model: reference AMD EPYC, yours Intel(R) Xeon(R)" in out
    assert "world.rm/eval_acc: reference 0.74, yours 0.717" in out
    assert "cpu.flags" not in out and "world.hash" not in out  # equal on both sides: not named


def test_a_different_result_is_named_and_still_exits_0(stores, capsys):
    rc, out, _ = run(stores, "other", "kl_eta", capsys=capsys)
    assert rc == 0
    assert f"[DIFFERS] {LOWER_KL} — reference reproduced, yours not reproduced" in out
    assert f"[OUTSIDE] {ETAS[2]} / final objective/kl" in out
    assert f"[in band] {ETAS[0]} / final objective/kl" in out
    agree, claims, inside, metrics = map(int, re.fullmatch(
        r"(\d+) of (\d+) claims agree, (\d+) of (\d+) metrics in band", out.strip().splitlines()[-1]).groups())
    assert (out.count("[DIFFERS]"), out.count("[OUTSIDE]")) == (claims - agree, metrics - inside) and claims == 7


def test_bad_input_exits_2_with_a_message(stores, capsys, tmp_path):
    rc, _, err = run(stores, "other", "apa", capsys=capsys)
    assert rc == 2 and "no figure 'apa' in the reference (it holds: kl_eta, vanilla)" in err
    rc = main(["--tracking-uri", sqlite_uri(tmp_path / "none.db")])
    assert rc == 2 and "no such MLflow store" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    rc = main(["--tracking-uri", stores["same"], "--reference", str(tmp_path / "bad.json")])
    assert rc == 2 and "not a reference summary" in capsys.readouterr().err


def test_nothing_to_compare_fails_naming_the_store(stores, capsys, tmp_path):
    rc, out, err = run(stores, "same", "vanilla", capsys=capsys)  # in the reference, not in this store
    assert rc == 1 and f"error: nothing to compare: the store {stores['same']} holds no runs of vanilla" in err
    assert "claims agree" not in out
    rc, out, err = run(stores, "same", "kl_eta", "vanilla", capsys=capsys)  # one compared, one missing
    assert rc == 1 and "claims agree" in out and f"error: vanilla: the store {stores['same']} holds no runs of it" in err
    from harness import tracking

    empty = sqlite_uri(tmp_path / "empty.db")
    tracking.ensure_experiment(empty, "kl_eta")  # a store with the experiment but no runs
    rc = main(["--tracking-uri", empty, "--reference", str(stores["root"] / "reference.json"),
               "--ablations-dir", str(stores["registry"])])
    out = capsys.readouterr()
    assert rc == 1 and "0 of 0 claims" not in out.out
    assert f"error: nothing to compare: the store {empty} holds no runs of " in out.err


def test_after_the_main_job_the_figure_just_run_is_compared_when_the_reference_has_it(stores, capsys, monkeypatch):
    import analysis.compare as compare

    monkeypatch.setattr(compare, "REFERENCE", stores["root"] / "reference.json")
    compare.after_run("apa", stores["other"])
    assert "holds no reference results for apa: nothing to compare" in capsys.readouterr().out
    compare.after_run("kl_eta", stores["same"])  # the repo's registry: its claims, matched by statement
    out = capsys.readouterr().out
    assert "kl_eta (Fig. 15): 15 runs" in out and re.search(r"\d+ of \d+ claims agree, \d of 9 metrics in band", out)
