"""The scientific bar of the embedded world: vanilla PPO collapses, PPO-max beats the SFT model.

    python -m bench.scientific_bar [--steps 200] [--seeds 0,1,2] [--workers 2]

Runs Fig. 4's grid (ablations/vanilla.yaml: vanilla PPO) and the PPO-max variant of Fig. 8's grid
(ablations/ppo_max.yaml) through the ablation runner at one step budget, then reads the runs back
from MLflow and prints, per setting, mean +- std over seeds of:
  - gold reward (held-out eval prompts) at step 0 (= the SFT model), at its peak, at the end;
  - win rate vs the SFT model at the end (gold-judged, ties half);
  - RM score start -> end; KL, perplexity and length at the end; how many seeds collapsed.
Rerunning reuses finished runs (the runner resumes), so the numbers can be re-printed cheaply.
Not a test: it trains for minutes.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_grid(file: str, steps: int, seeds: str, workers: int, uri: str, variant: str | None) -> float:
    cmd = [sys.executable, "-m", "harness.ablate", file, "--workers", str(workers), "--seeds", seeds,
           "--tracking-uri", uri, "--set", f"ppo.steps={steps}", "--no-progress"]
    if variant:
        cmd += ["--variant", variant]
    t = time.time()
    subprocess.run(cmd, cwd=ROOT, check=False)
    return time.time() - t


def ms(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "n/a"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):+.2f} ± {sd:.2f}"


def per_run(uri: str, ablation: str, variant: str) -> list[dict]:
    from analysis.store import load_ablation

    data = load_ablation(ablation, uri)
    runs = data.runs[data.runs["variant"] == variant]
    m = data.metrics(["eval/gold_score", "eval/win_rate_vs_sft", "objective/rm_score", "objective/kl",
                      "objective/ppl", "response/length_mean", "objective/gold_score"])
    out = []
    for _, r in runs.iterrows():
        mr = m[m["run_id"] == r["run_id"]]

        def series(key):
            s = mr[mr["metric"] == key].sort_values("step")
            return s["step"].tolist(), s["value"].tolist()

        _, ev = series("eval/gold_score")
        _, wr = series("eval/win_rate_vs_sft")
        _, rm = series("objective/rm_score")
        _, kl = series("objective/kl")
        _, ppl = series("objective/ppl")
        _, ln = series("response/length_mean")
        tail = lambda xs: statistics.mean(xs[-10:]) if xs else float("nan")  # noqa: E731
        out.append({
            "gold_start": ev[0] if ev else float("nan"), "gold_peak": max(ev) if ev else float("nan"),
            "gold_end": ev[-1] if ev else float("nan"), "win_end": wr[-1] if wr else float("nan"),
            "rm_start": statistics.mean(rm[:5]) if rm else float("nan"), "rm_end": tail(rm),
            "kl_end": tail(kl), "ppl_end": tail(ppl), "len_end": tail(ln),
            "collapsed": bool(r["collapsed"]),
        })
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    ap.add_argument("--no-run", action="store_true", help="only read back and print")
    args = ap.parse_args()
    from harness.world import build_world, load_world_config

    build_world(load_world_config(), ROOT / ".harness/world", tracking_uri=args.tracking_uri)
    if not args.no_run:
        t1 = run_grid("ablations/vanilla.yaml", args.steps, args.seeds, args.workers, args.tracking_uri, None)
        t2 = run_grid("ablations/ppo_max.yaml", args.steps, args.seeds, args.workers, args.tracking_uri, "PPO-max")
        print(f"wall: vanilla grid {t1:.0f} s, PPO-max {t2:.0f} s")
    rows = [("vanilla PPO", per_run(args.tracking_uri, "vanilla", "vanilla PPO")),
            ("PPO-max", per_run(args.tracking_uri, "ppo_max", "PPO-max"))]
    print(f"\n{args.steps} PPO steps, seeds {args.seeds}; mean ± std over seeds (eval = held-out prompts)\n")
    print("| setting | gold @0 (SFT) | gold peak | gold end | win rate vs SFT (end) | RM start -> end | KL end | ppl end | length end | collapsed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, rs in rows:
        col = lambda k: [r[k] for r in rs]  # noqa: E731
        print(f"| {name} | {ms(col('gold_start'))} | {ms(col('gold_peak'))} | {ms(col('gold_end'))} | {ms(col('win_end'))} | "
              f"{ms(col('rm_start'))} -> {ms(col('rm_end'))} | {ms(col('kl_end'))} | {ms(col('ppl_end'))} | "
              f"{ms(col('len_end'))} | {sum(col('collapsed'))}/{len(rs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
