"""How far the current code's fixed-seed steps are from the values pinned in
tests/test_fixed_seed_step.py (recorded before any speed work), per case and metric.

    .venv/bin/python -m bench.math_drift                       # every case, as configured
    .venv/bin/python -m bench.math_drift --set model.autocast=bf16 --case bench_paths

The test allows rel 2e-4 / abs 2e-5; this prints the actual largest deviations, and with --set
shows what a mode (bf16 autocast) does to the losses on the same seed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", default=[])
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--show", type=int, default=8, help="metrics listed per case (largest deviations)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    import test_fixed_seed_step as t

    from harness.config import parse_overrides, set_dotted

    over = parse_overrides(args.overrides)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        t.build_models(root)
        for name in args.case or list(t.CASES):
            base = json.loads(json.dumps(t.CASES[name]))
            for k, v in over.items():
                set_dotted(base, k, v)
            t.CASES[name] = base
            m, toks = t.run_case(name, root)
            pinned = t.PINNED[name]
            rows = []
            for k, want in pinned.items():
                got = m.get(k, float("nan"))
                # deviation as a fraction of the test's tolerance (abs 2e-5 + rel 2e-4): < 1 passes
                rel = abs(got - want) / (2e-5 + 2e-4 * abs(want))
                rows.append((rel, k, want, got))
            rows.sort(reverse=True)
            same = sum(a == b for a, b in zip(toks, t.TOKENS[name]))
            out[name] = {"tokens_equal": toks == t.TOKENS[name], "tokens_same_frac": same / len(t.TOKENS[name]),
                         "max_dev_over_tol": rows[0][0],
                         "top": [{"metric": k, "pinned": w, "now": g, "dev_over_tol": r} for r, k, w, g in rows[: args.show]]}
            print(f"== {name} ({', '.join(args.overrides) or 'as configured'}): tokens equal={toks == t.TOKENS[name]} "
                  f"({same}/{len(toks)} same); largest deviation = {rows[0][0]:.2e} x the test tolerance")
            for r, k, w, g in rows[: args.show]:
                print(f"   {k:28s} pinned {w: .8g}  now {g: .8g}  {r:.1e} x tol")
    print("BENCH_JSON " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
