"""A non-editable install run from another directory: the registry is found in ./ablations or
--registry, and an empty registry is an error, not an empty table (issue 13)."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_installed_package_lists_and_dry_runs_from_another_directory(tmp_path):
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(REPO)],
                   check=True, capture_output=True)
    assert (site / "harness" / "ablate.py").is_file() and not (site / "ablations").exists()
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy, not the checkout

    def ablate(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "harness.ablate", *args], cwd=elsewhere, env=env,
                              capture_output=True, text=True)

    r = ablate("--list")
    assert r.returncode == 2 and "no figure files" in r.stderr and "--registry" in r.stderr
    r = ablate("--list", "--registry", str(REPO / "ablations"))
    assert r.returncode == 0 and "score_reparam.yaml" in r.stdout
    r = ablate(str(REPO / "ablations" / "score_reparam.yaml"), "--dry-run")
    assert r.returncode == 0 and "all configs valid" in r.stdout
    assert str(site) in subprocess.run([sys.executable, "-c", "import harness; print(harness.__file__)"], cwd=elsewhere,
                                       env=env, capture_output=True, text=True).stdout
