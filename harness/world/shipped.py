"""Worlds that ship with the project: the reference's world, so every CPU trains on the same one.

A world is built deterministically from its config, but only on one kind of CPU: float kernels
round differently on another (an AMD EPYC and an Intel Xeon built world 0 with held-out RM accuracy
0.740 and 0.717 from one config hash), and so do the runs and verdicts on it. So the default world
is shipped as an archive (`harness/world/shipped/<config hash>.tar.xz`), listed in `manifest.json`
with its sha256 and its content hash (`content_hash`), and `build_world` unpacks it instead of
building when the config matches (about a second instead of two to three minutes).

    python -m harness.world pack .harness/world     # a built world -> an archive + manifest entry
    python -m harness.world build --no-shipped      # build from the config on this CPU instead

The content hash identifies what runs read: every file of the world folder but build_info.json
(its timings), by path and bytes. Runs log it as `provenance.world.content`, so two worlds of one
config hash built on two CPUs are told apart.
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import lzma
import os
import tarfile
from pathlib import Path
from typing import Any

from harness.world.load import WORLD_FILE

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
MANIFEST = "manifest.json"
NOT_CONTENT = {"build_info.json"}  # timings and the build's start time: not what runs read


class ShippedWorldError(RuntimeError):
    """A shipped archive that does not match its manifest (damaged, replaced, half checked out)."""


def _files(world_dir: Path) -> list[Path]:
    return sorted(p for p in world_dir.rglob("*") if p.is_file() and p.relative_to(world_dir).as_posix()
                  not in NOT_CONTENT)


def content_hash(world_dir: str | Path) -> str:
    """sha256 (16 hex digits) of a world folder's files by relative path and bytes, build_info.json left out."""
    d = Path(world_dir)
    st = (d / WORLD_FILE).stat()  # a rebuild rewrites world.json: hashed anew
    return _content_hash(d.resolve(), (st.st_mtime_ns, st.st_ino))


@functools.lru_cache(maxsize=8)
def _content_hash(d: Path, version: tuple[int, int]) -> str:
    h = hashlib.sha256()
    for p in _files(d):
        h.update(p.relative_to(d).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:16]


def manifest(shipped_dir: Path | None = None) -> dict[str, dict[str, Any]]:
    """Config hash -> {archive, sha256, content, built_on, metrics} of each shipped world."""
    path = (shipped_dir or SHIPPED_DIR) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def shipped(config_hash: str, shipped_dir: Path | None = None) -> dict[str, Any] | None:
    """The manifest entry of the shipped world of this config hash, or None."""
    return manifest(shipped_dir).get(config_hash)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def unpack(config_hash: str, dest: Path, shipped_dir: Path | None = None) -> dict[str, Any]:
    """Unpack the shipped world of `config_hash` into the new folder `dest` (the caller renames it into
    place): the archive's sha256 and the unpacked content hash are checked against the manifest."""
    shipped_dir = shipped_dir or SHIPPED_DIR
    entry = shipped(config_hash, shipped_dir)
    if entry is None:
        raise ShippedWorldError(f"no shipped world for config hash {config_hash} in {shipped_dir / MANIFEST}")
    archive = shipped_dir / entry["archive"]
    fix = ("restore it with `git checkout -- harness/world/shipped`, or build the world on this CPU with "
           "`python -m harness.world build --no-shipped`")
    if not archive.is_file():
        raise ShippedWorldError(f"{archive}: the shipped world's archive is missing; {fix}")
    got = _sha256(archive)
    if got != entry["sha256"]:
        raise ShippedWorldError(f"{archive}: sha256 {got[:16]}…, the manifest says {entry['sha256'][:16]}… "
                                f"(a damaged or replaced archive; git-lfs pointer?); {fix}")
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(dest, filter="data")  # plain files under dest only (no links, no absolute paths)
    content = content_hash(dest)
    if content != entry["content"]:
        raise ShippedWorldError(f"{archive}: unpacked content hash {content}, the manifest says {entry['content']}; {fix}")
    return entry


def pack(world_dir: str | Path, shipped_dir: Path | None = None, cpu: dict[str, str] | None = None) -> dict[str, Any]:
    """A built world folder -> shipped_dir/<config hash>.tar.xz (reproducible: sorted, no times or
    owners) and its manifest entry, which is returned. Replaces an earlier archive of the same config.
    `cpu`: the machine's (harness.provenance.cpu), for a build that did not record its own."""
    shipped_dir = shipped_dir or SHIPPED_DIR
    d = Path(world_dir)
    info = json.loads((d / WORLD_FILE).read_text())
    chash = info["config_hash"]
    build_info = json.loads((d / "build_info.json").read_text()) if (d / "build_info.json").is_file() else {}
    shipped_dir.mkdir(parents=True, exist_ok=True)
    archive = shipped_dir / f"{chash}.tar.xz"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(p for p in d.rglob("*") if p.is_file()):
            ti = tarfile.TarInfo(p.relative_to(d).as_posix())
            ti.size, ti.mode, ti.mtime = p.stat().st_size, 0o644, 0
            with p.open("rb") as f:
                tar.addfile(ti, f)
    tmp = archive.with_suffix(".tmp")
    tmp.write_bytes(lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    os.replace(tmp, archive)
    cpu = build_info.get("cpu") or cpu or {}  # older builds did not record theirs: the packing machine's
    entry = {"archive": archive.name, "sha256": _sha256(archive), "content": content_hash(d),
             "built_on": {"cpu.model": cpu.get("model", "unknown"), "cpu.flags": cpu.get("flags", "unknown"),
                          "cpu.recorded_by": "the build" if build_info.get("cpu") else "the packing machine",
                          "built_at": build_info.get("built_at", "unknown"),
                          "torch_threads": build_info.get("torch_threads", "unknown")},
             "metrics": info.get("metrics", {})}
    (shipped_dir / MANIFEST).write_text(json.dumps({**manifest(shipped_dir), chash: entry}, indent=1, sort_keys=True)
                                        + "\n")
    return entry
