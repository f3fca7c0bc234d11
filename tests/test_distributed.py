"""Multi-rank training on CPU (gloo): plain data parallel and DeepSpeed ZeRO-2 / ZeRO-3 against the
same trainer in one plain process (no DeepSpeed) on the same global batch, plus the hardware
validation that runs before any model.

Tiny GPT-2 policy / reward model (2 layers, width 32) and a word-level tokenizer are built from
fixed seeds in a temp dir; the prompt source is a small synthetic one with a gold reward, swapped
in for `harness.data.load_source` inside the worker processes (so the gold path is exercised too).

Two jobs (40-90 s in all on 2 busy cores; most of it is importing torch, transformers,
DeepSpeed and MLflow in each process):
  A  `launch_train` -> torchrun, 2 ranks. The worker first runs, in-process, DeepSpeed ZeRO-2
     (stopped by an on_step callback after step 2 of 3), ZeRO-3 with gradient accumulation 2, and
     plain data parallel with one minibatch and old log-probs from sampling ("ddp1"), and critic-free
     GRPO with 2 samples per prompt ("grpo2"); then
     `harness.train.main` (the CLI path) for a plain data-parallel run without DeepSpeed
     (gradients all-reduced by hand), whose steps launch_train feeds to an on_step callback by
     polling MLflow.
  B  one process: the reference run (plain torch, no process group, 3 steps); then DeepSpeed at
     world size 1: the 2-rank ZeRO-2 run resumed from its checkpoint for step 3; a ZeRO-3 run
     stopped after step 1 and resumed (loading into ZeRO-3); the 2-rank ZeRO-3 checkpoint loaded
     into a plain single-process PPOTrainer; last the plain one-process references of "ddp1" and "grpo2".

Checks: identical sampled responses at every step (keyed sampling: a row's tokens do not depend on
the rank or batch neighbours), metrics within rel 1e-3 / abs 1e-4 of the one-rank run (float
summation order differs; measured differences are ~1e-6), one MLflow run per training, and
checkpoints that reload across world sizes and stages (weights within 1e-4 of the one-rank run's;
loading into ZeRO restores the AdamW moments too, so resumed runs match the uninterrupted one).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from harness import keys
from harness.config import ConfigError, load_config

from helpers import sqlite_uri, store_uri

WORDS = ("the pasta soup curry salad bread was is very quite good bad great awful tasty bland and but "
         "i liked hated it . review of").split()
SPECIALS = ["[PAD]", "[UNK]", "[EOS]"]
RTOL, ATOL = 1e-3, 1e-4
# perf/*: wall-clock. val/clipfrac counts tokens where (clip(V, V_old +- d) - R)^2 > (V - R)^2; while
# |V - V_old| < d both sides are the same number up to one rounding, so on the first minibatch (V ==
# V_old up to batch-shape round-off) the count is float noise in any two runs that batch differently.
SKIP_METRICS = ("perf/", "val/clipfrac")


# ------------------------------------------------------------------------------------------------
# tiny models, a prompt source, a worker script
# ------------------------------------------------------------------------------------------------
def build_tiny_models(root: Path) -> dict[str, str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")
    pad, eos = vocab["[PAD]"], vocab["[EOS]"]
    kw = dict(vocab_size=len(vocab), n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=eos, eos_token_id=eos,
              pad_token_id=pad, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    sft = GPT2LMHeadModel(GPT2Config(**kw))
    with torch.no_grad():  # make EOS likely enough that some responses end early
        sft.transformer.wte.weight[eos] += 0.3 * sft.transformer.ln_f.bias.new_ones(kw["n_embd"])
        sft.transformer.ln_f.bias += 0.3
    rm = GPT2ForSequenceClassification(GPT2Config(num_labels=1, **kw))
    out = {}
    for name, model in (("sft", sft), ("reward", rm)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def tiny_source_spec(seed: int = 0) -> dict:
    import random

    rng = random.Random(seed)
    dishes = ["pasta", "soup", "curry", "salad", "bread"]

    def prompt() -> str:
        d = rng.choice(dishes)
        return " ".join(rng.choice([["review", "of", "the", d], ["the", d, "was"], ["i", "liked", "the", d, "but"], [d]]))

    train = [prompt() for _ in range(40)]
    evals = [prompt() for _ in range(5)]  # 5: shards unevenly over 2 ranks
    sft = [(p, " ".join(rng.choice(WORDS[:20]) for _ in range(rng.randint(2, 6)))) for p in train[:16]]
    return {"train": train, "eval": evals, "sft": sft}


WORKER = textwrap.dedent('''
    """Test worker: swaps in the tiny prompt source, then runs jobs (or the CLI) in this rank."""
    import json, os, sys
    spec = json.load(open(sys.argv[1]))
    import harness.data
    from harness.data import PromptSource

    def gold(prompts, responses, ended=None):
        return [sum(w in ("good", "great", "tasty") for w in r.split()) - 0.1 * len(r.split()) for r in responses]

    def load_source(cfg):
        s = spec["source"]
        return PromptSource(list(s["train"]), list(s["eval"])[: cfg.data.eval_prompts], [tuple(x) for x in s["sft"]], gold)

    harness.data.load_source = load_source
    import torch.distributed as dist
    from harness import parallel
    from harness.train import main, train
    from harness.config import load_config

    out = []
    for job in spec.get("jobs", []):
        if job.get("kind") == "load_plain":  # a distributed checkpoint into a plain single-process trainer
            import torch
            from harness.models import Models
            from harness.trainer import PPOTrainer
            from harness.train import load_checkpoint
            from pathlib import Path
            cfg = load_config(None, job["overrides"])
            state = load_checkpoint(Path(job["run_dir"]))
            tr = PPOTrainer(cfg, Models(cfg, torch.device("cpu")), load_source(cfg), torch.device("cpu"))
            tr.load_state_dict(state)
            ref = load_checkpoint(Path(job["compare_dir"]))
            diff = max((tr.m.policy.state_dict()[k] - v).abs().max().item() for k, v in ref["policy"].items())
            cdiff = max((tr.m.critic.state_dict()[k] - v).abs().max().item() for k, v in ref["critic"].items())
            adiff = max((tr.policy.opt.state_dict()["state"][i]["exp_avg"] - v["exp_avg"]).abs().max().item()
                        for i, v in ref["policy_opt"]["state"].items())
            out.append({"kind": "load_plain", "policy_diff": diff, "critic_diff": cdiff, "exp_avg_diff": adiff,
                        "n_opt_state": len(tr.policy.opt.state_dict()["state"])})
            continue
        cfg = load_config(None, job["overrides"])
        stop = job.get("stop_at")
        r = train(cfg, resume=job.get("resume", False), on_step=(lambda s, m: stop is not None and s >= stop))
        out.append({"run_id": r.run_id, "status": r.status, "steps": r.steps_done, "error": r.error,
                    "world": dist.get_world_size() if dist.is_initialized() else 1})
    if int(os.environ.get("RANK", "0")) == 0:
        json.dump(out, open(spec["out"], "w"))
    if "cli" in spec:  # then the CLI, argv after "--" (launch_train appends the config path)
        sys.exit(main(spec["cli"] + (sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else [])))
    parallel.teardown()
''')


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    paths = build_tiny_models(root / "models")
    (root / "worker.py").write_text(WORKER)
    (root / "unused.jsonl").write_text("")
    return {"root": root, "models": paths, "worker": str(root / "worker.py"), "source": tiny_source_spec()}


def overrides(tiny, name: str, **extra) -> list[str]:
    root = tiny["root"]
    base = {
        "seed": 3,
        "model.sft_path": tiny["models"]["sft"], "model.reward_path": tiny["models"]["reward"],
        "model.pretrained_path": tiny["models"]["sft"],
        # the worker swaps in the tiny prompt source; preflight still wants the configured data file to exist
        "data.source": "hh_rlhf", "data.hh_path": str(root / "unused.jsonl"), "data.eval_prompts": 5,
        "generation.max_new_tokens": 8, "generation.temperature": 0.9, "generation.top_k": 20,
        "ppo.steps": 3, "ppo.rollout_batch_size": 8, "ppo.num_minibatches": 2, "ppo.ppo_epochs": 2,
        "ppo.policy_lr": 3e-3, "ppo.critic_lr": 3e-3, "ppo.entropy_coef": 0.01, "ppo.ptx_coef": 0.1, "ppo.ptx_batch_size": 4,
        "logging.tracking_uri": store_uri(root), "logging.experiment": "dist",
        "logging.output_dir": str(root / "runs"), "logging.run_name": name,
        "logging.eval_every": 2, "logging.sample_every": 1, "logging.num_samples": 8, "logging.checkpoint_every": 0,
        "logging.progress": False, "collapse.enabled": True,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def run_job(cmd: list[str], env_extra: dict | None = None, timeout: int = 600) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env_extra or {})}
    env.pop("WORLD_SIZE", None)
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=Path(__file__).resolve().parents[1])
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"job failed ({p.returncode}) after {time.time() - t:.0f}s:\n{out[-6000:]}"
    return out


def write_spec(tiny, name: str, spec: dict) -> Path:
    spec = {"source": tiny["source"], "out": str(tiny["root"] / f"{name}.out.json"), **spec}
    p = tiny["root"] / f"{name}.spec.json"
    p.write_text(json.dumps(spec))
    return p


# ------------------------------------------------------------------------------------------------
# reading runs back
# ------------------------------------------------------------------------------------------------
def client(tiny):
    from harness import tracking

    return tracking.client(store_uri(tiny["root"]))


def runs_named(tiny, name: str):
    c = client(tiny)
    exp = c.get_experiment_by_name("dist")
    return c.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")


def history(tiny, run_id: str) -> dict[int, dict[str, float]]:
    c = client(tiny)
    run = c.get_run(run_id)
    out: dict[int, dict[str, float]] = {}
    for k in run.data.metrics:
        if k.startswith(SKIP_METRICS):
            continue
        for m in c.get_metric_history(run_id, k):
            out.setdefault(m.step, {})[k] = m.value
    return out


def samples(tiny, run_id: str, step: int) -> list[tuple[str, str]]:
    from harness import tracking

    rows = tracking.load_json_artifact(store_uri(tiny["root"]), run_id, f"{keys.SAMPLES_DIR}/step_{step:06d}.json")["rows"]
    return [(r["prompt"], r["response"]) for r in rows]


def assert_metrics_close(ref: dict, got: dict, steps, label: str) -> None:
    bad = []
    for s in steps:
        for k, v in ref[s].items():
            if k not in got[s]:
                bad.append(f"step {s} {k}: missing")
                continue
            if not math.isclose(got[s][k], v, rel_tol=RTOL, abs_tol=ATOL):
                bad.append(f"step {s} {k}: 1-rank {v:.6g} vs {label} {got[s][k]:.6g}")
    assert not bad, f"{label} differs from the one-rank run:\n" + "\n".join(bad[:30])


# ------------------------------------------------------------------------------------------------
# the multi-rank runs (one module-scoped fixture: jobs A, B, C run once)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jobs(tiny):
    from harness.launch import launch_train

    timings = {}
    ds = {"distributed.deepspeed": "true"}
    z2 = overrides(tiny, "z2", **ds, **{"distributed.zero_stage": 2})
    z3 = overrides(tiny, "z3", **ds, **{"distributed.zero_stage": 3, "distributed.gradient_accumulation": 2})
    ref = overrides(tiny, "ref")  # plain torch, one process: the reference every multi-rank run must match
    z3b = overrides(tiny, "z3b", **ds, **{"distributed.zero_stage": 3, "distributed.gradient_accumulation": 2})
    # one minibatch, old log-probs from sampling: the first epoch reuses the scoring pass's critic forward
    one = {"ppo.num_minibatches": 1, "ppo.reuse_rollout_logprobs": "true"}
    ddp1, ref1 = overrides(tiny, "ddp1", **one), overrides(tiny, "ref1", **one)
    # critic-free GRPO, 2 samples per prompt: groups straddle no rank (rows 0-3 / 4-7 of each minibatch)
    grpo = {"ppo.adv_estimator": "grpo", "generation.samples_per_prompt": 2}
    grpo2, grpo1 = overrides(tiny, "grpo2", **grpo), overrides(tiny, "grpo1", **grpo)
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    # A: one torchrun job of 2 ranks runs ZeRO-2 and ZeRO-3 in-process, then the CLI (`main`) for a
    # plain data-parallel run started through launch_train (one launch: imports cost most here)
    t = time.time()
    seen: list[int] = []
    a_jobs = [{"overrides": z2, "stop_at": 2}, {"overrides": z3}, {"overrides": ddp1}, {"overrides": grpo2}]
    spec_a = write_spec(tiny, "A", {"jobs": a_jobs, "cli": []})
    res_ddp = launch_train(overrides=overrides(tiny, "ddp"), nproc=2, program=[tiny["worker"], str(spec_a), "--"],
                           on_step=lambda s, m: seen.append(s) and False, poll_s=0.5, env=env)
    timings["A (2 ranks: ZeRO-2, ZeRO-3, plain DDP via launch_train)"] = time.time() - t
    assert res_ddp.status == "FINISHED", (res_ddp.error or "") + (Path(res_ddp.run_dir) / "launch.log").read_text()[-6000:]

    # B: one process (the plain reference first, before DeepSpeed makes a process group)
    t = time.time()
    spec_b = write_spec(tiny, "B", {"jobs": [
        {"overrides": ref},
        {"overrides": z2, "resume": True},  # the 2-rank ZeRO-2 run, step 3, on one rank
        {"overrides": z3b, "stop_at": 1}, {"overrides": z3b, "resume": True},  # reload into ZeRO-3
        {"kind": "load_plain", "overrides": overrides(tiny, "plain"), "run_dir": str(tiny["root"] / "runs" / "z3"),
         "compare_dir": str(tiny["root"] / "runs" / "ref")},
        {"overrides": ref1},
        {"overrides": grpo1},
    ]})
    run_job([sys.executable, tiny["worker"], str(spec_b)], env)
    timings["B (1 rank: reference, resumes, plain load)"] = time.time() - t
    print("\n".join(f"  {k}: {v:.1f}s" for k, v in timings.items()))
    out = {"A": json.loads((tiny["root"] / "A.out.json").read_text()), "B": json.loads((tiny["root"] / "B.out.json").read_text()),
           "C": res_ddp, "C_seen": seen, "timings": timings}
    print("  checkpoint reload:", out["B"][-1])
    return out


def test_jobs_finish_with_one_mlflow_run_each(tiny, jobs):
    a_z2, a_z3, a_ddp1, _ = jobs["A"]
    b_ref, b_resume, b_z3a, b_z3b, b_load, b_ref1, _ = jobs["B"]
    assert a_z2["status"] == "FINISHED" and a_z2["steps"] == 2 and a_z2["world"] == 2, a_z2
    assert a_z3["status"] == "FINISHED" and a_z3["steps"] == 3, a_z3
    assert b_ref["status"] == "FINISHED" and b_ref["world"] == 1, b_ref
    assert b_resume["status"] == "FINISHED" and b_resume["steps"] == 3 and b_resume["run_id"] == a_z2["run_id"], b_resume
    assert b_z3a["steps"] == 1 and b_z3b["status"] == "FINISHED" and b_z3b["steps"] == 3 and b_z3b["run_id"] == b_z3a["run_id"]
    assert jobs["C"].status == "FINISHED", jobs["C"].error
    assert a_ddp1["status"] == "FINISHED" and a_ddp1["world"] == 2 and b_ref1["status"] == "FINISHED", (a_ddp1, b_ref1)
    for name in ("z2", "z3", "ref", "ddp", "z3b", "ddp1", "ref1", "grpo2", "grpo1"):
        runs = runs_named(tiny, name)
        assert len(runs) == 1, f"{name}: {len(runs)} MLflow runs (one per training expected, logged by rank 0 only)"
        assert runs[0].info.status == "FINISHED"
    # the 2-rank ZeRO-2 run, stopped at step 2 and resumed by a 1-rank job, has one history 1..3
    h = history(tiny, a_z2["run_id"])
    assert sorted(s for s in h if s > 0) == [1, 2, 3]
    assert runs_named(tiny, "z2")[0].data.tags.get(keys.TAG_STOPPED) == "callback"


def test_two_ranks_sample_the_same_rollouts_as_one_rank(tiny, jobs):
    ref_id = jobs["B"][0]["run_id"]
    for label, ref_id_, run_id in (("ZeRO-2", ref_id, jobs["A"][0]["run_id"]), ("ZeRO-3", ref_id, jobs["A"][1]["run_id"]),
                                   ("DDP", ref_id, jobs["C"].run_id), ("DDP, one minibatch", jobs["B"][5]["run_id"], jobs["A"][2]["run_id"])):
        for s in (1, 2, 3):
            ref, got = samples(tiny, ref_id_, s), samples(tiny, run_id, s)
            assert got == ref, f"{label} step {s}: rollouts differ from the one-rank run"
    ends = [r for s in (1, 2, 3) for _, r in samples(tiny, ref_id, s)]
    assert len(set(ends)) > 4  # really sampled, not a constant


def test_two_ranks_metrics_match_one_rank(tiny, jobs):
    ref = history(tiny, jobs["B"][0]["run_id"])
    steps = (1, 2, 3)
    assert {keys.PG_LOSS, keys.VF_LOSS, keys.PTX_LOSS, keys.GOLD_SCORE, keys.REWARD_RUNNING_STD, keys.EVAL_WIN_RATE} <= set(ref[2])
    assert_metrics_close(ref, history(tiny, jobs["A"][1]["run_id"]), steps, "2-rank ZeRO-3 (grad. accumulation 2)")
    assert_metrics_close(ref, history(tiny, jobs["A"][0]["run_id"]), steps, "2-rank ZeRO-2 then 1-rank resume")
    assert_metrics_close(ref, history(tiny, jobs["C"].run_id), steps, "2-rank plain data parallel")
    assert_metrics_close(ref, history(tiny, jobs["B"][3]["run_id"]), steps, "1-rank ZeRO-3 stopped at 1 and resumed")
    assert_metrics_close(history(tiny, jobs["B"][5]["run_id"]), history(tiny, jobs["A"][2]["run_id"]), steps,
                         "2-rank plain data parallel, one minibatch, old log-probs from sampling")
    # step 0 = the eval before training (SFT win rate etc.)
    assert_metrics_close(ref, history(tiny, jobs["A"][1]["run_id"]), (0,), "2-rank ZeRO-3 eval")


def test_two_ranks_match_one_rank_with_a_critic_free_estimator(tiny, jobs):
    one, two = jobs["B"][6]["run_id"], jobs["A"][3]["run_id"]
    assert jobs["A"][3]["status"] == "FINISHED" and jobs["B"][6]["status"] == "FINISHED"
    for s in (1, 2, 3):
        assert samples(tiny, one, s) == samples(tiny, two, s), f"GRPO step {s}: rollouts differ"
    ref = history(tiny, one)
    assert keys.PG_LOSS in ref[1] and not [k for k in ref[1] if k.startswith("val/")]
    assert_metrics_close(ref, history(tiny, two), (1, 2, 3), "2-rank plain data parallel, GRPO")


def test_checkpoints_reload_across_world_sizes(tiny, jobs):
    load = jobs["B"][4]
    # ZeRO-3's 2-rank checkpoint, consolidated, loads into a plain PPOTrainer and equals the
    # one-rank run's final weights and AdamW moments (same math, different summation order)
    assert load["policy_diff"] < 1e-4 and load["critic_diff"] < 1e-4 and load["exp_avg_diff"] < 1e-5, load
    assert load["n_opt_state"] > 10
    from harness.train import load_checkpoint

    z3 = load_checkpoint(tiny["root"] / "runs" / "z3")
    assert z3["world_size"] == 2 and z3["policy"]["transformer.wte.weight"].shape[0] == len(SPECIALS + WORDS)
    assert z3["policy"]["lm_head.weight"].shape == z3["policy"]["transformer.wte.weight"].shape


def test_launch_train_feeds_on_step_from_mlflow(tiny, jobs):
    assert jobs["C_seen"] and jobs["C_seen"] == sorted(set(jobs["C_seen"])) and max(jobs["C_seen"]) == 3
    assert keys.RM_SCORE in jobs["C"].final_metrics


# ------------------------------------------------------------------------------------------------
# keyed sampling (in process)
# ------------------------------------------------------------------------------------------------
def _tiny_policy(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny["models"]["sft"]).eval(), AutoTokenizer.from_pretrained(tiny["models"]["sft"])


@pytest.mark.parametrize("fast", [True, False])
def test_keyed_sampling_is_rank_invariant(tiny, fast):
    from harness.rollout import counter_hash, left_pad, sample

    model, tok = _tiny_policy(tiny)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in tiny["source"]["train"][:6]]
    kw = dict(max_new_tokens=8, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=0.9, top_k=20, fast=fast)
    row_keys = counter_hash(3, 1, 0, torch.arange(6))
    ids, mask = left_pad(prompts, tok.pad_token_id, torch.device("cpu"))
    whole = sample(model, ids, mask, row_keys, **kw)
    # the same rows split over "ranks" of 2 and 4 rows, shorter rows padded alike
    halves = [sample(model, ids[a:b], mask[a:b], row_keys[a:b], **kw) for a, b in ((0, 2), (2, 6))]
    for name in ("response_ids", "response_mask", "ended"):
        parts = [getattr(h, name) for h in halves]
        R = getattr(whole, name).shape[1] if getattr(whole, name).dim() > 1 else None
        if R is not None:
            parts = [torch.nn.functional.pad(x, (0, R - x.shape[1]), value=tok.pad_token_id if name == "response_ids" else 0) for x in parts]
        assert torch.equal(torch.cat(parts), getattr(whole, name)), name
    assert not torch.equal(whole.response_ids, sample(model, ids, mask, row_keys + 1, **kw).response_ids)
    # top_k=1 is greedy: every token is the argmax of the model's own next-token logits
    greedy = sample(model, ids, mask, row_keys, **dict(kw, top_k=1))
    with torch.no_grad():
        logits = model(input_ids=greedy.sequences, attention_mask=greedy.attention_mask,
                       position_ids=(greedy.attention_mask.cumsum(1) - 1).clamp(min=0)).logits
    P, m = ids.shape[1], greedy.response_mask.bool()
    assert torch.equal(logits[:, P - 1 : -1].argmax(-1)[m], greedy.response_ids[m])


def test_keyed_sampling_draws_from_the_softmax():
    from harness.rollout import counter_hash, draw, keyed_uniform

    probs = torch.softmax(torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]]), -1).repeat(4000, 1)
    tok = draw(probs, keyed_uniform(counter_hash(0, 9, 0, torch.arange(4000)), 0))
    freq = torch.bincount(tok, minlength=5).float() / 4000
    assert freq[4] == 0 and torch.allclose(freq, probs[0], atol=0.03), freq


# ------------------------------------------------------------------------------------------------
# validation before any model is built (item 4)
# ------------------------------------------------------------------------------------------------
def _problems(monkeypatch, overrides_, world=None, bf16=True, ds_error=None):
    from harness import parallel

    monkeypatch.setattr(parallel, "cpu_supports_bf16", lambda: bf16)
    monkeypatch.setattr(parallel, "deepspeed_import_error", lambda: ds_error)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # validate() would set it for a CPU run; keep this process clean
    if world:
        monkeypatch.setenv("WORLD_SIZE", str(world))
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:  # the rules between fields refuse the config when it loads (config.cross_checks), the rest here
        cfg = load_config(None, ["device=cpu", *overrides_])
    except ConfigError as e:
        return "\n".join(e.problems)
    return "\n".join(parallel.validate(cfg))


def test_validation_names_field_value_and_allowed(monkeypatch):
    ds = ["distributed.deepspeed=true", "distributed.zero_stage=2"]
    msg = _problems(monkeypatch, [*ds, "distributed.precision=fp16"])
    assert "distributed.precision: got 'fp16' on a CPU; allowed here: 'fp32' or 'bf16'" in msg
    msg = _problems(monkeypatch, [*ds, "distributed.precision=bf16"], bf16=False)
    assert "distributed.precision: got 'bf16' but this CPU has no native bf16" in msg and "allowed here: 'fp32'" in msg
    assert _problems(monkeypatch, [*ds, "distributed.precision=bf16"], bf16=True) == ""
    msg = _problems(monkeypatch, ["model.autocast=bf16"], bf16=False)
    assert "model.autocast: got 'bf16' but this CPU has no native bf16" in msg
    msg = _problems(monkeypatch, ds, ds_error="ModuleNotFoundError: No module named 'deepspeed'")
    assert "distributed.deepspeed: got true but deepspeed cannot be imported (ModuleNotFoundError" in msg and "allowed: false" in msg
    msg = _problems(monkeypatch, ["distributed.zero_stage=2"])
    assert "distributed.zero_stage: got 2 with distributed.deepspeed=false; allowed: 0" in msg
    msg = _problems(monkeypatch, ["distributed.deepspeed=true", "distributed.precision=bf16"])
    assert "distributed.zero_stage: got 0 with distributed.precision='bf16'; allowed: 1, 2 or 3" in msg
    msg = _problems(monkeypatch, [*ds, "distributed.offload_optimizer=true"])
    assert "distributed.offload_optimizer: got true on a CPU; allowed: false" in msg
    # world-size arithmetic: every rank takes an equal share of each minibatch
    msg = _problems(monkeypatch, ["ppo.rollout_batch_size=8", "ppo.num_minibatches=2"], world=3)
    assert "ppo.rollout_batch_size: got 8 with ppo.num_minibatches=2 on 3 ranks; allowed: a multiple of num_minibatches x ranks = 6" in msg
    msg = _problems(monkeypatch, ["ppo.rollout_batch_size=8", "ppo.num_minibatches=2", "distributed.gradient_accumulation=4"], world=2)
    assert "distributed.gradient_accumulation: got 4; allowed: a divisor of the 2 rows each rank takes per minibatch" in msg
    assert _problems(monkeypatch, ["ppo.rollout_batch_size=8", "ppo.num_minibatches=2"], world=2) == ""


def test_offload_params_without_stage_3_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"distributed.offload_params: got true with zero_stage=2; allowed: only with zero_stage 3"):
        load_config(None, ["distributed.deepspeed=true", "distributed.zero_stage=2", "distributed.offload_params=true"])


def test_train_refuses_before_any_model_or_mlflow_run(tmp_path, monkeypatch):
    from harness import models, parallel
    from harness.train import main, train

    monkeypatch.setattr(parallel, "cpu_supports_bf16", lambda: False)
    monkeypatch.setattr(parallel, "deepspeed_import_error", lambda: None)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(models.Models, "__init__", lambda *a, **k: pytest.fail("a model was built"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ["device=cpu", "distributed.deepspeed=true", "distributed.zero_stage=2", "distributed.precision=bf16",
            f"logging.tracking_uri={sqlite_uri(tmp_path / 'm.db')}", f"logging.output_dir={tmp_path / 'runs'}"]
    with pytest.raises(ConfigError, match="distributed.precision: got 'bf16'"):
        train(load_config(None, args))
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "runs").exists()
    assert main([a for x in args for a in ("--set", x)]) == 2


def test_stop_file_is_honoured_once(tmp_path):
    from harness.keys import STOP_FILE
    from harness.parallel import DistEnv, agree_stop

    assert agree_stop(DistEnv(), False, tmp_path) is False
    (tmp_path / STOP_FILE).touch()
    assert agree_stop(DistEnv(), False, tmp_path) is True
    assert not (tmp_path / STOP_FILE).exists()  # a later --resume runs on
    assert agree_stop(DistEnv(), True, tmp_path) is True
