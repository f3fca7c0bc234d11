"""Real checkpoints get the inputs they were trained on (issue 38, part 3): prompts encoded as each
model's tokenizer encodes them (its BOS, its chat template), switchable by data.add_special_tokens
and data.chat_template; the reward model scores those ids followed by the response. Tiny Llama-,
Mistral-, Qwen2- and GPT-2-architecture models built from configs (no downloads), one without a pad
token (Llama), on the shared HH-RLHF sample."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from harness.config import ConfigError, load_config
from harness.data import load_source
from harness.data.hh_rlhf import dialogue_messages
from harness.models import Models, load_tokenizer, preflight
from harness.parallel import enable_gradient_checkpointing
from harness.trainer import PPOTrainer

from helpers import HH, store_uri, word_tokenizer

needs_shared = pytest.mark.skipif(not HH.is_file(), reason=f"{HH} not present")

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "[INST]", "[/INST]", "<|im_start|>", "<|im_end|>"]
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
           "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
QWEN2 = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# name: (architecture, BOS added by the tokenizer, chat template, pad token)
KINDS = {
    "gpt2": ("gpt2", False, None, True),
    "llama": ("llama", True, None, False),  # a base model: BOS, no template, no pad token
    "mistral": ("mistral", True, MISTRAL, True),  # an instruct model: BOS inside its [INST] template
    "qwen2": ("qwen2", False, QWEN2, True),  # ChatML, no BOS
}
DIALOGUE = "\n\nHuman: what is a cat\n\nAssistant: an animal\n\nHuman: and a dog\n\nAssistant:"


def _tokenizer(bos: bool, template: str | None, pad: bool):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tk = word_tokenizer(300, 700, SPECIALS)
    if bos:  # as Llama's and Mistral's tokenizers do: BOS before every encoded text
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                          special_tokens=[("<s>", tk.token_to_id("<s>"))])
    eos = "<|im_end|>" if template == QWEN2 else "</s>"
    kw = {"pad_token": "<pad>"} if pad else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token=eos, unk_token="<unk>", **kw)
    tok.chat_template = template
    return tok


def _model_config(arch: str, tok):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if arch == "gpt2":
        return GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, num_labels=1, **ids)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
    return cls(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=128, num_labels=1, **ids)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Per kind: a tokenizer, and tiny SFT and reward models of its architecture, saved like any HF model."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("kinds")
    for name, (arch, bos, template, pad) in KINDS.items():
        tok = _tokenizer(bos, template, pad)
        conf = _model_config(arch, tok)
        torch.manual_seed(0)
        for sub, cls in (("sft", AutoModelForCausalLM), ("rm", AutoModelForSequenceClassification)):
            cls.from_config(conf).save_pretrained(root / name / sub)
        # the tokenizer in a folder of its own (model.tokenizer_path): beside a qwen2 config.json,
        # transformers would rebuild it as its byte-level Qwen2Tokenizer over this word-level vocabulary
        tok.save_pretrained(root / name / "tok")
    return root


def _config(root: Path, name: str, tmp_path: Path, **over):
    d = root / name
    base = {"data.source": "hh_rlhf", "data.hh_path": str(HH), "data.max_prompt_tokens": 48, "data.eval_prompts": 0,
            "model.tokenizer_path": str(d / "tok"), "model.sft_path": str(d / "sft"), "model.pretrained_path": str(d / "sft"), "model.reward_path": str(d / "rm"),
            "ppo.rollout_batch_size": 4, "ppo.num_minibatches": 1, "ppo.ppo_epochs": 1, "generation.max_new_tokens": 6,
            "logging.tracking_uri": store_uri(tmp_path), "logging.output_dir": str(tmp_path / "runs"),
            "logging.progress": False, "threads": 1}
    return load_config(None, [f"{k}={v}" for k, v in {**base, **over}.items()])


def test_dialogue_messages_are_the_turns_ending_in_the_assistants():
    assert dialogue_messages(DIALOGUE) == [{"role": "user", "content": "what is a cat"},
                                           {"role": "assistant", "content": "an animal"},
                                           {"role": "user", "content": "and a dog"}]
    assert dialogue_messages("the cat sat") == [{"role": "user", "content": "the cat sat"}]


@needs_shared
@pytest.mark.parametrize("name", list(KINDS))
def test_prompt_ids_are_the_tokenizers_own_encoding(model_dirs, tmp_path, name):
    """Each prompt's ids are what the tokenizer itself gives: its chat template over the dialogue's
    turns where it has one, else the text with its own special tokens (BOS for Llama); a prompt cut to
    data.max_prompt_tokens keeps its BOS; the reward model scores those ids and the response."""
    arch, bos, template, pad = KINDS[name]
    cfg = _config(model_dirs, name, tmp_path)
    assert preflight(cfg) == []
    models = Models(cfg, torch.device("cpu"))
    tok = models.tokenizer
    assert (tok.pad_token_id == tok.eos_token_id) == (not pad)  # no pad token: the EOS pads
    trainer = PPOTrainer(cfg, models, load_source(cfg), torch.device("cpu"))
    # a hand-written dialogue, through the tokenizer's own template or its own call
    msgs = [{"role": "user", "content": "what is a cat"}, {"role": "assistant", "content": "an animal"},
            {"role": "user", "content": "and a dog"}]
    own = (tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False) if template
           else tok(DIALOGUE)["input_ids"])
    assert trainer._encode_prompt(DIALOGUE) == own
    assert (own[0] == tok.bos_token_id) == bos
    words = tok.convert_ids_to_tokens(own)
    if template == MISTRAL:
        assert words[:2] == ["<s>", "[INST]"] and words[-6:] == ["</s>", "[INST]", "and", "a", "dog", "[/INST]"]
    if template == QWEN2:
        assert words[0] == words[-2] == "<|im_start|>" and words.count("<|im_end|>") == 3  # three turns, then the assistant's
    # the HH-RLHF sample's prompts likewise, each cut to its last tokens with its BOS kept
    n = trainer.max_prompt_tokens
    for text, ids in zip(load_source(cfg).train_prompts[:20], trainer.prompt_tokens[:20]):
        full = (tok.apply_chat_template(dialogue_messages(text), add_generation_prompt=True, tokenize=True,
                                        return_dict=False) if template else tok(text)["input_ids"])
        head = [tok.bos_token_id] if bos and len(full) > n else []
        assert ids == (full if len(full) <= n else head + full[len(full) - n + len(head):])
    # one rollout: every row's prompt is one of these encodings, and the RM's score is its own forward of
    # the row's real tokens (BOS or template, prompt, response) unpadded
    b = trainer.make_batch({})
    ro, known = b.rollout, {tuple(p) for p in trainer.prompt_tokens}
    for i in range(len(ro.sequences)):
        assert tuple(ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist()) in known
        real = ro.sequences[i][ro.attention_mask[i].bool()][None]
        pos = torch.arange(real.shape[1])[None]
        with torch.no_grad():
            alone = models.reward(real, torch.ones_like(real), pos)[0, -1]
        assert torch.allclose(b.scores[i], alone, atol=1e-4)


@needs_shared
def test_the_flags_turn_bos_and_template_off(model_dirs, tmp_path):
    for name in ("llama", "mistral"):
        cfg = _config(model_dirs, name, tmp_path, **{"data.add_special_tokens": False, "data.chat_template": "off"})
        trainer = PPOTrainer(cfg, Models(cfg, torch.device("cpu")), load_source(cfg), torch.device("cpu"))
        tok = trainer.tok
        assert trainer._encode_prompt(DIALOGUE) == tok(DIALOGUE, add_special_tokens=False)["input_ids"]
        assert tok.bos_token_id not in trainer._encode_prompt(DIALOGUE)
    cfg = _config(model_dirs, "mistral", tmp_path, **{"data.add_special_tokens": False})  # the template, no BOS
    tok = load_tokenizer(cfg)
    from harness.models import encode_prompt

    with_bos = tok.apply_chat_template(dialogue_messages(DIALOGUE), add_generation_prompt=True, return_dict=False)
    assert encode_prompt(tok, DIALOGUE, cfg) == with_bos[1:] and with_bos[0] == tok.bos_token_id


@needs_shared
def test_chat_template_on_without_one_is_refused_before_the_run(model_dirs, tmp_path):
    from harness.train import train

    cfg = _config(model_dirs, "llama", tmp_path, **{"data.chat_template": "on"})
    with pytest.raises(ConfigError, match=r"data\.chat_template: got 'on' .* has no chat template; allowed: auto .* or off"):
        train(cfg)
    assert not (tmp_path / "mlflow.db").exists()
    with pytest.raises(ConfigError, match=r"data\.chat_template: .*allowed: 'auto', 'on', 'off'|data\.chat_template"):
        _config(model_dirs, "llama", tmp_path, **{"data.chat_template": "yes"})


@needs_shared
def test_activation_checkpointing_without_transformers_warning(model_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs / "llama" / "sft")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enable_gradient_checkpointing(model)
    assert model.is_activation_checkpointing
