"""Where a number came from: code, machine, libraries and world, logged as `provenance.*` tags with
every run and printed in reports. Float rounding differs between CPUs (AVX-512 + bf16 vs AVX2-only
machines train slightly different worlds and runs from one seed), so results compare only with
their machine.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

# Flags that change which kernels run, and so the float rounding (x86 and Arm).
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "fma", "f16c",
                     "asimd", "sve", "bf16")
PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "mlflow", "optuna", "pydantic", "deepspeed")
REPO = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    """Output of a git command in this checkout ('' outside one)."""
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit(ignore: tuple[str, ...] = ()) -> str:
    """Short commit of the code, with ' (uncommitted changes)' when the tree is dirty; `ignore`:
    git pathspecs not counted (a builder's own previous outputs, which it is about to rewrite)."""
    c = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":(exclude){p}" for p in ignore))
    return c + (" (uncommitted changes)" if c != "unknown" and dirty else "")


@lru_cache(maxsize=1)
def cpu() -> dict[str, str]:
    """CPU model and the kernel-relevant flags (from /proc/cpuinfo where there is one)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model") and model in (platform.processor(), platform.machine()):
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": " ".join(f for f in FLAGS_OF_INTEREST if f in flags) or "none of interest",
            "logical_cpus": str(os.cpu_count())}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def world(world_dir: str | Path | None) -> dict[str, str]:
    """The built world's config hash, content hash and measured properties (RM accuracies, SFT gold), if any."""
    if not world_dir:
        return {}
    from harness.world.load import WORLD_FILE

    try:
        info = json.loads((Path(world_dir) / WORLD_FILE).read_text())
    except (OSError, ValueError):
        return {}
    metrics = {k: f"{v:.4g}" for k, v in sorted(info.get("metrics", {}).items()) if isinstance(v, (int, float))}
    from harness.world.shipped import content_hash  # the bytes: one config builds other weights on another CPU

    return {"hash": str(info.get("config_hash", "unknown")), "content": content_hash(world_dir), **metrics}


def record(world_dir: str | Path | None = None) -> dict[str, str]:
    """Flat `provenance.*` tags for an MLflow run: commit, machine, libraries, world."""
    tags = {"provenance.commit": commit()}
    for part, values in (("cpu", cpu()), ("version", versions()), ("world", world(world_dir))):
        tags.update({f"provenance.{part}.{k}": v for k, v in values.items()})
    return tags
