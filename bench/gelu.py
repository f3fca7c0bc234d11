"""GPT-2's gelu_new on CPU: aten's fused tanh-GELU kernel against `rollout.gelu_tanh_cpu` (the same
function as x * sigmoid(2u)), forward and the backward `_GELUTanh` uses, on an update-sized tensor.

    python -m bench.gelu [--rows 640] [--width 512]

One torch thread (the grid's setting); the forms alternate, best of several repetitions.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gelu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=640, help="tokens in a minibatch (world: ~16 x 40)")
    ap.add_argument("--width", type=int, default=512, help="MLP width (world: 4 x 128)")
    a = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from bench.common import best_us
    from harness.provenance import cpu
    from harness.rollout import GELUTanh, gelu_tanh_cpu

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(a.rows, a.width)
    ref = F.gelu(x.double(), approximate="tanh")
    err = {"aten": (F.gelu(x, approximate="tanh").double() - ref).abs().max().item(),
           "sigmoid form": (gelu_tanh_cpu(x).double() - ref).abs().max().item()}
    xg = x.clone().requires_grad_()
    g = torch.randn_like(x)
    rows = []
    for _ in range(2):  # alternate: both see the same machine state
        rows.append((best_us(lambda: F.gelu(x, approximate="tanh")), best_us(lambda: gelu_tanh_cpu(x)),
                     best_us(lambda: F.gelu(xg, approximate="tanh").backward(g)),
                     best_us(lambda: GELUTanh()(xg).backward(g))))
    fa, fs, ba, bs = (min(c) for c in zip(*rows))
    print(f"torch {torch.__version__}, {cpu()['model']} ({cpu()['flags']}), 1 thread, x [{a.rows}, {a.width}] fp32")
    print("| form | forward us | forward + backward us | max abs err vs fp64 |\n|---|---|---|---|")
    print(f"| aten F.gelu(approximate='tanh') | {fa:.0f} | {ba:.0f} | {err['aten']:.1e} |")
    print(f"| x * sigmoid(2u) (rollout.GELUTanh) | {fs:.0f} | {bs:.0f} | {err['sigmoid form']:.1e} |")
    print(f"forward {fa / fs:.2f}x, forward + backward {ba / bs:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
