"""The wheels that travel with `bench.gpu_check` to the GPU machine, which has no network (issue 29).

    python -m bench.gpu_wheels fetch     # bench/gpu_wheels.txt into .whl/ (a pure sdist is built here), then check
    python -m bench.gpu_wheels check     # .whl/ holds exactly the list, every dependency is met, all that travels fits
    python -m bench.gpu_wheels command   # the one command line for the device tool's `run` (and its carry list)
    python -m bench.gpu_wheels resolve   # rewrite bench/gpu_wheels.txt from ROOTS and requirements.lock (needs the index)

The list (bench/gpu_wheels.txt, name==version a line) holds every package the check imports that the
machine's image (bench/gpu_machine.txt) lacks, and their dependencies, at the versions
requirements.lock pins (what the test suite runs here), as CPython 3.12 manylinux x86-64 wheels. Run
`fetch` in the checkout the device tool sends (the session's own): `.whl/` is git-ignored, and the
wheels, the tree and the carried world must fit the tool's 64 MiB together.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "bench" / "gpu_wheels.txt"
MACHINE = REPO / "bench" / "gpu_machine.txt"
DEST = REPO / ".whl"
LIMIT = 64 * 2**20
"""What may travel with one call of the device tool: tracked and untracked-not-ignored files plus carried paths."""
CARRY = (".whl", ".harness/world")
"""The ignored paths the check needs there: the wheels and the default embedded world (built here: ~2 min
of the machine's 15 would go to building it there)."""
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *(a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                          "manylinux2014_x86_64", "manylinux1_x86_64") for a in ("--platform", p))]
"""pip download's target: the machine's CPython 3.12 on x86-64 (glibc manylinux wheels)."""
TARGET = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}
"""Environment markers of the machine's Python, for the wheels' Requires-Dist."""
ROOTS = {
    "mlflow-skinny": "harness.tracking: MLflow's client and sqlite store; the full `mlflow` wheel adds only its UI "
                     "server (12 MB more), which no run imports",
    "sqlalchemy": "MLflow's sqlite store (mlflow-skinny does not require it)",
    "alembic": "MLflow's sqlite store migrations (mlflow-skinny does not require it)",
    "deepspeed": "ZeRO-2/3 (PyPI has only its sdist: `fetch` builds the pure wheel here, ops compiled at run time)",
    "pydantic": "harness.schema: every config",
    "trl": "TRL 1.12's PPOTrainer, the speed baseline (bench.trl_step)",
}
"""What the check imports that the image lacks (bench/gpu_check.py records what a run imported; the test
checks it against these files). Not needed: optuna, submitit, reportlab, pypdf (sweeps, Slurm, reports)."""
PINS = {"trl": "1.12.0", "datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19"}
"""Versions requirements.lock does not pin: trl (pyproject's bench extra) and what it needs, as `make
bench`'s TRL venv resolved them on 2026-12-01 (bench.trl_step ran with them here)."""
UPGRADES = {"typing-extensions": "pydantic 2.14.4 needs >= 4.16.0; the image's version is unknown"}
"""Packages the image has, carried anyway at the lock's version (--target puts them first on the path)."""


def canon(name: str) -> str:
    return canonicalize_name(name)


def read_pins(path: Path) -> dict[str, tuple[str, str, str]]:
    """{canonical name: (name, version or '', comment)} of a `name[==version]  # comment` file
    (`!name` lines, packages known to be absent, are not entries: `absent`)."""
    out = {}
    for line in path.read_text().splitlines():
        body, _, comment = line.partition("#")
        body = body.strip()
        if not body or body.startswith("!"):
            continue
        name, _, version = body.partition("==")
        key = canon(name.strip())
        if key in out:
            raise SystemExit(f"error: {path.name}: {name.strip()} is listed twice; keep one version of each")
        out[key] = (name.strip(), version.strip(), comment.strip())
    return out


def absent(path: Path = MACHINE) -> set[str]:
    """The `!name` lines of the image's list: packages seen missing there."""
    return {canon(line.strip()[1:].split("#")[0]) for line in path.read_text().splitlines() if line.strip().startswith("!")}


def lock_pins() -> dict[str, str]:
    return {k: v for k, (_, v, _) in read_pins(REPO / "requirements.lock").items() if v}


def metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return z.read(name).decode()


def requirements(wheel: Path, extras: set[str]) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the machine's Python, with `extras` asked for."""
    out = []
    for line in metadata(wheel).splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or any(r.marker.evaluate({**TARGET, "extra": e}) for e in ("", *extras)):
                out.append(r)
    return out


def wheels_in(dest: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for f in sorted(dest.glob("*.whl")):
        out.setdefault(canon(parse_wheel_filename(f.name)[0]), []).append(f)
    return out


def download(name: str, version: str, dest: Path) -> Path:
    """The cp312 manylinux wheel of name==version in dest: downloaded, or built from a pure-Python sdist."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        spec = f"{name}=={version}"
        p = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", d, spec],
                           capture_output=True, text=True)
        if p.returncode:  # no wheel for the machine: build one from the sdist here (only a pure one can travel)
            # DS_BUILD_OPS=0: DeepSpeed compiles no op at build time (it compiles what a run needs, there)
            p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", d, spec],
                               capture_output=True, text=True, env={**os.environ, "DS_BUILD_OPS": "0"})
        got = list(Path(d).glob("*.whl"))
        if p.returncode or len(got) != 1:
            raise SystemExit(f"error: {spec}: no wheel for CPython 3.12 manylinux x86-64 and none built:\n{p.stderr[-2000:]}")
        tags = parse_wheel_filename(got[0].name)[3]
        if not any(t.platform == "any" or "manylinux" in t.platform for t in tags):
            raise SystemExit(f"error: {spec}: built {got[0].name}, which only runs here; build it on the machine's platform")
        target = dest / got[0].name
        got[0].replace(target)
        return target


def fetch(dest: Path) -> int:
    have = wheels_in(dest)
    for key, (name, version, _) in read_pins(WHEELS).items():
        if not any(parse_wheel_filename(f.name)[1].public == version for f in have.get(key, [])):
            print(f"[gpu_wheels] {name}=={version}", flush=True)
            download(name, version, dest)
    return check(dest)


def tree_bytes() -> int:
    """Bytes of what the device tool sends of this checkout: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout.decode()
    return sum(f.stat().st_size for f in (REPO / x for x in out.split("\0") if x) if f.is_file() and not f.is_symlink())


def path_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else (p.stat().st_size if p.exists() else 0)


def problems(dest: Path, wheels: Path = WHEELS, machine_file: Path = MACHINE) -> tuple[list[str], set[str]]:
    """(problems, requirements assumed met by the image): dest must hold exactly one wheel of each
    listed version and nothing else, and every applicable Requires-Dist of those wheels (with the
    extras asked for) must be met by a listed wheel or by the image, at its known version where one
    is on record."""
    pins, machine, have = read_pins(wheels), read_pins(machine_file), wheels_in(dest)
    out, assumed = [], set()
    for key, (name, version, _) in pins.items():
        files = have.get(key, [])
        if len(files) != 1 or parse_wheel_filename(files[0].name)[1].public != version:
            out.append(f"{name}=={version}: {len(files)} wheels in {dest} ({', '.join(f.name for f in files) or 'none'}); "
                       "want exactly this version (python -m bench.gpu_wheels fetch)")
    for key in sorted(set(have) - set(pins)):
        out.append(f"{', '.join(f.name for f in have[key])}: not in {wheels.name}; remove it (pip stops at two versions)")
    if out:
        return out, assumed
    extras: dict[str, set[str]] = {k: set() for k in pins}
    todo = list(pins)
    while todo:
        key = todo.pop()
        for r in requirements(have[key][0], extras[key]):
            dep = canon(r.name)
            if dep in pins:
                if not r.specifier.contains(pins[dep][1], prereleases=True):
                    out.append(f"{pins[key][0]} needs {r}; the list has {pins[dep][0]}=={pins[dep][1]}")
                if not r.extras <= extras[dep]:
                    extras[dep] |= r.extras
                    todo.append(dep)
            elif dep in machine:
                known = machine[dep][1]
                if known and not r.specifier.contains(known, prereleases=True):
                    out.append(f"{pins[key][0]} needs {r}; the image has {machine[dep][0]}=={known}: add a wheel")
                elif not known and str(r.specifier):
                    assumed.add(f"{r.name}{r.specifier}")
            else:
                out.append(f"{pins[key][0]} needs {r}: neither in {wheels.name} nor in the image ({machine_file.name})")
    return out, assumed


def check(dest: Path) -> int:
    """0 when `problems` finds none and the wheels, the tree and the carried world fit LIMIT; else 1."""
    found, assumed = problems(dest)
    wheels = sum(f.stat().st_size for f in dest.glob("*.whl"))
    world = path_bytes(REPO / CARRY[1])
    tree = tree_bytes()
    total = wheels + tree + world
    print(f"[gpu_wheels] {len(read_pins(WHEELS))} wheels {wheels / 2**20:.1f} MiB + tree {tree / 2**20:.1f} MiB + {CARRY[1]} "
          f"{world / 2**20:.1f} MiB = {total / 2**20:.1f} MiB of the {LIMIT / 2**20:.0f} MiB that may travel")
    if not world:
        found.append(f"{CARRY[1]}: no world to carry; build it: python -m harness.world build --out {CARRY[1]}")
    if total > LIMIT:
        found.append(f"{total / 2**20:.1f} MiB would travel; the device tool takes at most {LIMIT / 2**20:.0f} MiB")
    if assumed:
        print("[gpu_wheels] assumed met by the image (its versions are not on record): " + ", ".join(sorted(assumed)))
    for p in found:
        print(f"error: {p}", file=sys.stderr)
    return 1 if found else 0


def resolve(dest: Path) -> int:
    """Rewrite WHEELS: ROOTS and their dependencies that the image lacks (plus UPGRADES), each at the
    lock's version (or PINS), downloaded into dest to read their requirements."""
    lock, machine = lock_pins(), read_pins(MACHINE)
    needed_by: dict[str, set[str]] = {}
    chosen: dict[str, tuple[str, str]] = {}
    extras: dict[str, set[str]] = {}
    todo = [(k, set()) for k in (*ROOTS, *UPGRADES)]
    while todo:
        name, want = todo.pop(0)
        key = canon(name)
        if key in chosen and want <= extras[key]:
            continue
        extras[key] = extras.get(key, set()) | want
        version = PINS.get(key) or lock.get(key)
        if version is None:
            raise SystemExit(f"error: {name} (needed by {', '.join(sorted(needed_by.get(key, ())))}): not pinned in "
                             f"requirements.lock; add it to PINS in {__file__}")
        chosen[key] = (name, version)
        wheel = next((f for f in wheels_in(dest).get(key, []) if parse_wheel_filename(f.name)[1].public == version), None)
        for r in requirements(wheel or download(name, version, dest), extras[key]):
            dep = canon(r.name)
            if dep not in machine or dep in UPGRADES:
                needed_by.setdefault(dep, set()).add(name)
                todo.append((r.name, set(r.extras)))

    def why(key: str) -> str:
        if key in ROOTS:
            return ROOTS[key]
        if key in UPGRADES:
            return f"upgrade: {UPGRADES[key]}"
        return "needed by " + ", ".join(sorted(needed_by[key]))

    head = [line for line in WHEELS.read_text().splitlines() if line.startswith("#")] if WHEELS.exists() else []
    body = [f"{n}=={v}  # {why(k)}" for k, (n, v) in sorted(chosen.items())]
    WHEELS.write_text("\n".join(head + body) + "\n")
    print(f"[gpu_wheels] {len(body)} wheels written to {WHEELS}")
    return check(dest)


def run_command() -> str:
    """The one command the device tool's `run` gets (with carry CARRY and timeout_s 600): install the
    carried wheels into /tmp/site, then the check, its log and JSON under $OUT."""
    return ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
            ".whl/*.whl && export PYTHONPATH=/tmp/site || exit; export PYTHONUNBUFFERED=1; set -o pipefail; "
            "python3 -m bench.gpu_check --device cuda --world .harness/world 2>&1 | tee $OUT/gpu_check.log")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_wheels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("fetch", "check", "command", "resolve"))
    ap.add_argument("--dest", default=str(DEST), help=f"wheel folder (default {DEST.relative_to(REPO)}/, git-ignored)")
    a = ap.parse_args(argv)
    if a.action == "command":
        print(f"command ({len(run_command())} characters):\n{run_command()}\ncarry: {list(CARRY)}\ntimeout_s: 600")
        return 0
    if a.action == "resolve":
        return resolve(Path(a.dest))
    return fetch(Path(a.dest)) if a.action == "fetch" else check(Path(a.dest))


if __name__ == "__main__":
    sys.exit(main())
