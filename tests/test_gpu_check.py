"""bench.gpu_check, the GPU path's one prepared check (issue 29), in its CPU mode at tiny sizes: the
same code as on a GPU (a device run against a CPU run, bf16 autocast, DeepSpeed ZeRO-2 / ZeRO-3 at one
rank that train, checkpoint and resume, the speed of a step beside TRL's), so the check cannot rot
while no GPU is lent. Also its refusals before anything is built, and the wheels that travel with it
(bench/gpu_wheels.txt) against the lock, the GPU image and what the check imports.

The CPU-mode run is one subprocess (~40-60 s on 2 busy cores: imports, a DeepSpeed start-up and a
fresh process for the speed step); the other tests take a second or less.
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from bench import gpu_check, gpu_wheels
from bench.gpu_parts import RUNS, history, responses
from harness.parallel import cpu_supports_bf16

from helpers import store_uri

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cpu_check(tiny_world, tmp_path_factory):
    """`python -m bench.gpu_check --device cpu --tiny` on the session's tiny world: (process, JSON, work folder)."""
    d = tmp_path_factory.mktemp("gpu_check")
    out, work = d / "check.json", d / "work"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--tiny", "--world", str(tiny_world),
                        "--out", str(out), "--workdir", str(work), "--trl-python", sys.executable],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-6000:]
    return p, json.loads(out.read_text()), work


@pytest.mark.slow
def test_cpu_mode_runs_every_part(cpu_check):
    p, res, _ = cpu_check
    assert p.returncode == 0 and res["passed"], p.stdout[-4000:] + p.stderr[-4000:]
    assert list(res["parts"]) == list(gpu_check.PARTS)
    for part, r in res["parts"].items():
        if part in gpu_check.BF16_PARTS and not cpu_supports_bf16():
            assert r["status"] == "skipped" and "no native bf16" in r["reason"], r
        else:
            assert r["status"] == "passed", (part, r)
    assert res["device"]["kind"] == "cpu" and res["world"]["hash"] and res["versions"]["torch"]
    assert "[gpu_check] passed" in p.stdout


@pytest.mark.slow
def test_correctness_compares_every_response_and_metric(cpu_check):
    _, res, work = cpu_check
    cmp = res["parts"]["correctness"]["comparison"]
    steps = res["steps"]
    assert cmp["responses_identical_through_step"] == steps and cmp["n_outside"] == 0, cmp
    assert cmp["values_compared"] > 20 * (steps + 1)  # every metric at step 0 (eval) and each step
    # read back from the store: two finished runs whose sample tables hold every response of a step
    uri = store_uri(work)
    runs = res["parts"]["correctness"]["runs"]
    rows = responses(uri, runs["cpu"]["run_id"], 1)
    assert rows == responses(uri, runs["device"]["run_id"], 1) and len(rows) == 8  # the tiny rollout batch
    assert len({r for _, r in rows}) > 2  # really sampled
    assert set(history(uri, runs["cpu"]["run_id"])) == set(range(steps + 1))


@pytest.mark.slow
def test_zero_runs_train_checkpoint_and_resume_on_one_rank(cpu_check):
    from harness import keys, tracking
    from harness.train import load_checkpoint

    _, res, work = cpu_check
    uri = store_uri(work)
    for part in ("zero2", "zero3"):
        r = res["parts"][part]
        assert all(r["checks"].values()) and r["backend"] == "gloo" and r["deepspeed_accelerator"] == "cpu", r
        assert r["vs_device_fp32"]["passed"] and r["vs_device_fp32"]["responses_identical_through_step"] == res["steps"]
        run_id = r["runs"]["first"]["run_id"]
        assert r["runs"]["resumed"]["run_id"] == run_id
        assert tracking.client(uri).get_run(run_id).info.status == "FINISHED"
        assert [s for s, _ in tracking.metric_history(uri, run_id, keys.PG_LOSS)] == list(range(1, res["steps"] + 1))
        assert load_checkpoint(work / "runs" / part)["step"] == res["steps"]
    assert RUNS["zero3"][1]["distributed.zero_stage"] == 3


@pytest.mark.slow
def test_speed_part_times_phases_and_mfu(cpu_check):
    _, res, _ = cpu_check
    s = res["parts"]["speed"]
    h = s["harness"]
    assert s["workload"]["size"] == "L2/E64/V256" and s["workload"]["batch"] == 4 and s["peak"]["device"] == "cpu"
    assert h["step_s"] > 0 and 0 < h["mfu"] < 1 and h["tokens_per_s"] > 0
    assert {"rollout", "scoring", "update"} <= set(h["phases_s"]) and all(v > 0 for k, v in h["phases_s"].items() if k != "advantage")
    assert s["workload"]["precision"].startswith("bf16" if cpu_supports_bf16() else "fp32")
    if importlib.util.find_spec("trl") is None:
        assert s["trl"] == {"status": "skipped", "reason": f"trl is not importable in {sys.executable} (no module named 'trl')"}
    else:
        assert s["trl"]["step_s"] > 0 and s["trl_over_harness"] > 0


def from_the_image() -> set[str]:
    """The image's packages, and what they need as installed here (the image brings its own
    versions of those), never through a package seen absent there (its versions here may need
    more than the image's do: typer here requires pydantic, which the image lacks)."""
    out, gone = set(gpu_wheels.read_pins(gpu_wheels.MACHINE)), gpu_wheels.absent()
    todo = list(out)
    while todo:
        try:
            reqs = md.requires(todo.pop()) or []
        except md.PackageNotFoundError:
            continue
        for r in map(gpu_wheels.Requirement, reqs):
            name = gpu_wheels.canon(r.name)
            if (r.marker is None or r.marker.evaluate({"extra": ""})) and name not in out and name not in gone:
                out.add(name)
                todo.append(name)
    return out


def allowed_distributions() -> set[str]:
    """What may be imported on the GPU machine: the image's packages (from_the_image), the carried
    wheels, and this checkout."""
    return from_the_image() | set(gpu_wheels.read_pins(gpu_wheels.WHEELS)) | {"harness"}


@pytest.mark.slow
def test_the_check_imports_only_what_travels_or_the_image_has(cpu_check):
    _, res, _ = cpu_check
    allowed = allowed_distributions()
    missing = [e for e in res["imported_distributions"] if not {gpu_wheels.canon(n) for n in e.split("|")} & allowed]
    assert not missing, f"imported, but neither carried (bench/gpu_wheels.txt) nor on the GPU image: {missing}"
    assert any("mlflow-skinny" in e for e in res["imported_distributions"])  # the MLflow that travels is the skinny one
    # and each carried wheel is needed: none of them is something the image brings already
    carried = set(gpu_wheels.read_pins(gpu_wheels.WHEELS)) - set(gpu_wheels.UPGRADES)
    assert not carried & from_the_image() and {"pydantic", "deepspeed", "sqlalchemy"} <= carried


# ------------------------------------------------------------------------------------------------
# bad input: a clear error before anything is built
# ------------------------------------------------------------------------------------------------
def refused(tmp_path, capsys, *args) -> str:
    world, work, out = tmp_path / "world", tmp_path / "work", tmp_path / "out.json"
    assert gpu_check.main([*args, "--world", str(world), "--workdir", str(work), "--out", str(out)]) == 2
    assert not out.exists() and not world.exists() and list(work.iterdir()) == []  # no world, store or model
    return capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_device_cuda_without_cuda_is_refused(tmp_path, capsys):
    err = refused(tmp_path, capsys, "--device", "cuda", "--tiny")
    assert "--device: got 'cuda' but no CUDA device is visible" in err and "allowed here: cpu" in err


def test_a_size_that_does_not_fit_is_refused_by_estimate(tmp_path, capsys):
    err = refused(tmp_path, capsys, "--device", "cpu", "--tiny", "--size", "L64/E16384/V50257")
    assert "--size: got 'L64/E16384/V50257'" in err and "GiB by estimate (weights" in err
    assert "this machine's memory has" in err and "allowed: at most 90% of it" in err


def test_bad_arguments_name_what_is_allowed(tmp_path, capsys):
    err = refused(tmp_path, capsys, "--device", "cpu", "--tiny", "--parts", "correctness,zero4", "--steps", "4",
                  "--stop-at", "4", "--size", "L2/E63/V9/H2")
    assert "--parts: got 'correctness,zero4'; allowed: a comma-separated subset of correctness, bf16_autocast" in err
    assert "--stop-at: got 4; allowed: 1 to 3" in err
    assert "--size: got 'L2/E63/V9/H2': width E63 is not a multiple of 2 heads" in err
    err = refused(tmp_path, capsys, "--device", "cpu", "--tiny", "--size", "L2/E64/V9/P16", "--prompt-len", "8", "--response-len", "9")
    assert "--prompt-len + --response-len: got 8 + 9; allowed: at most the model's 16 positions" in err


def planned(*args: str):
    a = gpu_check.parse_args(list(args))
    assert gpu_check.argument_problems(a) == []
    return a


H200 = gpu_check.Hardware("cuda", "NVIDIA H200", True, 139 * 2**30, 140 * 2**30, "9.0", "580.159.04")
V100 = gpu_check.Hardware("cuda", "Tesla V100-SXM2-16GB", False, 15 * 2**30, 16 * 2**30, "7.0", "535.54")


def test_bf16_parts_are_refused_on_a_gpu_without_bf16():
    problems = gpu_check.hardware_problems(planned("--device", "cuda"), V100)
    assert ("--parts: bf16_autocast, zero2_bf16, speed run in bf16, but GPU 'Tesla V100-SXM2-16GB' (compute capability 7.0) "
            "has no bf16; allowed: a GPU of compute capability 8.0 or newer, or --parts correctness,zero2,zero3") in problems[0]
    assert gpu_check.hardware_problems(planned("--device", "cuda", "--parts", "correctness,zero2,zero3"), V100) == []


def test_the_paper_like_speed_size_fits_an_h200_by_estimate_and_not_a_16_gib_gpu():
    a = planned("--device", "cuda")
    assert gpu_check.hardware_problems(a, H200) == []
    small = gpu_check.Hardware("cuda", "NVIDIA A10G", True, 15 * 2**30, 16 * 2**30, "8.6", "535")
    problems = gpu_check.hardware_problems(a, small)
    assert len(problems) == 1 and problems[0].startswith("--size: got 'gpt2-medium' (L24/E1024/V50257, batch 64, 128 + 256 tokens)")
    assert "GPU 'NVIDIA A10G' has 15.0 GiB free" in problems[0]


def test_bf16_parts_are_skipped_on_a_cpu_without_bf16():
    a = planned("--device", "cpu", "--tiny")
    old_cpu = gpu_check.Hardware("cpu", "an AVX2-only CPU", False, 8 * 2**30, 16 * 2**30)
    assert gpu_check.hardware_problems(a, old_cpu) == []
    assert set(gpu_check.skips(a, old_cpu)) == {"bf16_autocast", "zero2_bf16"}
    assert not gpu_check.speed_bf16(a, old_cpu) and gpu_check.speed_bf16(a, H200)


def test_the_json_goes_under_OUT_when_it_is_set(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.parse_args(["--device", "cpu"]).out == str(tmp_path / "gpu_check.json")
    monkeypatch.delenv("OUT")
    assert gpu_check.parse_args(["--device", "cpu"]).out == str(REPO / "results" / "gpu_check.json")


# ------------------------------------------------------------------------------------------------
# the wheels that travel
# ------------------------------------------------------------------------------------------------
def test_wheel_list_is_exact_pinned_and_what_the_image_lacks():
    pins, lock = gpu_wheels.read_pins(gpu_wheels.WHEELS), gpu_wheels.lock_pins()
    image = gpu_wheels.read_pins(gpu_wheels.MACHINE)
    for key, (name, version, why) in pins.items():
        assert version, f"{name}: no version"
        assert version == (gpu_wheels.PINS.get(key) or lock.get(key)), f"{name}=={version}: not the lock's {lock.get(key)}"
        assert key not in image or why.startswith("upgrade:"), f"{name}: the image has it; carry it only as an upgrade"
        assert why, f"{name}: say why it travels"
    assert {gpu_wheels.canon(k) for k in gpu_wheels.ROOTS} <= set(pins)
    assert not {"mlflow", "optuna", "submitit", "reportlab"} & set(pins)  # the check imports none of them
    assert image["torch"][1] == "2.11.0" and image["transformers"][1] == "5.17.0"


def wheel(dest: Path, name: str, version: str, *requires: str) -> None:
    with zipfile.ZipFile(dest / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))


def test_the_closure_check_finds_unmet_and_missing_dependencies(tmp_path):
    (tmp_path / "whl").mkdir()
    (tmp_path / "list.txt").write_text("a==1.0  # root\nb==2.0  # needed by a\n")
    (tmp_path / "image.txt").write_text("torch==2.11.0\nnumpy\n")
    wheel(tmp_path / "whl", "a", "1.0", "b>=2", "numpy>=2", "torch>=2.12", "c; python_version < '3.0'", "d[x]")
    wheel(tmp_path / "whl", "b", "2.0", "e; extra == 'x'")
    found, assumed = gpu_wheels.problems(tmp_path / "whl", tmp_path / "list.txt", tmp_path / "image.txt")
    assert found == ["a needs torch>=2.12; the image has torch==2.11.0: add a wheel",
                     "a needs d[x]: neither in list.txt nor in the image (image.txt)"]
    assert assumed == {"numpy>=2"}  # the image's numpy version is not on record
    wheel(tmp_path / "whl", "b", "1.0")
    found, _ = gpu_wheels.problems(tmp_path / "whl", tmp_path / "list.txt", tmp_path / "image.txt")
    assert found == [f"b==2.0: 2 wheels in {tmp_path / 'whl'} (b-1.0-py3-none-any.whl, b-2.0-py3-none-any.whl); "
                     "want exactly this version (python -m bench.gpu_wheels fetch)"]


def test_the_device_command_is_documented_and_fits_the_tool():
    cmd = gpu_wheels.run_command()
    assert len(cmd) <= 2000 and "--device cuda" in cmd and "$OUT" in cmd
    results = (REPO / "bench" / "RESULTS.md").read_text()
    assert cmd in results and all(f"`{c}`" in results for c in gpu_wheels.CARRY)
