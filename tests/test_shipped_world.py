"""The default world ships with the project (harness/world/shipped.py): build_world unpacks it, checked
by its hashes, instead of building it; a damaged archive is an error that leaves nothing behind; a
world built here from the same config is told apart by its content hash; pack is reproducible."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from harness import provenance
from harness.world import WorldConfig, WorldError, build_world, load_world, shipped, world_config_hash

from helpers import store_uri


def test_the_default_world_is_shipped_and_unpacked_with_its_hashes_checked(tmp_path, capsys):
    chash = world_config_hash(WorldConfig())
    entry = shipped.shipped(chash)
    assert entry is not None, (
        f"the default world config (hash {chash}) has no shipped world; shipped: {sorted(shipped.manifest())}. "
        "After changing the world's defaults, build it and ship it: python -m harness.world build && "
        "python -m harness.world pack")
    out = build_world(WorldConfig(), tmp_path / "world")
    assert "unpacked the shipped one" in capsys.readouterr().out
    w = load_world(out)
    assert w.config_hash == chash and w.metrics == entry["metrics"]
    assert shipped.content_hash(out) == entry["content"]
    assert provenance.record(out)["provenance.world.content"] == entry["content"]
    assert not list(tmp_path.glob(".world.building-*"))
    assert build_world(WorldConfig(), out) == out  # cached: returns at once, quietly
    assert capsys.readouterr().out == ""


def test_an_unpacked_world_logs_its_world_run_as_a_build_does(tmp_path):
    """Figs. 2 and 3 read the RM's training from the world's MLflow run: an unpacked world logs it too."""
    from harness import keys as K
    from harness import tracking

    uri = store_uri(tmp_path)
    out = build_world(WorldConfig(), tmp_path / "world", tracking_uri=uri, progress=False)
    c = tracking.client(uri)
    (run,) = c.search_runs([c.get_experiment_by_name("world").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags[K.TAG_ROLE] == "world"
    assert run.data.tags[K.TAG_WORLD_SHIPPED] == shipped.content_hash(out)
    assert run.data.metrics[K.RM_EVAL_ACC] == load_world(out).metrics[K.RM_EVAL_ACC]
    assert len(c.get_metric_history(run.info.run_id, K.RM_EVAL_ACC)) > 5  # the curve Fig. 3 draws
    assert {a.path for a in c.list_artifacts(run.info.run_id)} >= {K.RM_SCORE_DIFF, "world.json"}


def test_a_damaged_archive_is_refused_and_leaves_no_world(tmp_path, monkeypatch):
    chash = world_config_hash(WorldConfig())
    damaged = tmp_path / "shipped"
    shutil.copytree(shipped.SHIPPED_DIR, damaged)
    archive = damaged / shipped.shipped(chash)["archive"]
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    monkeypatch.setattr(shipped, "SHIPPED_DIR", damaged)
    with pytest.raises(WorldError, match=f"{archive.name}: sha256 .* the manifest says .*--no-shipped"):
        build_world(WorldConfig(), tmp_path / "world", progress=False)
    assert not (tmp_path / "world").exists()
    assert not list(tmp_path.glob(".world.building-*")) + list(tmp_path.glob(".world.old-*"))  # nothing half-unpacked


def test_a_world_built_here_from_the_shipped_config_is_told_apart_by_its_content(tmp_path, capsys):
    out = build_world(WorldConfig(), tmp_path / "world", progress=False)
    prefs = out / "data" / "prefs_eval.jsonl"
    prefs.write_text(prefs.read_text().replace("a", "b", 1))  # as another CPU's build differs: in the bytes
    (out / "world.json").touch()  # a build rewrites world.json
    assert build_world(WorldConfig(), out) == out  # kept (runs may be on it), with a note
    note = capsys.readouterr().out
    assert "not the shipped one" in note and "--force" in note
    assert provenance.record(out)["provenance.world.content"] != shipped.shipped(world_config_hash(WorldConfig()))["content"]
    build_world(WorldConfig(), out, force=True, progress=False)  # the note's fix: the shipped one again
    assert shipped.content_hash(out) == shipped.shipped(world_config_hash(WorldConfig()))["content"]


def test_pack_is_reproducible_and_round_trips(tiny_world, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    first = shipped.pack(tiny_world, a)
    assert shipped.pack(tiny_world, b)["sha256"] == first["sha256"]  # the same bytes: no times, owners, order
    chash = load_world(tiny_world).config_hash
    assert shipped.manifest(a)[chash]["content"] == shipped.content_hash(tiny_world)
    shipped.unpack(chash, tmp_path / "unpacked", a)
    assert shipped.content_hash(tmp_path / "unpacked") == shipped.content_hash(tiny_world)


def test_the_cli_packs_shows_and_builds_without_the_shipped_world(tiny_world, tmp_path):
    run = [sys.executable, "-m", "harness.world"]
    show = subprocess.run([*run, "show", str(tiny_world)], capture_output=True, text=True, check=True)
    assert '"shipped": null' in show.stdout  # the tiny world's config is not shipped
    helptext = subprocess.run([*run, "build", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--no-shipped" in helptext and "harness/world/shipped" in helptext
