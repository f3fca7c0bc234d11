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


def test_commit_ignores_only_the_given_paths(tmp_path, monkeypatch):
    """A reference build rewrites reports/ over a previous build: those files do not make the code
    count as uncommitted, any other change does."""
    import subprocess

    from harness import provenance

    def sh(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    sh("init", "-q")
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "README.md").write_text("a")
    (tmp_path / "code.py").write_text("a")
    sh("add", ".")
    sh("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    assert not provenance.commit().endswith("(uncommitted changes)")
    (tmp_path / "reports" / "README.md").write_text("b")
    assert provenance.commit().endswith("(uncommitted changes)")
    assert not provenance.commit(ignore=("reports/README.md",)).endswith("(uncommitted changes)")
    (tmp_path / "code.py").write_text("b")
    assert provenance.commit(ignore=("reports/README.md",)).endswith("(uncommitted changes)")
