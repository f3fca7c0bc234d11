"""The CPU fast paths compute the model's own formulas: `rollout.GELUTanh` is gelu_new (forward and
gradient), and `gpt2.packed_hidden` gives transformers' GPT-2 hidden states and gradients at the
real tokens of a left/right-padded batch, through both attention kernels (short rows: explicit
softmax; long rows: the flash kernel)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.activations import NewGELUActivation

from harness import gpt2
from harness.rollout import GELUTanh, fuse_activations, position_ids


def test_gelu_tanh_is_gelu_new_forward_and_backward():
    torch.manual_seed(0)
    x = (torch.randn(300, 64) * 4).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    ref = NewGELUActivation()(x64)
    got = GELUTanh()(x)
    assert torch.allclose(got.double(), ref, atol=2e-6)
    g = torch.randn_like(x)
    (dx,) = torch.autograd.grad(got, x, g)
    (dref,) = torch.autograd.grad(ref, x64, g.double())
    assert torch.allclose(dx.double(), dref, atol=2e-5)
    with torch.no_grad():  # the no-grad path is the same form
        assert torch.equal(GELUTanh()(x), got.detach())


def padded_batch(L_prompt: int, L_resp: int, B: int = 6):
    """Prompts left-padded to L_prompt, responses right-padded to L_resp, lengths all different."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 90, (B, L_prompt + L_resp), generator=g)
    attn = torch.zeros_like(ids)
    for b in range(B):
        p = L_prompt - (b % 3) * (L_prompt // 4)
        r = L_resp - (b * 2) % L_resp if b else L_resp  # row 0 fills the whole width
        attn[b, L_prompt - p: L_prompt + r] = 1
    return ids, attn


@pytest.mark.parametrize("short_rows", [10_000, 0], ids=["explicit-softmax", "flash"])
@pytest.mark.parametrize("shape", [(6, 10), (40, 50)], ids=["short", "long"])
def test_packed_hidden_equals_the_models_forward(monkeypatch, short_rows, shape):
    monkeypatch.setattr(gpt2, "SHORT_ROWS", short_rows)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=128, n_embd=32, n_layer=2, n_head=4,
                                       attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)).eval()
    fuse_activations(model)
    assert gpt2.supports(model, lm=True)
    ids, attn = padded_batch(*shape)
    pos = position_ids(attn)
    real = attn.bool()
    ref = model.transformer(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state[real]
    got = gpt2.packed_hidden(model.transformer, ids, attn, pos, real)
    assert torch.allclose(got, ref, atol=1e-5)
    # gradients of the same loss through both forwards
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), list(model.parameters()))
    got = gpt2.packed_hidden(model.transformer, ids, attn, pos, real)
    g_got = torch.autograd.grad((got * w).sum(), list(model.parameters()), allow_unused=True)
    for a, b in zip(g_ref, g_got):
        assert torch.allclose(a, b if b is not None else torch.zeros_like(a), atol=1e-4)


@pytest.mark.parametrize("L", [1, 20, 100])
def test_causal_attention_kernels_agree(L):
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, L, 8) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    assert torch.allclose(gpt2.explicit_causal_attention(q, k, v, 0.3), ref, atol=1e-6)
    assert torch.allclose(gpt2.causal_attention(q, k, v, 0.3), ref, atol=1e-6)
