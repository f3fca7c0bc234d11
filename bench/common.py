"""The benchmark's shared pieces: model sizes, building the models once, the FLOP count per PPO step.

Runs under both the main venv (harness) and the bench venv (TRL): it imports only torch,
transformers and tokenizers.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The workload of issue 8: 32 prompts of 16 tokens, 48 sampled tokens (no early stop), 4 PPO epochs,
# 1 minibatch, fp32, 2 torch threads.
BATCH = 32
PROMPT_LEN = 16
RESPONSE_LEN = 48
PPO_EPOCHS = 4
MINIBATCHES = 1
THREADS = 2
N_PROMPTS = 512  # prompt pool (16 steps of 32 before a prompt repeats)

SPECIALS = ["[PAD]", "[UNK]", "[EOS]"]


@dataclass(frozen=True)
class Size:
    name: str
    n_layer: int
    n_embd: int
    vocab: int
    n_head: int = 4
    n_positions: int = 128

    @property
    def tag(self) -> str:
        return f"L{self.n_layer}/E{self.n_embd}/V{self.vocab}"


SIZES = {
    "small": Size("small", 4, 128, 512),
    "medium": Size("medium", 6, 256, 2048),
}


# ---------------------------------------------------------------------------------------------
# Model FLOPs of one PPO step: the matmul work the algorithm needs, whoever runs it (multiply-add =
# 2 FLOPs). Counted: linear layers, attention scores and weighted values, the tied LM head where its
# logits are used. Not counted (overhead that MFU charges against the implementation): layer norms,
# GELU, softmax, embeddings lookups, the optimizer, Python. Work an implementation does beyond
# this (TRL's LM head over prompt positions, a separate policy pass for old log-probs) is not
# counted either, so both implementations are measured against the same number.
# ---------------------------------------------------------------------------------------------
def trunk_params(s: Size) -> int:
    """Weights that take part in a matmul per token, per GPT-2 trunk (embeddings excluded:
    a lookup is not a matmul). Per layer: qkv 3E^2 + attn proj E^2 + MLP 2*4E^2 = 12E^2."""
    return 12 * s.n_layer * s.n_embd**2


def n_params(s: Size) -> int:
    """All weights of one GPT-2 LM: token and position embeddings, per layer 12E^2 + 13E (qkv,
    projection and MLP weights and biases, two layer norms), the final layer norm; the LM head is
    tied to the token embeddings (a sequence-classification model's E x 1 head is negligible)."""
    E = s.n_embd
    return s.vocab * E + s.n_positions * E + s.n_layer * (12 * E * E + 13 * E) + 2 * E


def fwd_flops(s: Size, batch: int, seq: int, *, lm_positions: int = 0, attn_ctx: float | None = None) -> float:
    """Forward FLOPs of `batch` sequences of `seq` new tokens through one GPT-2 trunk.

    - linear layers: 2 * trunk_params per token;
    - attention, per layer and token: q.k over attn_ctx keys (2*E*ctx) and the weighted sum of values
      (2*E*ctx); attn_ctx defaults to seq, the full square (the usual MFU convention: the causal
      half is not subtracted);
    - LM head (tied embedding, V x E, 2*E*V per position) at lm_positions positions per sequence;
      a scalar value head (E x 1) is negligible.
    """
    ctx = seq if attn_ctx is None else attn_ctx
    per_tok = 2 * trunk_params(s) + s.n_layer * 4 * s.n_embd * ctx
    return float(batch * seq * per_tok + batch * lm_positions * 2 * s.n_embd * s.vocab)


def sampling_flops(s: Size, batch: int, prompt: int, new: int) -> float:
    """Sampling with a KV cache: one prefill of the prompt with the LM head at its last position,
    then new-1 single-token steps (the last sampled token is never fed back), step t attending to
    prompt+t keys, each with the LM head at its one position."""
    f = fwd_flops(s, batch, prompt, lm_positions=1)
    for t in range(1, new):
        f += fwd_flops(s, batch, 1, lm_positions=1, attn_ctx=prompt + t)
    return f


def ppo_step_flops(s: Size, batch: int = BATCH, prompt: int = PROMPT_LEN, resp: int = RESPONSE_LEN,
                   epochs: int = PPO_EPOCHS) -> dict[str, float]:
    """Model FLOPs of one PPO step, by phase (the same work TRL's PPOTrainer does):

    rollout : sampling (above); its logits also give the old log-probs (TRL; harness with
              ppo.reuse_rollout_logprobs)
    scoring : reference forward over prompt+response with the LM head at the resp positions that
              predict response tokens; critic and reward-model forwards (trunks, scalar heads)
    update  : per epoch, policy forward + backward and critic forward + backward; backward = 2x
              forward (gradients with respect to activations and to weights), so 3x forward.
    """
    seq = prompt + resp
    lm = fwd_flops(s, batch, seq, lm_positions=resp)
    trunk = fwd_flops(s, batch, seq)
    out = {
        "rollout": sampling_flops(s, batch, prompt, resp),
        "scoring": lm + 2 * trunk,
        "update": epochs * 3 * (lm + trunk),
    }
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------------------------
# Building the models (once per size; both trainers load the same directories)
# ---------------------------------------------------------------------------------------------
def words(vocab: int) -> list[str]:
    return [f"w{i}" for i in range(vocab - len(SPECIALS))]


def build_tokenizer(vocab: int, out: Path):
    """A word-level tokenizer trained with `tokenizers` on a generated corpus, vocab padded to `vocab`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    ws = words(vocab)
    corpus = [" ".join(rng.choice(ws) for _ in range(32)) for _ in range(2000)] + [" ".join(ws)]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(vocab_size=vocab, special_tokens=SPECIALS, min_frequency=0))
    have = tok.get_vocab_size()
    if have < vocab:  # pad the vocab to exactly `vocab` entries
        tok.add_tokens([f"[FILL{i}]" for i in range(vocab - have)])
    assert tok.get_vocab_size() == vocab, (tok.get_vocab_size(), vocab)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]",
                                   padding_side="left")
    fast.save_pretrained(out)
    return fast


def build(size: str | Size, root: str | Path, seed: int = 0, prompt_len: int = PROMPT_LEN) -> Path:
    """Write root/<name>/{sft,reward}/ (each with the tokenizer) and prompts.json (N_PROMPTS prompts
    of `prompt_len` words = tokens); cached."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    s = SIZES[size] if isinstance(size, str) else size
    out = Path(root) / s.name
    meta = {"size": s.__dict__, "seed": seed, "n_prompts": N_PROMPTS, "prompt_len": prompt_len, "version": 1}
    if (out / "meta.json").exists() and json.loads((out / "meta.json").read_text()) == meta:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(s.vocab, out / "tokenizer")
    cfg = GPT2Config(vocab_size=s.vocab, n_positions=s.n_positions, n_embd=s.n_embd, n_layer=s.n_layer, n_head=s.n_head,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    sft = GPT2LMHeadModel(cfg)
    sft.generation_config.pad_token_id = tok.pad_token_id
    sft.save_pretrained(out / "sft")
    tok.save_pretrained(out / "sft")
    torch.manual_seed(seed + 1)
    rm_cfg = {k: v for k, v in cfg.to_dict().items() if k not in ("id2label", "label2id")}
    rm = GPT2ForSequenceClassification(GPT2Config(**rm_cfg, num_labels=1))
    rm.save_pretrained(out / "reward")
    tok.save_pretrained(out / "reward")
    rng = random.Random(seed)
    ws = words(s.vocab)
    prompts = [" ".join(rng.choice(ws) for _ in range(prompt_len)) for _ in range(N_PROMPTS)]
    (out / "prompts.json").write_text(json.dumps(prompts))
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def best_us(fn, reps: int = 200, rounds: int = 5, warmup: int = 10) -> float:
    """Microseconds per call of fn: the best of `rounds` timed loops of `reps` calls (the machine is
    shared: the least disturbed loop is the kernel's time)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


# ---------------------------------------------------------------------------------------------
# A/B against an older commit: the trees, and a measurement in a fresh process per tree.
# ---------------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]


def trees(baseline: str | None, into: str) -> dict[str, Path]:
    """{"current": this checkout}, and with a baseline revision {"baseline REV": that commit's tree
    as files in `into` (git archive: no worktree left behind)}."""
    out = {"current": REPO}
    if baseline:
        subprocess.run(f"git -C {REPO} archive {baseline} | tar -x -C {into}", shell=True, check=True)
        out[f"baseline {baseline}"] = Path(into)
    return out


def in_tree(tree: Path, module: str, call: str, timeout: float = 1800):
    """The JSON value of `module.call` (e.g. "child('w', 20)"), evaluated in a fresh Python process
    that imports harness from `tree` and this checkout's bench/`module`, 1 OpenMP thread."""
    code = (f"import sys, json; sys.path.insert(0, {str(REPO / 'bench')!r}); import {module}; "
            f"print('BENCH_JSON ' + json.dumps({module}.{call}))")
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, timeout=timeout)
    line = next((x for x in p.stdout.splitlines() if x.startswith("BENCH_JSON ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"bench: {module}.{call} in {tree} failed:\n{p.stderr[-3000:]}")
    return json.loads(line[len("BENCH_JSON "):])
