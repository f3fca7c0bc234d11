"""`python -m harness.world build [--config FILE.yaml] [--out DIR] [--set key=value ...]`, `show DIR`
(what a built world holds), `pack DIR` (ship a built world with the project) and `gold PROMPT
RESPONSE` (score one response)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys

from harness import prog, tracking
from harness.config import ConfigError

DEFAULT_OUT = ".harness/world"


def _parser() -> argparse.ArgumentParser:
    from harness.schema import help_text
    from harness.world.config import WorldConfig

    p = argparse.ArgumentParser(prog=prog("harness.world"), description="The embedded offline RLHF world.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser(
        "build", help="build (or reuse) a world",
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(  # at most 100 columns, any terminal
            prog, width=min(100, shutil.get_terminal_size().columns - 2)),
        description="Build the world deterministically from its config, or return at once when OUT\n"
                    "already holds a world built from the same config. The default world ships with the\n"
                    "project (harness/world/shipped/): it is unpacked and checked by its hash, not built,\n"
                    "so every CPU trains on the reference's world (--no-shipped builds it here).",
        epilog="config fields (set with --set key=value):\n" + help_text(WorldConfig),
    )
    b.add_argument("--config", help="YAML file of WorldConfig fields")
    b.add_argument("--out", default=DEFAULT_OUT, help=f"world folder (default {DEFAULT_OUT})")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set prefs.label_noise=0.3 (repeatable)")
    b.add_argument("--tiny", action="store_true", help="start from the tiny test scale (seconds to build)")
    b.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else "
                   "sqlite:///mlflow.db; 'none' = no logging)")
    b.add_argument("--experiment", default="world", help="MLflow experiment (default world)")
    b.add_argument("--force", action="store_true", help="rebuild (or unpack again) even when the cached world matches")
    b.add_argument("--no-shipped", action="store_true",
                   help="build from the config on this CPU even when the project ships this world (another CPU "
                   "builds other weights from one config: runs compare with the reference's world only within "
                   "the world-to-world spread)")
    b.add_argument("--quiet", action="store_true", help="no progress output")
    b.add_argument("--audit-rms", type=int, default=None, metavar="N",
                   help="also build N audit reward models beside the world in <out>-audit/ (harness.world.audit: each "
                   "on its own fresh preference pairs; runs log their scores as a second opinion on the reward, "
                   "model.audit_reward_paths=auto). Default 0; 3 is what model.audit_reward_paths=world builds")
    s = sub.add_parser("show", help="print what a built world holds")
    s.add_argument("dir", nargs="?", default=DEFAULT_OUT)
    k = sub.add_parser("pack", help="ship a built world with the project (harness/world/shipped/)",
                       description="Pack a built world folder into harness/world/shipped/<config hash>.tar.xz and "
                       "its manifest entry (sha256, content hash, the CPU it was built on); build_world then "
                       "unpacks it for that config instead of building. Commit both files.")
    k.add_argument("dir", nargs="?", default=DEFAULT_OUT)
    g = sub.add_parser("gold", help="score one response with the gold reward (default weights)")
    g.add_argument("prompt")
    g.add_argument("response")
    g.add_argument("--not-ended", action="store_true", help="the response hit the length cap")
    return p


def main(argv: list[str] | None = None) -> int:
    tracking.redact_output()  # MLflow prints the store's URI, with its password: masked
    args = _parser().parse_args(argv)
    if args.cmd == "gold":
        from harness.world.gold import gold_breakdown

        print(json.dumps(gold_breakdown(args.prompt, args.response, not args.not_ended).__dict__, indent=1))
        return 0
    from harness.config import parse_overrides
    from harness.world import TINY, WorldError, build_world, load_world, load_world_config, shipped

    try:
        if args.cmd == "pack":
            w = load_world(args.dir)
            from harness.provenance import cpu

            entry = shipped.pack(w.dir, cpu=cpu())
            print(json.dumps({"config_hash": w.config_hash, **entry}, indent=1))
            print(f"packed into {shipped.SHIPPED_DIR / entry['archive']} "
                  f"({(shipped.SHIPPED_DIR / entry['archive']).stat().st_size / 1e6:.1f} MB); commit it and "
                  f"{shipped.SHIPPED_DIR / shipped.MANIFEST}", file=sys.stderr)
            return 0
        if args.cmd == "build":
            cfg = load_world_config(args.config, {**(TINY if args.tiny else {}), **parse_overrides(args.set)})
            from harness.tracking import resolve_uri

            uri = None if (args.tracking_uri or "x").lower() in ("", "none") else resolve_uri(args.tracking_uri)
            args.dir = build_world(cfg, args.out, tracking_uri=uri, experiment=args.experiment,
                                   progress=not args.quiet, force=args.force, shipped=not args.no_shipped)
            from harness.world.audit import ensure_audit

            n_audit = args.audit_rms or 0
            if n_audit < 0:
                raise ConfigError([f"--audit-rms: got {n_audit}; allowed: 0 (none) or a positive count"])
            ensure_audit(args.dir, n_audit, progress=not args.quiet)
        w = load_world(args.dir)
        counts = {} if args.cmd == "build" else {
            "train_prompts": len(w.train_prompts), "eval_prompts": len(w.eval_prompts), "sft_pairs": len(w.sft_pairs)}
        entry = shipped.shipped(w.config_hash)
        content = shipped.content_hash(w.dir)
        print(json.dumps({"dir": str(w.dir), "config_hash": w.config_hash, "content": content,
                          "shipped": None if entry is None else content == entry["content"], **counts,
                          "metrics": w.metrics}, indent=1))
        return 0
    except (ConfigError, WorldError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
