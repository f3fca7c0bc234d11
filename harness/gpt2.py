"""GPT-2 forwards written against the model's own modules, for the two shapes where transformers'
general forward wastes most of a small model's time: sampling one token at a time
(`StaticGPT2Decoder`) and teacher-forced passes over left/right-padded rollouts (`packed_hidden`).

Both compute transformers' GPT2Model formulas in eval mode (token + position embeddings, pre-LN
blocks of Conv1D attention and MLP, final LN) and equal the model's own forward up to float
round-off; `supports` says when a module qualifies (anything else takes the general path).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def supports(model: torch.nn.Module, lm: bool) -> bool:
    """A GPT-2 LM (`lm`) or trunk in eval mode (dropout off: train mode means gradient checkpointing)
    without cross-attention or the upcast/reordered attention variant."""
    cfg = getattr(model, "config", None)
    want = "GPT2LMHeadModel" if lm else "GPT2Model"
    if type(model).__name__ != want or cfg is None or model.training:
        return False
    if getattr(cfg, "add_cross_attention", False) or getattr(cfg, "reorder_and_upcast_attn", False):
        return False
    blk = (model.transformer if lm else model).h[0]
    return hasattr(blk.attn, "scaling") and hasattr(blk.attn, "c_attn") and hasattr(blk.mlp, "act")


def block(blk: torch.nn.Module, x: torch.Tensor, attend: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One pre-LN GPT-2 block: x + attn(ln_1 x), then + mlp(ln_2 x). `attend(attn_module, qkv)`
    turns the fused q|k|v projection into the attention output (before c_proj), in x's layout."""
    a, mlp = blk.attn, blk.mlp
    x = x + a.c_proj(attend(a, a.c_attn(blk.ln_1(x))))
    return x + mlp.c_proj(mlp.act(mlp.c_fc(blk.ln_2(x))))


SHORT_ROWS = 64
"""Rows up to this length take the explicit softmax(q k^T) v form in `causal_attention`: on CPU it
beats the flash kernel's tiling overhead for short rows (world rollouts are ~40 tokens), and above
it the flash kernel wins (`bench/attention.py` measures both)."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * q k^T + causal mask) v over [B, H, L, D]: the same formula either way, one
    of two kernels by row length (they agree to float round-off)."""
    if q.shape[-2] > SHORT_ROWS or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return explicit_causal_attention(q, k, v, scale)


def explicit_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * q k^T + causal mask) v as three batched kernels (baddbmm, softmax, bmm)."""
    L = q.shape[-2]
    # additive mask: -inf above the diagonal; the diagonal is always kept, so no row is empty
    mask = torch.full((L, L), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
    return torch.baddbmm(mask, q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2), alpha=scale) \
        .softmax(-1).bmm(v.flatten(0, 1)).view_as(q)


def packed_hidden(trunk: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """Final hidden states [M, E] at the positions `out` ([B, T] bool, real positions only, in
    row-major order) of the padded batch ids/attn/pos [B, T], whose real tokens (attn == 1) are one
    contiguous span per row (a left-padded prompt, then a right-padded response).

    Only the N real tokens go through the embeddings, linear layers, layer norms and GELU, as one
    [N, E] matrix: on rollouts that is about half the work of the padded batch. Attention alone
    runs in a [B, H, L, D] layout where each row's span starts at 0 (L = the longest span; a scatter
    in, a gather out, none without padding), so plain causal attention is exact for every real
    query (a row's pads come after its real tokens) and no pad query row is empty (no NaN, even in
    the backward pass). Real rows equal the padded forward up to float round-off.
    """
    B, T = ids.shape
    E, H = trunk.config.n_embd, trunk.config.n_head
    real = attn.bool()
    lens = real.sum(1)
    L = int(lens.max())
    flat = real.flatten().nonzero().squeeze(1)  # [N] positions of the real tokens in B*T
    # their places in the [B, L] layout: row b's span moved to start at column 0
    at = None if L == T and len(flat) == B * T else (
        torch.arange(B, device=ids.device).repeat_interleave(lens) * L + real.long().cumsum(1)[real] - 1)
    x = trunk.wte(ids.flatten()[flat]) + trunk.wpe(pos.flatten()[flat])

    def attend(a: torch.nn.Module, qkv: torch.Tensor) -> torch.Tensor:
        if at is not None:
            qkv = qkv.new_zeros(B * L, 3 * E).index_copy_(0, at, qkv)
        q, k, v = qkv.view(B, L, 3, H, E // H).transpose(1, 3).unbind(2)  # [B, H, L, D] each
        o = causal_attention(q, k, v, a.scaling).transpose(1, 2).reshape(B * L, E)
        return o if at is None else o[at]

    for blk in trunk.h:
        x = block(blk, x, attend)
    return trunk.ln_f(x[out.flatten()[flat]])


class StaticGPT2Decoder:
    """Incremental GPT-2 forward for sampling: key/value buffers allocated once for prompt +
    max_new_tokens, attention masks built once, and the LM head applied only at the position being
    sampled: no per-token cache objects, masks or output containers (they dominate sampling for
    small models)."""

    def __init__(self, model: torch.nn.Module, prompt_mask: torch.Tensor, max_new_tokens: int):
        self.model, self.tr = model, model.transformer
        self.E, self.H = model.config.n_embd, model.config.n_head
        self.D = self.E // self.H
        B, self.P = prompt_mask.shape
        self.L = self.P + max_new_tokens
        self.k: list[torch.Tensor | None] = [None] * len(self.tr.h)  # key/value buffers [B, H, L, D] per layer
        self.v: list[torch.Tensor | None] = [None] * len(self.tr.h)
        # keys a query may attend to: real prompt tokens and everything generated (as the model's
        # own path does: generated positions are never masked); each query also sees itself, so a
        # left-pad query row is never empty (its output is unused, but must not be NaN)
        self.key_ok = torch.cat([prompt_mask.bool(), prompt_mask.new_ones(B, max_new_tokens, dtype=torch.bool)], 1)
        self.t = 0  # positions filled so far

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        return supports(model, lm=True)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Run new tokens ids [B, T] at positions pos [B, T] through the blocks; returns the last
        position's logits [B, V]. mask: [B, 1, T, t+T] bool (True = attend)."""
        B, T = ids.shape
        t0, t1 = self.t, self.t + T

        def attend(a: torch.nn.Module, qkv: torch.Tensor) -> torch.Tensor:
            q, k, v = (z.view(B, T, self.H, self.D).transpose(1, 2) for z in qkv.split(self.E, dim=2))
            if self.k[i] is None:
                self.k[i], self.v[i] = k.new_empty(B, self.H, self.L, self.D), v.new_empty(B, self.H, self.L, self.D)
            kc, vc = self.k[i], self.v[i]
            kc[:, :, t0:t1], vc[:, :, t0:t1] = k, v
            o = F.scaled_dot_product_attention(q, kc[:, :, :t1], vc[:, :, :t1], attn_mask=mask, scale=a.scaling)
            return o.transpose(1, 2).reshape(B, T, self.E)

        x = self.tr.wte(ids) + self.tr.wpe(pos)
        for i, blk in enumerate(self.tr.h):
            x = block(blk, x, attend)
        self.t = t1
        return self.model.lm_head(self.tr.ln_f(x[:, -1]))

    def prefill(self, prompt_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        P = self.P
        causal = torch.ones(P, P, dtype=torch.bool, device=prompt_ids.device).tril()
        mask = (causal[None] & self.key_ok[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=prompt_ids.device)[None]
        return self._forward(prompt_ids, pos, mask[:, None])

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self._forward(tok[:, None], pos[:, None], self.key_ok[:, None, None, : self.t + 1])
