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

# Re-recorded for the one keyed sampler (the commit after 448eabb; torch 2.13 CPU, transformers 5.24). The update's
# math was checked unchanged first: the previous code fed the new sampler's tokens gave these numbers within tolerance.
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


def run_case(name: str, root, extra: dict | None = None) -> tuple[dict[str, float], list[int]]:
    over = {**CASES[name], **(extra or {})}
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
    # the samples' diversity (signal/*, issue 35) came after the pins: read from the sampled tokens pinned
    # above, its values are tested on hand-made batches (tests/test_warning_signals.py)
    metrics = {k: v for k, v in metrics.items() if not k.startswith("signal/")}
    assert set(metrics) == set(pinned), f"metric keys changed: {set(metrics) ^ set(pinned)}"
    bad = []
    for k, want in pinned.items():
        got = metrics[k]
        if not math.isclose(got, want, rel_tol=2e-4, abs_tol=2e-5):
            bad.append(f"{k}: got {got!r}, pinned {want!r}")
    assert not bad, "fixed-seed step changed:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", ["one_minibatch_entropy", "bench_paths"])
def test_gradient_accumulation_takes_the_same_step(name, model_root):
    """Two micro-batches per minibatch give the pinned step (token-weighted loss sums, one optimizer
    step; the entropy clip's sign from the whole minibatch; old log-probs from sampling), up to
    float summation order."""
    metrics, tokens = run_case(name, model_root, {"distributed": {"gradient_accumulation": 2}})
    assert tokens == TOKENS[name]
    bad = [f"{k}: got {metrics[k]!r}, pinned {v!r}" for k, v in PINNED[name].items()
           if not math.isclose(metrics[k], v, rel_tol=1e-3, abs_tol=1e-4)]
    assert not bad, "gradient accumulation changed the step:\n" + "\n".join(bad)


def test_static_decoder_matches_model_forward(model_root):
    """The GPT-2 sampling fast path gives the model's own KV-cache forward's tokens and log-probs
    (left-padded prompts of mixed length, EOS stops, top-k/top-p), and its sampling-pass entropy
    and log-probs equal a teacher-forced pass over the result."""
    from transformers import AutoTokenizer

    from harness.models import load_causal_lm
    from harness.rollout import StaticGPT2Decoder, counter_hash, left_pad, logprobs_and_entropy, sample

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
    'response/sampled_tokens': 141.0,  # added with the metric (the other values unchanged)
    'adv/mean': -4.5874375381727006e-08,
    'adv/raw_mean': -2.4060483872890472,
    'adv/raw_std': 3.07578182220459,
    'adv/std': 0.9854174703359604,
    'objective/entropy': 4.147706031799316,
    'objective/kl': 0.05211827903985977,
    'objective/kl_coef': 0.05,
    'objective/kl_k3': 0.004811441525816917,
    'objective/non_score_reward': -0.016979927197098732,
    'objective/ppl': 57.62949752807617,
    'objective/ppl_ref': 60.64081954956055,
    'objective/ppl_tokens': 58.615360260009766,
    'objective/rm_score': -2.6120691299438477,
    'objective/rm_score_std': 5.109030246734619,
    'objective/score_processed': -0.11998866498470306,
    'optim/grad_norm_critic': 229.12786865234375,
    'optim/grad_norm_policy': 1.9427937865257263,
    'optim/lr_critic': 0.001,
    'optim/lr_policy': 0.001,
    'policy/approx_kl': 0.0016133375419650421,
    'policy/clipfrac': 0.016129032258064516,
    'policy/entropy_loss': -0.041471611708402634,
    'policy/pg_loss': -0.021840377129164486,
    'policy/ratio_max': 1.0987927615642548,
    'policy/ratio_mean': 0.9967982163598855,
    'policy/ratio_std': 0.04260322216681068,
    'response/frac_at_cap': 0.75,
    'response/length_max': 10.0,
    'response/length_mean': 8.75,
    'reward/running_mean': -1.0810546576976776,
    'reward/running_std': 5.7909694763215755,
    'val/clipfrac': 0.7082299421009098,
    'val/returns_mean': 0.4834909737110138,
    'val/returns_std': 0.6147606372833252,
    'val/values_mean': 2.962611675262451,
    'val/vf_loss': 7.589202880859375,
    'response/length_std': 3.150963544845581,
    'val/explained_var': -24.0322322845459,
}
TOKENS['default_paths'] = [19, 4, 6, 24, 8, 40, 54, 17, 63, 44, 22, 3, 53, 13, 58, 48, 62, 39, 18, 54, 36, 16, 40, 28, 25, 7, 14, 55, 50, 43, 45, 36, 43, 19, 14, 62, 51, 61, 2, 0, 21, 45, 43, 45, 30, 54, 16, 8, 51, 39, 50, 36, 6, 35, 38, 14, 19, 23, 34, 50, 45, 28, 54, 53, 29, 38, 22, 29, 36, 19, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0]
PINNED['bench_paths'] = {
    'response/sampled_tokens': 192.0,  # added with the metric (the other values unchanged)
    'adv/mean': 2.4835269396561444e-09,
    'adv/raw_mean': -1.6402692794799805,
    'adv/raw_std': 5.963302135467529,
    'adv/std': 0.994778037071228,
    'objective/entropy': 4.15058708190918,
    'objective/kl': 0.0005971568170934916,
    'objective/kl_coef': 0.1,
    'objective/kl_k3': 0.0022158436477184296,
    'objective/non_score_reward': -0.0026590125635266304,
    'objective/ppl': 63.59379196166992,
    'objective/ppl_ref': 63.61716079711914,
    'objective/ppl_tokens': 63.559326171875,
    'objective/rm_score': -0.8013851046562195,
    'objective/rm_score_std': 7.532352447509766,
    'objective/score_processed': -0.8013851046562195,
    'optim/grad_norm_critic': 383.9636586507161,
    'optim/grad_norm_policy': 1.0155948003133137,
    'optim/lr_critic': 0.001,
    'optim/lr_policy': 0.001,
    'policy/approx_kl': 0.0009717562287672423,
    'policy/clipfrac': 0.0,
    'policy/entropy_loss': 0.0,
    'policy/pg_loss': -0.028370859722296398,
    'policy/ratio_max': 1.069266637166341,
    'policy/ratio_mean': 0.9997477266523574,
    'policy/ratio_std': 0.033499859182716786,
    'response/frac_at_cap': 1.0,
    'response/length_max': 12.0,
    'response/length_mean': 12.0,
    'reward/running_mean': 0.0,
    'reward/running_std': 1.0,
    'val/clipfrac': 0.0,
    'val/returns_mean': -0.19373460114002228,
    'val/returns_std': 5.594757080078125,
    'val/values_mean': 1.446534514427185,
    'val/vf_loss': 16.071524726019963,
    'response/length_std': 0.0,
    'val/explained_var': -0.1360858678817749,
}
TOKENS['bench_paths'] = [20, 5, 8, 26, 10, 42, 57, 12, 62, 43, 62, 7, 19, 3, 55, 12, 57, 49, 62, 37, 17, 52, 35, 20, 33, 13, 43, 33, 22, 7, 18, 56, 48, 40, 4, 55, 46, 38, 43, 19, 14, 62, 49, 62, 1, 5, 58, 36, 22, 47, 40, 44, 30, 55, 12, 8, 54, 40, 21, 52, 46, 32, 8, 36, 37, 12, 22, 27, 33, 48, 42, 32, 46, 32, 54, 54, 34, 34, 23, 26, 36, 19, 27, 16, 4, 33, 34, 18, 39, 25, 47, 16, 56, 13, 32, 41]
PINNED['one_minibatch_entropy'] = {
    'response/sampled_tokens': 141.0,  # added with the metric (the other values unchanged)
    'adv/mean': 0.0,
    'adv/raw_mean': 2.7970190048217773,
    'adv/raw_std': 2.9128267765045166,
    'adv/std': 0.9930312633514404,
    'objective/entropy': 4.150798320770264,
    'objective/kl': 0.019897261634469032,
    'objective/kl_coef': 0.1,
    'objective/kl_k3': 0.0010642210254445672,
    'objective/non_score_reward': -0.0010035226587206125,
    'objective/ppl': 57.323631286621094,
    'objective/ppl_ref': 58.47958755493164,
    'objective/ppl_tokens': 57.09947967529297,
    'objective/rm_score': -2.936607837677002,
    'objective/rm_score_std': 6.532021522521973,
    'objective/score_processed': 0.0001427270472049713,
    'optim/grad_norm_critic': 798.3145141601562,
    'optim/grad_norm_policy': 1.1679893732070923,
    'optim/lr_critic': 0.001,
    'optim/lr_policy': 0.001,
    'policy/approx_kl': 0.00038260511226124235,
    'policy/clipfrac': 0.0,
    'policy/entropy_loss': 0.057528056204319,
    'policy/pg_loss': -0.01542167862256368,
    'policy/ptx_loss': 3.7940480709075928,
    'policy/ratio_max': 1.0393035411834717,
    'policy/ratio_mean': 1.0006700091891818,
    'policy/ratio_std': 0.019502217615455675,
    'response/frac_at_cap': 0.875,
    'response/length_max': 10.0,
    'response/length_mean': 9.0,
    'reward/running_mean': -2.142870157957077,
    'reward/running_std': 5.391152729481363,
    'val/clipfrac': 0.5,
    'val/returns_mean': -0.4781808853149414,
    'val/returns_std': 0.7214939594268799,
    'val/values_mean': -3.2751996517181396,
    'val/vf_loss': 10.108104281955296,
    'response/length_std': 2.8284270763397217,
    'val/explained_var': -15.299108505249023,
}
TOKENS['one_minibatch_entropy'] = [16, 1, 6, 30, 6, 49, 60, 20, 63, 47, 28, 2, 0, 0, 0, 0, 0, 0, 0, 0, 38, 20, 47, 38, 36, 6, 14, 54, 48, 41, 49, 38, 47, 23, 13, 63, 53, 63, 3, 5, 18, 44, 40, 49, 39, 57, 13, 10, 57, 41, 50, 40, 10, 38, 41, 11, 35, 38, 41, 44, 51, 30, 44, 51, 47, 43, 25, 24, 41, 26, 1, 33, 34, 24, 41, 28, 47, 11, 55, 11]
PINNED['apa_paths'] = {
    'response/sampled_tokens': 64.0,  # added with the metric (the other values unchanged)
    'adv/mean': -2.2351741790771484e-08,
    'adv/raw_mean': 0.4702805280685425,
    'adv/raw_std': 0.898611307144165,
    'adv/std': 0.984251081943512,
    'objective/entropy': 4.151371479034424,
    'objective/kl': 0.005508027970790863,
    'objective/kl_coef': 0.049996000000000006,
    'objective/kl_k3': 0.000804021256044507,
    'objective/non_score_reward': -0.0022030349355190992,
    'objective/ppl': 64.02201080322266,
    'objective/ppl_ref': 64.36438751220703,
    'objective/ppl_tokens': 63.95570373535156,
    'objective/rm_score': -2.4109702110290527,
    'objective/rm_score_std': 9.094941139221191,
    'objective/score_processed': -0.11269532144069672,
    'optim/grad_norm_critic': 38.05072784423828,
    'optim/grad_norm_policy': 40.44692611694336,
    'optim/lr_critic': 0.001,
    'optim/lr_policy': 0.001,
    'policy/approx_kl': 0.0,
    'policy/clipfrac': 0.0,
    'policy/entropy_loss': 0.0,
    'policy/pg_loss': 96.89671325683594,
    'policy/ratio_max': 1.0,
    'policy/ratio_mean': 1.0,
    'policy/ratio_std': 0.0,
    'response/frac_at_cap': 1.0,
    'response/length_max': 8.0,
    'response/length_mean': 8.0,
    'reward/running_mean': 0.3708321154117584,
    'reward/running_std': 7.305261960337923,
    'val/clipfrac': 0.0,
    'val/returns_mean': -0.21846258640289307,
    'val/returns_std': 0.6070328950881958,
    'val/values_mean': -0.6887431740760803,
    'val/vf_loss': 0.5143330693244934,
    'response/length_std': 0.0,
    'val/explained_var': -1.19138765335083,
}
TOKENS['apa_paths'] = [20, 5, 9, 26, 10, 42, 57, 13, 17, 3, 55, 13, 56, 49, 62, 38, 33, 13, 44, 33, 22, 8, 19, 56, 47, 39, 43, 20, 15, 62, 49, 62]


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
