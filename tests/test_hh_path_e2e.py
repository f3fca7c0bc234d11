"""The real data path: HH-RLHF prompts and Hugging Face models from local directories."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import keys, tracking
from harness.config import ConfigError, load_config
from harness.train import train

from helpers import HH, hh_tokenizer, sqlite_uri, store_uri

needs_shared = pytest.mark.skipif(not HH.is_file(), reason=f"{HH} not present")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A word-level tokenizer trained on HH text, and tiny GPT-2 policy/SFT/RM saved like any HF model."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("hf")
    tok = hh_tokenizer(300, 600)
    torch.manual_seed(0)
    c = GPT2Config(vocab_size=len(tok), n_positions=96, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                   attn_pdrop=0.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    for name, cls in [("sft", GPT2LMHeadModel), ("rm", GPT2ForSequenceClassification), ("critic", GPT2ForSequenceClassification)]:
        c.num_labels = 1
        cls(c).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def hh_config(hf_dirs: Path, tmp_path: Path, over: dict[str, object]):
    """A small HH-RLHF run on the local HF models, its store and run folders in tmp_path, with `over`
    (dotted keys) on top."""
    base = {
        "data.source": "hh_rlhf", "data.hh_path": str(HH), "data.max_prompt_tokens": 48,
        "model.sft_path": str(hf_dirs / "sft"), "model.pretrained_path": str(hf_dirs / "sft"),
        "model.reward_path": str(hf_dirs / "rm"), "model.critic_path": str(hf_dirs / "critic"),
        "ppo.rollout_batch_size": 4, "ppo.ppo_epochs": 1, "logging.tracking_uri": store_uri(tmp_path),
        "logging.output_dir": str(tmp_path / "runs"), "logging.progress": False, "threads": 1,
    }
    return load_config(None, [f"{k}={v}" for k, v in {**base, **over}.items()])


@needs_shared
def test_hh_prompts_with_local_hf_models(hf_dirs, tmp_path):
    cfg = hh_config(hf_dirs, tmp_path, {"data.eval_prompts": 8, "ppo.steps": 2, "ppo.num_minibatches": 2,
                                        "generation.max_new_tokens": 8, "logging.eval_every": 2})
    res = train(cfg)
    assert res.status == "FINISHED", res.error
    r = tracking.client(cfg.logging.tracking_uri).get_run(res.run_id)
    assert keys.RM_SCORE in r.data.metrics and keys.EVAL_RM in r.data.metrics
    assert keys.GOLD_SCORE not in r.data.metrics  # HH-RLHF has no hidden gold reward
    rows = tracking.load_json_artifact(cfg.logging.tracking_uri, res.run_id, "samples/step_000002.json")["rows"]
    assert rows[0]["prompt"].rstrip().endswith("Assistant:")  # prompts end at the last assistant turn


def test_missing_model_dir_fails_before_training_with_the_field_named(tmp_path):
    hh = tmp_path / "hh.jsonl"  # a valid two-line file: only the model folder is wrong
    hh.write_text("".join(json.dumps({"chosen": f"\n\nHuman: q{i}?\n\nAssistant: yes {i}",
                                      "rejected": f"\n\nHuman: q{i}?\n\nAssistant: no {i}"}) + "\n" for i in range(2)))
    cfg = load_config(None, ["data.source=hh_rlhf", f"data.hh_path={hh}", f"model.sft_path={tmp_path}/nope/",
                             f"logging.tracking_uri={sqlite_uri(tmp_path / 'm.db')}", f"logging.output_dir={tmp_path}", "logging.progress=false"])
    with pytest.raises(ConfigError, match=r"model\.sft_path: '.*nope/' is not a directory"):  # preflight, before any run
        train(cfg)
    assert not (tmp_path / "m.db").exists()


@needs_shared
def test_without_gold_the_warning_is_the_flag_and_stops_the_run(hf_dirs, tmp_path):
    """A run without gold (HH-RLHF, Hugging Face models) still trains and logs the early warning; the
    warning is its collapse flag, so stop_on_collapse acts on it (issue 24)."""
    import dataclasses
    import json

    from harness.detector import DetectorParams

    always = tmp_path / "always.json"  # a detector whose score is 0.993 from its first window on
    always.write_text(json.dumps(dataclasses.asdict(DetectorParams(
        features=["kl"], mean=[0.0], scale=[1.0], coef=[0.0], intercept=5.0, threshold=0.5))))
    cfg = hh_config(hf_dirs, tmp_path, {
        "data.eval_prompts": 0, "ppo.steps": 30, "ppo.num_minibatches": 1, "generation.max_new_tokens": 4,
        "logging.eval_every": 0, "logging.sample_every": 0, "logging.checkpoint_every": 0,
        "collapse.detector": str(always), "collapse.stop_on_collapse": True})
    res = train(cfg)
    assert res.status == "FINISHED", res.error
    # the first score at step 15 (5 start steps + a 10-step window), three in a row: warned at 17, stopped there
    assert res.collapsed and res.collapse_step == 17 and res.steps_done == 17
    c = tracking.client(cfg.logging.tracking_uri)
    tags = c.get_run(res.run_id).data.tags
    assert tags[keys.TAG_COLLAPSED] == "true" and "detector" in tags[keys.TAG_COLLAPSE_REASON]
    assert tags[keys.TAG_STOPPED] == "collapse"
    assert [m.step for m in c.get_metric_history(res.run_id, keys.WARNING)] == [15, 16, 17]
    assert [(m.step, m.value) for m in c.get_metric_history(res.run_id, keys.WARNING_STEP)] == [(17, 17.0)]
    assert not c.get_metric_history(res.run_id, keys.GOLD_ONSET)
