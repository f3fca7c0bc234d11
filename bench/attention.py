"""Causal attention on CPU: the flash kernel (`F.scaled_dot_product_attention`) against the explicit
softmax(q k^T) v form, forward + backward, by row length; the crossover sets `gpt2.SHORT_ROWS`.

    python -m bench.attention [--batch 16] [--heads 4] [--dim 32] [--lengths 16 32 48 64 96 128 256]

One torch thread (the grid's setting); the two kernels alternate, best of several repetitions.
Prints one table row per length and the largest length where the explicit form still wins.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16, help="rows per minibatch (world: 16)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32, help="head dimension")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 48, 64, 96, 128, 256])
    ap.add_argument("--reps", type=int, default=60)
    a = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from bench.common import best_us
    from harness.gpt2 import SHORT_ROWS, explicit_causal_attention
    from harness.provenance import cpu

    torch.set_num_threads(1)
    torch.manual_seed(0)
    scale = a.dim ** -0.5
    flash = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # noqa: E731
    explicit = lambda q, k, v: explicit_causal_attention(q, k, v, scale)  # noqa: E731

    print(f"torch {torch.__version__}, {cpu()['model']} ({cpu()['flags']}), 1 thread, B={a.batch} H={a.heads} D={a.dim}; current SHORT_ROWS={SHORT_ROWS}")
    print("| L | flash fwd us | explicit fwd us | flash fwd+bwd us | explicit fwd+bwd us | explicit / flash (fwd, fwd+bwd) | max abs diff |\n"
          "|---|---|---|---|---|---|---|")
    wins = []
    for L in a.lengths:
        q, k, v = (torch.randn(a.batch, a.heads, L, a.dim, requires_grad=True) for _ in range(3))
        g = torch.randn(a.batch, a.heads, L, a.dim)
        diff = (flash(q, k, v) - explicit(q, k, v)).abs().max().item()

        def forward(fn):
            with torch.no_grad():
                fn(q, k, v)

        def times(fn):  # us per forward without autograd (scoring), per forward + backward (the update):
            # the best of many short loops, so one disturbed loop does not decide
            n = max(1, a.reps // 5)
            return best_us(lambda: forward(fn), 5, n), best_us(lambda: fn(q, k, v).backward(g), 5, n)

        ff = fe = tf = te = float("inf")
        for _ in range(3):  # alternate so both see the same machine state
            (f1, t1), (f2, t2) = times(flash), times(explicit)
            ff, tf, fe, te = min(ff, f1), min(tf, t1), min(fe, f2), min(te, t2)
        if te < tf and fe < ff:
            wins.append(L)
        print(f"| {L} | {ff:.0f} | {fe:.0f} | {tf:.0f} | {te:.0f} | "
              f"{fe / ff:.2f}, {te / tf:.2f} | {diff:.1e} |")
    print(f"explicit form faster (forward and forward + backward) at L in {wins}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
