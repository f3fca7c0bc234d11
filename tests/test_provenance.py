"""Provenance tags: code, machine, libraries and world, read from the real sources."""
import json
import platform

from harness import provenance


def test_record_names_code_machine_libraries_and_world(tmp_path):
    (tmp_path / "world.json").write_text(json.dumps({"config_hash": "abc123", "metrics": {"rm/eval_acc": 0.7412, "x": "n/a"}}))
    tags = provenance.record(tmp_path)
    assert tags["provenance.version.python"] == platform.python_version()
    assert tags["provenance.version.torch"].startswith("2.")
    assert tags["provenance.cpu.model"] and tags["provenance.cpu.logical_cpus"].isdigit()
    assert tags["provenance.world.hash"] == "abc123" and tags["provenance.world.rm/eval_acc"] == "0.7412"
    assert "provenance.world.x" not in tags
    assert provenance.record(tmp_path / "missing") .get("provenance.world.hash") is None
    assert all(isinstance(v, str) and v for v in tags.values())
