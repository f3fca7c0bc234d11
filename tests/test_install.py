"""A non-editable install run from another directory: the registry is found in ./ablations or
--registry, and an empty registry is an error, not an empty table; the wheel ships `harness` alone
(no top-level `analysis` or `reports` package in site-packages), and the main job, which draws with
them, says it runs from a checkout (issue 13)."""
import functools
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
    assert (site / "harness" / "ablate.py").is_file()
    assert (site / "harness" / "detector_params_no_audit.json").is_file()  # the default early-warning detector ships
    from harness.world import shipped

    installed = site / "harness" / "world" / "shipped"  # and the default world, as its archive and manifest
    assert shipped.manifest(installed) == shipped.manifest()
    assert all((installed / e["archive"]).stat().st_size == (shipped.SHIPPED_DIR / e["archive"]).stat().st_size
               for e in shipped.manifest().values())
    assert [p.name for p in site.iterdir() if (p / "__init__.py").is_file()] == ["harness"]  # no analysis, reports
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy, not the checkout

    def run(module: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", module, *args], cwd=elsewhere, env=env, capture_output=True,
                              text=True, timeout=300)

    ablate = functools.partial(run, "harness.ablate")

    r = ablate("--list")
    assert r.returncode == 2 and "no figure files" in r.stderr and "--registry" in r.stderr
    r = ablate("--list", "--registry", str(REPO / "ablations"))
    assert r.returncode == 0 and "score_reparam.yaml" in r.stdout
    r = ablate(str(REPO / "ablations" / "score_reparam.yaml"), "--dry-run")  # valid; no world is built here (rc 2)
    assert r.returncode == 2 and "all configs valid" in r.stdout and "holds no built world" in r.stderr, r.stderr
    r = run("harness.main", "--ablation", str(REPO / "ablations" / "score_reparam.yaml"))
    assert r.returncode == 2 and "run it from a checkout" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not list(elsewhere.iterdir())  # no store, no runs
    assert str(site) in subprocess.run([sys.executable, "-c", "import harness; print(harness.__file__)"], cwd=elsewhere,
                                       env=env, capture_output=True, text=True).stdout
