"""The embedded world: tiny builds, determinism, caching, atomicity, the gold reward, the RM.

Worlds here use `TINY` (seconds) or `MICRO` (tests/helpers.py: a fraction of that, for the bookkeeping tests); MLflow
logging goes to a real sqlite store under tmp_path and is read back.
"""
from __future__ import annotations

import hashlib
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from harness import keys, tracking
from harness.config import ConfigError
from harness.world import (
    TINY,
    World,
    WorldError,
    build_world,
    corpus,
    gold_reward,
    load_world,
    load_world_config,
    world_config_hash,
)
from harness.world import __main__ as cli
from harness.world.build import INFO_FILE
from harness.world.config import TaskConfig
from harness.world.gold import gold_breakdown
from harness.world.load import WORLD_FILE
from harness.world.preferences import bt_label
from harness.world.reward_model import score_diffs

from helpers import MICRO, store_uri


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    """One real sqlite MLflow store for the module (creating one costs seconds); each test that
    counts runs logs to an experiment of its own."""
    return store_uri(tmp_path_factory.mktemp('mlflow'))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, uri):
    """One tiny world, logged to MLflow, shared by the tests that read what it learned."""
    tmp = tmp_path_factory.mktemp("tiny")
    cfg = load_world_config(overrides=TINY)
    out = build_world(cfg, tmp / "world", tracking_uri=uri, progress=False, tags={"purpose": "test"})
    return {"dir": out, "uri": uri, "cfg": cfg}


def _digests(d: Path) -> dict[str, str]:
    """sha256 of every file of a world, except the one that records timings and run ids."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*")) if p.is_file() and p.name != INFO_FILE
    }


# --------------------------------------------------------------------------------------------
# The built world
# --------------------------------------------------------------------------------------------
def test_reading_a_world_imports_no_torch(tiny):
    """What only reads a world (a runner resolving `world:` paths before any run, analysis, reports) loads it
    without the builder's torch, transformers and GPT-2 (harness.world.load): seconds of a core per process."""
    code = (f"import sys; from harness.world import load_world; w = load_world({str(tiny['dir'])!r}); "
            "print(w.sft_dir.is_dir(), sorted({'torch', 'transformers', 'mlflow'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True []", out.stderr


def test_tiny_world_has_the_contract_layout(tiny):
    w = load_world(tiny["dir"])
    assert isinstance(w, World) and w.config_hash == world_config_hash(tiny["cfg"])
    for d in (w.tokenizer_dir, w.sft_dir, w.pretrained_dir, w.reward_dir):
        assert (d / "tokenizer.json").is_file(), d  # the tokenizer travels with every model
    assert len(w.train_prompts) > 100 and len(w.eval_prompts) > 20
    assert not set(w.train_prompts) & set(w.eval_prompts)
    assert {p for p, _ in w.sft_pairs} <= set(w.train_prompts)  # SFT never sees eval prompts
    assert len(w.sft_pairs) == tiny["cfg"].corpus.sft_examples

    sft = GPT2LMHeadModel.from_pretrained(w.sft_dir)
    pre = GPT2LMHeadModel.from_pretrained(w.pretrained_dir)
    rm = GPT2ForSequenceClassification.from_pretrained(w.reward_dir)
    assert sft.config.resid_pdrop == sft.config.attn_pdrop == sft.config.embd_pdrop == 0.0
    assert rm.config.num_labels == 1 and rm.config.pad_token_id is not None
    # SFT really moved away from the pretrained weights.
    assert not torch.equal(sft.transformer.h[0].mlp.c_fc.weight, pre.transformer.h[0].mlp.c_fc.weight)


def test_token_format_matches_the_contract(tiny):
    from transformers import AutoTokenizer

    w = load_world(tiny["dir"])
    tok = AutoTokenizer.from_pretrained(w.sft_dir)
    assert tok.pad_token_id is not None and tok.eos_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id
    prompt, response = w.sft_pairs[0]
    ids = tok(prompt)["input_ids"]
    assert tok.eos_token_id not in ids and tok.pad_token_id not in ids  # no special tokens added
    assert tok.decode(ids) == prompt
    resp = tok(response)["input_ids"]
    assert tok.decode(ids + resp + [tok.eos_token_id], skip_special_tokens=True) == f"{prompt} {response}"
    # The SFT model learned to end reviews: EOS is likely right after a finished review.
    sft = GPT2LMHeadModel.from_pretrained(w.sft_dir)
    with torch.no_grad():
        logits = sft(torch.tensor([ids + resp])).logits[0, -1]
    assert torch.softmax(logits, -1)[tok.eos_token_id] > 0.2


def test_reward_model_beats_chance_on_held_out_pairs(tiny):
    w = load_world(tiny["dir"])
    m = w.metrics
    # Logged numbers: above chance, and no better than the noisy labels allow (plus slack).
    assert m[keys.RM_EVAL_ACC] > 0.58, m
    assert m[keys.RM_EVAL_ACC_GOLD] > 0.6, m
    assert m[keys.RM_EVAL_ACC] <= m[keys.RM_LABEL_CEILING] + 0.05, m
    # Recompute from the saved RM through the public token format: the RM on disk is the one
    # that was measured, and it scores the last non-pad token.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(w.reward_dir)
    rm = GPT2ForSequenceClassification.from_pretrained(w.reward_dir).eval()
    enc = []
    for p in w.preference_pairs("eval"):
        c = tok(p.prompt)["input_ids"] + tok(p.chosen)["input_ids"] + ([tok.eos_token_id] if p.chosen_ended else [])
        r = tok(p.prompt)["input_ids"] + tok(p.rejected)["input_ids"] + ([tok.eos_token_id] if p.rejected_ended else [])
        enc.append((c, r))
    diffs = score_diffs(rm, enc, tok.pad_token_id)
    acc = sum(d > 0 for d in diffs) / len(diffs)
    assert acc == pytest.approx(m[keys.RM_EVAL_ACC], abs=0.01)


def test_world_run_is_logged_to_mlflow_and_reads_back(tiny):
    uri = tiny["uri"]
    c = tracking.client(uri)
    exp = c.get_experiment_by_name("world")
    runs = c.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags[keys.TAG_ROLE] == "world" and run.data.tags["purpose"] == "test"
    assert run.data.tags[keys.TAG_CONFIG_HASH] == world_config_hash(tiny["cfg"])
    assert run.data.params["rm.steps"] == str(tiny["cfg"].rm.steps)
    rm_cfg = tiny["cfg"].rm
    expected_steps = sorted({0, *range(rm_cfg.eval_every, rm_cfg.steps + 1, rm_cfg.eval_every), rm_cfg.steps})
    for key in (keys.RM_TRAIN_ACC, keys.RM_EVAL_ACC, keys.RM_TRAIN_LOSS):
        hist = tracking.metric_history(uri, run.info.run_id, key)
        assert sorted(s for s, _ in hist) == expected_steps, key
    loss = dict(tracking.metric_history(uri, run.info.run_id, keys.RM_TRAIN_LOSS))
    assert loss[rm_cfg.steps] < loss[0]  # the RM learned something
    final_eval = dict(tracking.metric_history(uri, run.info.run_id, keys.RM_EVAL_ACC))[rm_cfg.steps]
    assert final_eval == pytest.approx(load_world(tiny["dir"]).metrics[keys.RM_EVAL_ACC], abs=1e-6)
    assert run.data.metrics[keys.RM_LABEL_CEILING] > 0.5 and run.data.metrics[keys.WORLD_BUILD_S] > 0
    diff = tracking.load_json_artifact(uri, run.info.run_id, keys.RM_SCORE_DIFF)["diff"]
    assert len(diff) == tiny["cfg"].prefs.eval_pairs
    assert sum(d > 0 for d in diff) / len(diff) == pytest.approx(final_eval, abs=1e-6)


# --------------------------------------------------------------------------------------------
# Determinism, caching, atomic writes
# --------------------------------------------------------------------------------------------
def test_same_seed_gives_identical_worlds_and_another_seed_does_not(tmp_path):
    cfg = load_world_config(overrides=MICRO)
    a = build_world(cfg, tmp_path / "a", progress=False)
    b = build_world(cfg, tmp_path / "b", progress=False)
    da, db = _digests(a), _digests(b)
    assert "sft/model.safetensors" in da and "reward/model.safetensors" in da
    assert da == db
    c = build_world(load_world_config(overrides={**MICRO, "seed": 1}), tmp_path / "c", progress=False)
    dc = _digests(c)
    for f in ("sft/model.safetensors", "reward/model.safetensors", "data/prefs_train.jsonl"):
        assert dc[f] != da[f], f


def test_cache_is_reused_and_a_config_change_rebuilds(tmp_path, uri):
    cfg = load_world_config(overrides=MICRO)
    log = dict(tracking_uri=uri, experiment="world-cache", progress=False)
    out = build_world(cfg, tmp_path / "w", **log)
    stamp = (out / WORLD_FILE).stat().st_mtime_ns
    assert build_world(cfg, tmp_path / "w", **log) == out
    assert (out / WORLD_FILE).stat().st_mtime_ns == stamp  # not rebuilt
    exp = tracking.client(uri).get_experiment_by_name("world-cache").experiment_id
    assert len(tracking.client(uri).search_runs([exp])) == 1  # and not logged again

    changed = load_world_config(overrides={**MICRO, "prefs.label_noise": 0.0})
    build_world(changed, tmp_path / "w", **log)
    w = load_world(out)
    assert w.config_hash == world_config_hash(changed) != world_config_hash(cfg)
    assert (out / WORLD_FILE).stat().st_mtime_ns != stamp
    assert len(tracking.client(uri).search_runs([exp])) == 2
    # With noiseless labels every label follows the gold order (ties go either way).
    pairs = w.preference_pairs("train") + w.preference_pairs("eval")
    assert all(p.gold_chosen >= p.gold_rejected for p in pairs)
    assert any(p.gold_chosen > p.gold_rejected for p in pairs)
    assert not list(tmp_path.glob(".w.*-*"))  # no temp or old folders left behind


def test_a_failed_build_leaves_the_old_world_and_no_half_world(tmp_path, monkeypatch, uri):
    import harness.world.build as wb

    cfg = load_world_config(overrides=MICRO)
    out = build_world(cfg, tmp_path / "w", progress=False)
    before = _digests(out)

    def boom(*a, **k):
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(wb, "train_reward_model", boom)
    other = load_world_config(overrides={**MICRO, "seed": 7})
    with pytest.raises(RuntimeError, match="killed mid-build"):
        build_world(other, tmp_path / "w", tracking_uri=uri, experiment="world-fail", progress=False)
    assert _digests(out) == before and load_world(out).config_hash == world_config_hash(cfg)
    assert not list(tmp_path.glob(".w.building-*"))
    with pytest.raises(RuntimeError):
        build_world(other, tmp_path / "fresh", progress=False)
    assert not (tmp_path / "fresh").exists()
    runs = tracking.client(uri).search_runs([tracking.client(uri).get_experiment_by_name("world-fail").experiment_id])
    assert len(runs) == 1
    assert runs[0].info.status == "FAILED" and "killed mid-build" in runs[0].data.tags[keys.TAG_FAILURE]


def test_load_world_and_build_refuse_foreign_folders(tmp_path):
    with pytest.raises(WorldError, match="python -m harness.world build"):
        load_world(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(WorldError, match="not empty"):
        build_world(load_world_config(overrides=MICRO), tmp_path / "mine", progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# --------------------------------------------------------------------------------------------
# The gold reward
# --------------------------------------------------------------------------------------------
PROMPT = "review of the pasta :"
NORMAL = "the pasta was delicious . the staff was friendly ."


def test_gold_penalizes_repetition_rambling_and_broken_grammar():
    repeated = "the pasta was delicious delicious delicious delicious delicious delicious ."
    repeated_sentence = "the pasta was delicious . the pasta was delicious . the pasta was delicious ."
    ramble = ("the pasta was delicious . the staff was friendly . the place was cozy . i loved the cake . "
              "five stars . the view was")  # ran into the cap mid-sentence
    salad = "friendly was the . delicious pasta the was ."
    off_topic = "the cake was delicious . the staff was friendly ."
    g = dict(zip(["normal", "repeated", "repeated_sentence", "ramble", "salad", "off_topic"],
                 gold_reward([PROMPT] * 6, [NORMAL, repeated, repeated_sentence, ramble, salad, off_topic],
                             [True, True, True, False, True, True])))
    for bad in ("repeated", "repeated_sentence", "ramble", "salad", "off_topic"):
        assert g["normal"] > g[bad] + 0.5, (bad, g)
    assert all(-3 < v < 3 for v in g.values())
    # The same ramble, had it ended, is not punished for ending: the cap is what costs.
    assert gold_reward([PROMPT], [ramble.rsplit(" the view", 1)[0]], [True])[0] > g["ramble"] + 0.5
    # Praise beats complaint; a class-mismatched adjective is broken grammar.
    assert gold_reward([PROMPT], ["the pasta was bland . the staff was rude ."], [True])[0] < -1
    assert gold_breakdown("the waiter was", "delicious .", True).bad_grammar == 1.0
    assert gold_breakdown("the waiter was", "friendly .", True).bad_grammar == 0.0


def test_gold_infers_ended_from_the_text_and_checks_lengths():
    assert gold_reward([PROMPT], [NORMAL]) == gold_reward([PROMPT], [NORMAL], [True])
    assert gold_reward([PROMPT], ["the pasta was"]) == gold_reward([PROMPT], ["the pasta was"], [False])
    with pytest.raises(ValueError, match="2 prompts and 1 responses"):
        gold_reward([PROMPT, PROMPT], [NORMAL])


def test_sft_style_reviews_score_near_zero_and_are_grammatical():
    rng = random.Random(0)
    task = TaskConfig()
    train, _ = corpus.split_prompts(rng, task)
    pairs = corpus.sft_pairs(rng, train, 2000, task)
    golds = gold_reward([p for p, _ in pairs], [r for _, r in pairs], [True] * len(pairs))
    assert abs(statistics.mean(golds)) < 0.4
    assert statistics.pstdev(golds) > 0.7  # varied enough for preferences to mean something
    ok = [gold_breakdown(p, r, True).bad_grammar == 0 for p, r in pairs[:300]]
    assert all(ok)  # the generator only writes sentences its own parser accepts


def test_bradley_terry_labels_follow_the_gold_order_as_noise_vanishes():
    rng = random.Random(0)
    assert all(bt_label(rng, 1.0, 0.0, 0.0)[0] for _ in range(50))
    wins = sum(bt_label(rng, 1.0, 0.0, 0.5)[0] for _ in range(2000)) / 2000
    assert wins == pytest.approx(1 / (1 + 2.718281828 ** -2), abs=0.04)
    wins = sum(bt_label(rng, 1.0, 0.0, 100.0)[0] for _ in range(2000)) / 2000
    assert wins == pytest.approx(0.5, abs=0.05)


# --------------------------------------------------------------------------------------------
# Config and CLI
# --------------------------------------------------------------------------------------------
def test_config_errors_name_field_value_and_allowed():
    with pytest.raises(ConfigError) as e:
        load_world_config(overrides={"rm.stepz": 3, "prefs.label_noise": -1, "model.n_layer": 0})
    msg = str(e.value)
    assert "rm.stepz: unknown key; did you mean rm.steps?" in msg
    assert "prefs.label_noise: got -1; allowed: a number >= 0" in msg
    assert "model.n_layer: got 0" in msg
    with pytest.raises(ConfigError, match="model.n_embd: got 130; allowed: a multiple of model.n_head=4"):
        load_world_config(overrides={"model.n_embd": 130})
    with pytest.raises(ConfigError, match="model.n_positions: got 16"):
        load_world_config(overrides={"model.n_positions": 16})


def test_cli_help_lists_fields_and_build_uses_overrides(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["build", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--tracking-uri" in out and "prefs.label_noise" in out and "Bradley-Terry" in out
    code = cli.main(["build", "--out", str(tmp_path / "w"), "--tracking-uri", "none", "--quiet",
                     *[f"--set={k}={v}" for k, v in MICRO.items()], "--set", "seed=3"])
    assert code == 0
    assert load_world(tmp_path / "w").config.seed == 3
    assert cli.main(["build", "--out", str(tmp_path / "x"), "--set", "rm.stepz=1", "--quiet"]) == 2
    assert "did you mean rm.steps" in capsys.readouterr().err


def test_the_world_does_not_depend_on_the_callers_thread_count(tmp_path):
    """Same machine, 1 or 2 torch threads in the caller: byte-identical weights and data."""
    import hashlib

    import torch

    def digest(root):
        return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
                for f in sorted(root.rglob("*")) if f.is_file() and f.name != "build_info.json"}

    before = torch.get_num_threads()
    built = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            built.append(digest(build_world(load_world_config(overrides=MICRO), tmp_path / f"t{n}", progress=False)))
    finally:
        torch.set_num_threads(before)
    assert built[0] == built[1]
    assert any(k.endswith(".safetensors") for k in built[0])
