"""Pins the numbers of fixed-seed PPO steps on tiny models, so no speed change alters the math unnoticed.

Tiny GPT-2 models (2 layers, width 32, vocab 64) and a word-level tokenizer are built from fixed
seeds in a temp dir and loaded through `harness.models.Models`, exactly as a run loads them. Each
case runs two PPO steps (the second step sees parameters the first one updated) and compares every
logged metric except wall-clock ones with the values recorded when this test was written, and the
sampled tokens exactly.

The tolerance is tight (rel 2e-4, abs 2e-5): summation-order round-off from a different kernel or
batching passes, a changed formula, a dropped term or a different sample does not. To re-record
after an intended change of the math: `python tests/test_fixed_seed_step.py` prints new tables.
"""
from __future__ import annotations

import math
import random
import sys

import pytest
import torch

from harness.config import from_dict
from harness.data import PromptSource
from harness.models import Models
from harness.trainer import PPOTrainer

VOCAB = 64
SPECIALS = ["[PAD]", "[UNK]", "[EOS]"]

CASES = {
    # EOS stops, two minibatches, top-k/top-p, temperature, KL penalty, entropy bonus, value clip, reward
    # normalize+clip: the trainer's default paths.
    "default_paths": {
        "generation": {"max_new_tokens": 10, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "stop_at_eos": True},
        "ppo": {"rollout_batch_size": 8, "ppo_epochs": 2, "num_minibatches": 2, "kl_coef": 0.05, "entropy_coef": 0.01,
                "policy_lr": 1e-3, "critic_lr": 1e-3},
    },
    # The benchmark's shape: no early stop, one minibatch, several epochs, old log-probs from sampling,
    # k3 KL estimator, no entropy bonus.
    "bench_paths": {
        "generation": {"max_new_tokens": 12, "stop_at_eos": False},
        "ppo": {"rollout_batch_size": 8, "ppo_epochs": 3, "num_minibatches": 1, "kl_coef": 0.1, "kl_estimator": "k3",
                "reuse_rollout_logprobs": True, "policy_lr": 1e-3, "critic_lr": 1e-3, "value_clip": None,
                "max_grad_norm": 0.0},
        "reward": {"normalize": False, "clip": None},
    },
    # One minibatch with recomputed old log-probs and an entropy bonus (the update's first epoch may reuse the
    # scoring pass's forwards), EOS stops, k2 KL, value clip, PPO-ptx.
    "one_minibatch_entropy": {
        "generation": {"max_new_tokens": 10, "top_k": 20, "stop_at_eos": True},
        "ppo": {"rollout_batch_size": 8, "ppo_epochs": 2, "num_minibatches": 1, "kl_coef": 0.1, "kl_estimator": "k2",
                "entropy_coef": 0.05, "entropy_target": 3.0, "ptx_coef": 0.1, "ptx_batch_size": 4, "policy_lr": 1e-3,
                "critic_lr": 1e-3},
    },
    # APA loss with the SFT-trunk critic (random head) and adaptive KL.
    "apa_paths": {
        "generation": {"max_new_tokens": 8, "stop_at_eos": True},
        "model": {"critic_init": "sft"},
        "ppo": {"rollout_batch_size": 4, "ppo_epochs": 1, "num_minibatches": 1, "policy_loss": "apa",
                "kl_controller": "adaptive", "policy_lr": 1e-3, "critic_lr": 1e-3},
    },
}

# Recorded on the code before any speed work (git 406c361; torch 2.13 CPU, transformers 5.24, 2 threads).
PINNED: dict[str, dict] = {}  # filled below
TOKENS: dict[str, list[int]] = {}


def _words() -> list[str]:
    return [f"w{i}" for i in range(VOCAB - len(SPECIALS))]


def build_models(root) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerFast

    ws = _words()
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.train_from_iterator([" ".join(ws)], trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, min_frequency=0))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    cfg = dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=fast.eos_token_id,
               eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    torch.manual_seed(0)
    sft = GPT2LMHeadModel(GPT2Config(**cfg))
    # make EOS likely enough that stop_at_eos cases end some responses early
    with torch.no_grad():
        sft.lm_head.weight[fast.eos_token_id] += 0.05 * sft.transformer.h[0].ln_1.weight.new_ones(32)
    sft.save_pretrained(root / "sft")
    fast.save_pretrained(root / "sft")
    torch.manual_seed(1)
    rm = GPT2ForSequenceClassification(GPT2Config(**cfg, num_labels=1))
    with torch.no_grad():
        rm.score.weight.normal_(0.0, 1.0)  # a reward with some spread
    rm.save_pretrained(root / "reward")


def prompts() -> list[str]:
    rng = random.Random(0)
    ws = _words()
    return [" ".join(rng.choice(ws) for _ in range(rng.randint(3, 7))) for _ in range(24)]


def run_case(name: str, root) -> tuple[dict[str, float], list[int]]:
    over = CASES[name]
    d = {"seed": 0, "device": "cpu", "model": {"sft_path": str(root / "sft"), "reward_path": str(root / "reward"),
                                                 "pretrained_path": str(root / "sft")},
         "data": {"source": "hh_rlhf", "hh_path": "unused.jsonl"}, "ppo": {"steps": 2}}
    for sec, vals in over.items():
        d.setdefault(sec, {}).update(vals)
    cfg = from_dict(d)
    torch.manual_seed(cfg.seed)
    models = Models(cfg, torch.device("cpu"))
    trainer = PPOTrainer(cfg, models, PromptSource(prompts(), [], [("w1 w2", "w3 w4")], None), torch.device("cpu"))
    metrics = {}
    for _ in range(2):
        m, b = trainer.step()
        metrics = {k: float(v) for k, v in m.items() if not k.startswith("perf/")}
    tokens = b.rollout.response_ids.flatten().tolist()
    return metrics, tokens


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fixed_seed_models")
    build_models(root)
    return root


@pytest.mark.parametrize("name", list(CASES))
def test_fixed_seed_step_matches_pinned(name, model_root):
    metrics, tokens = run_case(name, model_root)
    assert tokens == TOKENS[name], "sampled tokens changed"
    pinned = PINNED[name]
    assert set(metrics) == set(pinned), f"metric keys changed: {set(metrics) ^ set(pinned)}"
    bad = []
    for k, want in pinned.items():
        got = metrics[k]
        if not math.isclose(got, want, rel_tol=2e-4, abs_tol=2e-5):
            bad.append(f"{k}: got {got!r}, pinned {want!r}")
    assert not bad, "fixed-seed step changed:\n" + "\n".join(bad)


def test_static_decoder_matches_model_forward(model_root):
    """The GPT-2 sampling fast path gives the model's own KV-cache forward's tokens and log-probs
    (left-padded prompts of mixed length, EOS stops, top-k/top-p), and its sampling-pass entropy
    and log-probs equal a teacher-forced pass over the result."""
    from harness.models import load_causal_lm
    from harness.rollout import StaticGPT2Decoder, counter_hash, left_pad, logprobs_and_entropy, sample
    from transformers import AutoTokenizer

    model = load_causal_lm(str(model_root / "sft")).eval()
    assert StaticGPT2Decoder.supports(model)
    tok = AutoTokenizer.from_pretrained(str(model_root / "sft"))
    ids, mask = left_pad([tok(p, add_special_tokens=False)["input_ids"] for p in prompts()[:8]], tok.pad_token_id, torch.device("cpu"))
    kw = dict(max_new_tokens=12, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=0.9, top_k=30, top_p=0.95)
    row_keys = counter_hash(3, 1, 0, torch.arange(8))
    slow = sample(model, ids, mask, row_keys, fast=False, **kw)
    fast = sample(model, ids, mask, row_keys, fast=True, with_entropy=True, **kw)
    assert torch.equal(slow.response_ids, fast.response_ids) and torch.equal(slow.response_mask, fast.response_mask)
    assert torch.allclose(slow.sample_logprobs, fast.sample_logprobs, atol=1e-5)
    P = ids.shape[1]
    with torch.no_grad():
        lp, ent = logprobs_and_entropy(model, fast.sequences, fast.attention_mask, P, fast.response_ids, 0.9)
    m = fast.response_mask.float()
    assert torch.allclose(lp * m, fast.sample_logprobs, atol=1e-5)
    assert torch.allclose(ent * m, fast.sample_entropy, atol=1e-5)


# ---- recorded tables (python tests/test_fixed_seed_step.py) ----
PINNED['default_paths'] = {
    'adv/mean': 2.1151370321881302e-08,
    'adv/raw_mean': -1.21093288064003,
    'adv/raw_std': 2.645101308822632,
    'adv/std': 0.9867171198129654,
    'objective/entropy': 4.148700714111328,
    'objective/kl': 0.011412246152758598,
    'objective/kl_coef': 0.05,
    'objective/kl_k3': 0.0025461907498538494,
    'objective/non_score_reward': -0.005359604023396969,
    'objective/ppl': 58.137168884277344,
    'objective/ppl_ref': 58.82682418823242,
    'objective/ppl_tokens': 58.2543830871582,
    'objective/rm_score': -1.5925507545471191,
    'objective/rm_score_std': 5.2408246994018555,
    'objective/score_processed': 0.08199586719274521,
    'optim/grad_norm_critic': 224.20978927612305,
    'optim/grad_norm_policy': 1.5505468845367432,
    'optim/lr_critic': 0.001,
    'optim/lr_policy': 0.001,
    'policy/approx_kl': 0.0015163091811700724,
    'policy/clipfrac': 0.012500000186264515,
    'policy/entropy_loss': -0.041481888853013515,
    'policy/pg_loss': -0.02547934051189138,
    'policy/ratio_max': 1.1218868494033813,
    'policy/ratio_mean': 0.9962872713804245,
    'policy/ratio_std': 0.04194078454747796,
    'response/frac_at_cap': 0.875,
    'response/length_max': 10.0,
    'response/length_mean': 9.5,
    'reward/running_mean': -1.8862116038799286,
    'reward/running_std': 5.70310673408051,
    'val/clipfrac': 0.6805555522441864,  # redefined in 20afa44 (fraction of values the clip moved)
    'val/returns_mean': 0.4334547221660614,
    'val/returns_std': 0.5827382802963257,
    'val/values_mean': 1.634941577911377,
    'val/vf_loss': 4.364464640617371,
}
TOKENS['default_paths'] = [16, 37, 47, 48, 51, 4, 21, 29, 11, 11, 8, 56, 43, 28, 19, 61, 63, 14, 8, 10, 34, 45, 6, 61, 19, 2, 0, 0, 0, 0, 21, 6, 4, 40, 10, 50, 62, 60, 30, 47, 54, 44, 20, 28, 51, 32, 32, 58, 30, 19, 38, 25, 4, 4, 17, 22, 59, 14, 42, 48, 6, 33, 44, 15, 25, 7, 8, 14, 44, 15, 4, 58, 43, 43, 62, 52, 57, 17, 5, 8]
PINNED['bench_paths'] = {
    'adv/mean': 1.2417633143968487e-08,
    'adv/raw_mean': 2.3413204352060952,
    'adv/raw_std': 4.822697162628174,
    'adv/std': 0.9947779973347982,
    'objective/entropy': 4.150574684143066,
    'objective/kl': -0.014082737267017365,
    'objective/kl_coef': 0.1,
    'objective/kl_k3': 0.003112835343927145,
    'objective/non_score_reward': -0.003735402598977089,
    'objective/ppl': 63.442230224609375,
    'objective/ppl_ref': 62.55378723144531,
    'objective/ppl_tokens': 63.395240783691406,
    'objective/rm_score': 1.7750675678253174,
    'objective/rm_score_std': 5.0670084953308105,
    'objective/score_processed': 1.7750675678253174,
    'optim/grad_norm_critic': 503.70196024576825,
    'optim/grad_norm_policy': 1.065320332845052,
    'optim/lr_critic': 0.001,
    'optim/lr_policy': 0.001,
    'policy/approx_kl': 0.0011585608978466055,
    'policy/clipfrac': 0.0,
    'policy/entropy_loss': 0.0,
    'policy/pg_loss': -0.028617979544731515,
    'policy/ratio_max': 1.076894203821818,
    'policy/ratio_mean': 1.0015724897384644,
    'policy/ratio_std': 0.03639549505370354,
    'response/frac_at_cap': 1.0,
    'response/length_max': 12.0,
    'response/length_mean': 12.0,
    'reward/running_mean': 0.0,
    'reward/running_std': 1.0,
    'val/clipfrac': 0.0,
    'val/returns_mean': 1.3510502576828003,
    'val/returns_std': 3.762531280517578,
    'val/values_mean': -0.99027019739151,
    'val/vf_loss': 10.722026189168295,
}
TOKENS['bench_paths'] = [61, 48, 29, 20, 20, 29, 11, 11, 44, 7, 23, 14, 47, 28, 19, 32, 32, 14, 8, 51, 61, 17, 49, 59, 16, 46, 33, 60, 6, 9, 36, 24, 37, 57, 5, 48, 26, 40, 10, 50, 21, 60, 30, 47, 19, 36, 0, 7, 60, 32, 51, 32, 12, 58, 6, 19, 13, 30, 16, 62, 36, 32, 17, 22, 59, 14, 44, 43, 56, 57, 27, 58, 44, 36, 10, 7, 8, 5, 44, 5, 20, 24, 11, 58, 31, 60, 62, 60, 57, 40, 10, 8, 19, 58, 58, 10]
PINNED['apa_paths'] = {
    'adv/mean': 4.470348358154297e-08,
    'adv/raw_mean': 0.33573728799819946,
    'adv/raw_std': 0.7137734293937683,
    'adv/std': 0.9842510223388672,
    'objective/entropy': 4.150958061218262,
    'objective/kl': 0.0047919973731040955,
    'objective/kl_coef': 0.049996000000000006,
    'objective/kl_k3': 0.0004659202240873128,
    'objective/non_score_reward': -0.001916645560413599,
    'objective/ppl': 62.36001968383789,
    'objective/ppl_ref': 62.67459487915039,
    'objective/ppl_tokens': 62.3514404296875,
    'objective/rm_score': -3.1900789737701416,
    'objective/rm_score_std': 4.242398738861084,
    'objective/score_processed': -0.22752054035663605,
    'optim/grad_norm_critic': 24.132686614990234,
    'optim/grad_norm_policy': 41.19514465332031,
    'optim/lr_critic': 0.001,
    'optim/lr_policy': 0.001,
    'policy/approx_kl': 0.0,
    'policy/clipfrac': 0.0,
    'policy/entropy_loss': 0.0,
    'policy/pg_loss': 96.75349426269531,
    'policy/ratio_max': 1.0,
    'policy/ratio_mean': 1.0,
    'policy/ratio_std': 0.0,
    'response/frac_at_cap': 1.0,
    'response/length_max': 8.0,
    'response/length_mean': 8.0,
    'reward/running_mean': -1.1252303719520569,
    'reward/running_std': 6.13715387678067,
    'val/clipfrac': 0.0,
    'val/returns_mean': -0.2870444059371948,
    'val/returns_std': 0.3848731815814972,
    'val/values_mean': -0.6227816939353943,
    'val/vf_loss': 0.3110960125923157,
}
TOKENS['apa_paths'] = [15, 62, 0, 36, 16, 40, 5, 2, 31, 49, 21, 40, 9, 62, 55, 40, 38, 15, 1, 60, 48, 5, 38, 49, 30, 60, 28, 60, 27, 51, 30, 56]


# recorded on the pre-optimization code (git HEAD 406c361) like the tables above
PINNED['one_minibatch_entropy'] = {
    'adv/mean': -1.750886369222826e-08,
    'adv/raw_mean': 1.5413662791252136,
    'adv/raw_std': 3.4978957176208496,
    'adv/std': 0.993730366230011,
    'objective/entropy': 4.150196075439453,
    'objective/kl': 0.03419847413897514,
    'objective/kl_coef': 0.1,
    'objective/kl_k3': 0.002579871565103531,
    'objective/non_score_reward': -0.0026613296940922737,
    'objective/ppl': 55.06435012817383,
    'objective/ppl_ref': 56.969017028808594,
    'objective/ppl_tokens': 55.027366638183594,
    'objective/rm_score': 1.2797694206237793,
    'objective/rm_score_std': 5.693676948547363,
    'objective/score_processed': 0.1380811482667923,
    'optim/grad_norm_critic': 627.6523742675781,
    'optim/grad_norm_policy': 1.292413055896759,
    'optim/lr_critic': 0.001,
    'optim/lr_policy': 0.001,
    'policy/approx_kl': 0.00036294269375503063,
    'policy/clipfrac': 0.0,
    'policy/entropy_loss': 0.057498157024383545,
    'policy/pg_loss': -0.01532093808054924,
    'policy/ptx_loss': 3.78137743473053,
    'policy/ratio_max': 1.0482816100120544,
    'policy/ratio_mean': 0.9981511533260345,
    'policy/ratio_std': 0.018839308992028236,
    'response/frac_at_cap': 1.0,
    'response/length_max': 10.0,
    'response/length_mean': 10.0,
    'reward/running_mean': -0.6178439557552338,
    'reward/running_std': 6.710790708558698,
    'val/clipfrac': 0.48750001192092896,  # redefined in 20afa44 (fraction of values the clip moved)
    'val/returns_mean': -0.19032129645347595,
    'val/returns_std': 0.5565778017044067,
    'val/values_mean': -1.7316875457763672,
    'val/vf_loss': 9.075824737548828,
}
TOKENS['one_minibatch_entropy'] = [16, 50, 45, 45, 19, 63, 21, 61, 6, 61, 28, 56, 18, 28, 18, 61, 10, 59, 8, 45, 34, 45, 6, 61, 19, 5, 6, 30, 18, 18, 40, 6, 4, 40, 10, 3, 43, 27, 30, 17, 54, 44, 43, 28, 51, 32, 32, 56, 30, 19, 4, 6, 4, 4, 17, 54, 59, 14, 42, 48, 6, 10, 44, 3, 25, 7, 8, 14, 29, 15, 4, 34, 52, 52, 10, 52, 10, 62, 25, 8]


if __name__ == "__main__":  # re-record: prints the PINNED/TOKENS tables to paste above
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        root = pathlib.Path(d)
        build_models(root)
        for name in (sys.argv[1:] or CASES):
            m, t = run_case(name, root)
            print(f"PINNED[{name!r}] = {{")
            for k in sorted(m):
                print(f"    {k!r}: {m[k]!r},")
            print("}")
            print(f"TOKENS[{name!r}] = {t!r}")
