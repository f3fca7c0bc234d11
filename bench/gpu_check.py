"""The GPU path in one prepared check (issue 29): a CUDA run against the same run on CPU, bf16
autocast and DeepSpeed ZeRO-2 / ZeRO-3 at one rank (NCCL on a GPU) that train, checkpoint and
resume, and the speed of a PPO step at GPT-2-medium size against TRL 1.12 on the same device.

    python -m bench.gpu_check --device cuda            # on a GPU machine (the device tool's command:
                                                       #   python -m bench.gpu_wheels command)
    python -m bench.gpu_check --device cpu --tiny      # the same code at tiny sizes (tests/test_gpu_check.py)

Parts (--parts; in this order, each one's result written to the JSON as it ends):
  correctness    ablations/bases/vanilla.yaml on the embedded world, --steps steps (20), fp32, on the
                 device and on CPU: step 1's sampled responses (the SFT policy's, before any update)
                 identical, and every metric within rel 1e-3 / abs 1e-4 at step 0 (the eval before
                 training) and at every step whose responses are still identical (a token can flip
                 where a probability sits at a sampling boundary, after which the runs part ways)
  bf16_autocast  the same config with model.autocast=bf16: stopped at --stop-at by the step callback,
                 resumed from its checkpoint into the same MLflow run, every step logged once and finite
  zero2, zero3   the same through DeepSpeed ZeRO-2 / ZeRO-3 at one rank (NCCL on CUDA, gloo on CPU), fp32:
                 stopped and resumed as above, and equal to the plain device run (as correctness)
  zero2_bf16     ZeRO-2 with DeepSpeed's bf16 (the paper's 7B setting): stopped and resumed
  speed          GPT-2 medium (24 x 1024, vocab 50257, ~355M weights per model: policy, reference, reward
                 model, critic), batch 64, 128 prompt + 256 response tokens, 4 epochs, bf16 autocast:
                 s/step by phase, tokens/s, MFU against the bf16 matmul peak measured in the same run,
                 peak GPU memory; TRL 1.12's PPOTrainer on the same models when trl imports, and the ratio

On a CPU (--device cpu) the bf16 parts are skipped with the reason where the CPU has no native bf16.
Bad input fails before any model is built (exit 2): --device cuda without CUDA, bf16 parts on a GPU
without bf16, a speed size that does not fit the device's memory by estimate. Exit 1 when a part
failed; 0 when every part passed or was skipped. The JSON goes to --out (default $OUT/gpu_check.json
where $OUT is set, else results/gpu_check.json).
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

REPO = Path(__file__).resolve().parents[1]
PARTS = ("correctness", "bf16_autocast", "zero2", "zero3", "zero2_bf16", "speed")
BF16_PARTS = ("bf16_autocast", "zero2_bf16")
"""Parts that are bf16 by definition (skipped on a CPU without bf16, refused on such a GPU); the speed
part runs in bf16 where the device has it (required on a GPU, fp32 on a CPU without it)."""
FIT = 0.9
"""The speed part may plan to use at most this share of the device's free memory."""
FULL = {"steps": 20, "size": "gpt2-medium", "batch": 64, "prompt_len": 128, "response_len": 256, "speed_steps": 3,
        "budget_s": 480.0, "world": ".harness/world"}
TINY = {"steps": 4, "size": "tiny", "batch": 4, "prompt_len": 8, "response_len": 8, "speed_steps": 1,
        "budget_s": 0.0, "world": ".harness/gpu_check_tiny_world"}
"""Defaults without and with --tiny (budget 0 = none)."""


class BadInput(Exception):
    """Arguments or hardware the check cannot run with; the problems, each naming what is allowed."""


@dataclass(frozen=True)
class Hardware:
    """The device the check runs on, read before anything is built."""

    kind: str
    """"cpu" or "cuda"."""
    name: str
    """CPU model or GPU name (torch.cuda.get_device_name)."""
    bf16: bool
    """Native bf16 arithmetic: a CPU's avx512_bf16 / amx_bf16, a GPU of compute capability 8.0 or newer
    (not torch's emulation on older GPUs)."""
    free_bytes: int
    """Memory the speed part may plan on: the GPU's free memory, or the machine's available RAM."""
    total_bytes: int
    capability: str = ""
    """CUDA compute capability, e.g. "9.0"."""
    driver: str = ""
    """NVIDIA driver version (nvidia-smi)."""


def probe(device: str) -> Hardware:
    """The device's name, bf16 support and free memory; BadInput for cuda without a visible GPU."""
    import torch

    if device == "cpu":
        import psutil

        from harness.parallel import cpu_supports_bf16
        from harness.provenance import cpu

        vm = psutil.virtual_memory()
        return Hardware("cpu", cpu()["model"], cpu_supports_bf16(), vm.available, vm.total)
    if not torch.cuda.is_available():
        raise BadInput([f"--device: got 'cuda' but no CUDA device is visible (torch {torch.__version__}, built for CUDA "
                        f"{torch.version.cuda or 'none'}); allowed here: cpu (--device cpu --tiny runs the same check at tiny sizes)"])
    free, total = torch.cuda.mem_get_info(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = ""
    return Hardware("cuda", torch.cuda.get_device_name(0), torch.cuda.is_bf16_supported(including_emulation=False), free, total,
                    ".".join(map(str, torch.cuda.get_device_capability(0))), driver or "unknown")


def parse_size(text: str):
    """A preset (gpt2-medium, tiny) or L<layers>/E<width>/V<vocab>[/H<heads>][/P<positions>]."""
    from bench.common import Size

    presets = {"gpt2-medium": Size("gpt2-medium", 24, 1024, 50257, 16, 1024), "tiny": Size("tiny", 2, 64, 256, 2, 64)}
    if text in presets:
        return presets[text]
    fields = {}
    for part in text.split("/"):
        if len(part) < 2 or part[0] not in "LEVHP" or not part[1:].isdigit() or part[0] in fields or int(part[1:]) < 1:
            raise BadInput([f"--size: got {text!r}; allowed: {', '.join(presets)}, or L<layers>/E<width>/V<vocab>"
                            "[/H<heads>][/P<positions>] with positive integers, e.g. L24/E1024/V50257/H16/P1024"])
        fields[part[0]] = int(part[1:])
    if not {"L", "E", "V"} <= set(fields):
        raise BadInput([f"--size: got {text!r}; allowed: L, E and V all given, e.g. L24/E1024/V50257"])
    heads = fields.get("H", max(1, fields["E"] // 64))
    if fields["E"] % heads:
        raise BadInput([f"--size: got {text!r}: width E{fields['E']} is not a multiple of {heads} heads; allowed: H dividing E"])
    return Size(text.replace("/", "_"), fields["L"], fields["E"], fields["V"], heads, fields.get("P", 1024))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the check runs (default cuda)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny sizes (a TINY world, 4 steps, a 2 x 64 speed model, batch 4, 8 + 8 tokens): what the test suite runs")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)} (default all)")
    ap.add_argument("--world", help=f"built embedded world (default {FULL['world']}; with --tiny a TINY world, built "
                                    f"when missing, in {TINY['world']})")
    ap.add_argument("--build-world", action="store_true", help="build the default world into --world when it is missing (~2 min on one core)")
    ap.add_argument("--steps", type=int, help=f"PPO steps of each world run (default {FULL['steps']}; --tiny {TINY['steps']})")
    ap.add_argument("--stop-at", type=int, help="step at which the checkpoint/resume runs stop before resuming (default steps / 2)")
    ap.add_argument("--size", help=f"speed model: gpt2-medium, tiny or L<n>/E<n>/V<n>[/H<n>][/P<n>] (default {FULL['size']}; --tiny tiny)")
    ap.add_argument("--batch", type=int, help=f"speed: prompts per step (default {FULL['batch']}; --tiny {TINY['batch']})")
    ap.add_argument("--prompt-len", type=int, help=f"speed: prompt tokens (default {FULL['prompt_len']}; --tiny {TINY['prompt_len']})")
    ap.add_argument("--response-len", type=int, help=f"speed: sampled tokens, no early stop (default {FULL['response_len']}; --tiny {TINY['response_len']})")
    ap.add_argument("--speed-steps", type=int, help=f"speed: timed steps after the warm-up (default {FULL['speed_steps']}; --tiny {TINY['speed_steps']})")
    ap.add_argument("--warmup", type=int, default=1, help="speed: untimed first steps (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of every run (default 1)")
    ap.add_argument("--trl-python", default=os.environ.get("BENCH_TRL_PYTHON", sys.executable),
                    help="Python that runs bench.trl_step (default $BENCH_TRL_PYTHON, else this one)")
    ap.add_argument("--budget-s", type=float, help=f"parts not started within this many seconds are skipped "
                                                   f"(default {FULL['budget_s']:.0f}; --tiny none)")
    ap.add_argument("--out", help="the JSON (default $OUT/gpu_check.json where $OUT is set, else results/gpu_check.json)")
    ap.add_argument("--workdir", help="MLflow store, run folders and speed models (default a temporary folder, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    a = ap.parse_args(argv)
    defaults = TINY if a.tiny else FULL
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.stop_at is None:
        a.stop_at = max(1, a.steps // 2)
    if a.out is None:
        a.out = str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else str(REPO / "results" / "gpu_check.json")
    return a


def argument_problems(a: argparse.Namespace) -> list[str]:
    """What is wrong with the arguments alone (no hardware read, nothing built)."""
    out = []
    parts = [p for p in a.parts.split(",") if p]
    wrong = [p for p in parts if p not in PARTS]
    if wrong or not parts:
        out.append(f"--parts: got {a.parts!r}; allowed: a comma-separated subset of {', '.join(PARTS)}")
    a.parts = [p for p in PARTS if p in parts]
    if a.steps < 2:
        out.append(f"--steps: got {a.steps}; allowed: 2 or more (a run stops at --stop-at and resumes)")
    elif not 1 <= a.stop_at < a.steps:
        out.append(f"--stop-at: got {a.stop_at}; allowed: 1 to {a.steps - 1} (before --steps {a.steps})")
    for name in ("batch", "prompt_len", "response_len", "speed_steps", "warmup", "threads"):
        low = 0 if name == "warmup" else 1
        if getattr(a, name) < low:
            out.append(f"--{name.replace('_', '-')}: got {getattr(a, name)}; allowed: {low} or more")
    if a.speed_steps + a.warmup < 2:
        out.append("--speed-steps: with --warmup 0 at least 2 steps (a step's time is the wall time between two step ends)")
    try:
        a.size_obj = parse_size(a.size)
        if "speed" in a.parts and a.prompt_len + a.response_len > a.size_obj.n_positions:
            out.append(f"--prompt-len + --response-len: got {a.prompt_len} + {a.response_len}; allowed: at most the "
                       f"model's {a.size_obj.n_positions} positions (--size .../P<positions>)")
    except BadInput as e:
        out += e.args[0]
    return out


def speed_bf16(a: argparse.Namespace, hw: Hardware) -> bool:
    return hw.kind == "cuda" or hw.bf16


def hardware_problems(a: argparse.Namespace, hw: Hardware) -> list[str]:
    """bf16 parts on a GPU without bf16, and a speed part that does not fit the device by estimate."""
    from bench.gpu_parts import memory_estimate

    out = []
    need = [p for p in a.parts if p in BF16_PARTS or p == "speed"]
    if hw.kind == "cuda" and need and not hw.bf16:
        rest = ",".join(p for p in a.parts if p not in need) or "correctness,zero2,zero3"
        out.append(f"--parts: {', '.join(need)} run in bf16, but GPU {hw.name!r} (compute capability {hw.capability}) "
                   f"has no bf16; allowed: a GPU of compute capability 8.0 or newer, or --parts {rest}")
    if "speed" in a.parts:
        est = memory_estimate(a.size_obj, a.batch, a.prompt_len, a.response_len, speed_bf16(a, hw))
        need_b, have = sum(est.values()), FIT * hw.free_bytes
        if need_b > have:
            parts = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in est.items())
            where = f"GPU {hw.name!r}" if hw.kind == "cuda" else "this machine's memory"
            out.append(f"--size: got {a.size!r} ({a.size_obj.tag}, batch {a.batch}, {a.prompt_len} + {a.response_len} tokens): "
                       f"the speed part needs about {need_b / 2**30:.1f} GiB by estimate ({parts} GiB), but {where} has "
                       f"{hw.free_bytes / 2**30:.1f} GiB free; allowed: at most {FIT:.0%} of it: a smaller --size, --batch, "
                       "--prompt-len or --response-len")
    return out


def skips(a: argparse.Namespace, hw: Hardware) -> dict[str, str]:
    """Parts this hardware cannot run that are skipped rather than refused (bf16 on a CPU without it)."""
    if hw.kind == "cpu" and not hw.bf16:
        return {p: "skipped: this CPU has no native bf16 (no avx512_bf16 / amx_bf16 flag)" for p in a.parts if p in BF16_PARTS}
    return {}


def config_problems(a: argparse.Namespace, ctx, hw: Hardware, skipped: dict) -> list[str]:
    """The harness's own checks of every run's config (parallel.validate: hardware, DeepSpeed; models.preflight:
    world, model paths, vocabularies), before any model is built."""
    from bench.gpu_parts import RUNS, run_config
    from harness import parallel
    from harness.models import preflight

    names = {"correctness": ["cpu_fp32", "device_fp32"], "bf16_autocast": ["bf16_autocast"], "zero2": ["zero2"],
             "zero3": ["zero3"], "zero2_bf16": ["zero2_bf16"]}
    out = []
    for part in a.parts:
        for name in names.get(part, []):
            if part in skipped:
                continue
            cfg = run_config(ctx, name)
            device = "cpu" if RUNS[name][0] == "cpu" else a.device
            out += [f"{name}: {p}" for p in parallel.validate(cfg, device_type=device, world_size=1) + preflight(cfg)]
    return out


def ensure_world(a: argparse.Namespace) -> list[str]:
    """The world the runs use, as it is where one is built (whatever its config: a built world is never
    rebuilt here); where none is, a TINY one with --tiny (seconds), the default one with --build-world
    (~2 min), else a problem naming the command."""
    from harness.world import TINY as TINY_WORLD
    from harness.world import build_world, load_world_config

    world = Path(a.world)
    if (world / "world.json").is_file():
        return []
    if not (a.tiny or a.build_world):
        return [f"--world: got {a.world!r}; it holds no built world; build it with `python -m harness.world build --out "
                f"{a.world}` (~2 min on one core), carry a built one, or pass --build-world"]
    wcfg = load_world_config(overrides=TINY_WORLD if a.tiny else None)
    build_world(wcfg, world, tracking_uri=f"sqlite:///{Path(a.workdir) / 'world.db'}", progress=False)
    return []


def imported_distributions() -> list[str]:
    """The installed distributions this process's modules come from (by the files their RECORDs
    list), one entry per module file: 'name' or 'a|b' where two distributions ship the same file
    (mlflow and mlflow-skinny). Modules of this checkout and the standard library are in none."""
    import importlib.metadata as md

    owners: dict[str, set[str]] = {}
    for d in md.distributions():
        name = d.metadata["Name"]
        for f in d.files or ():
            if f.suffix in (".py", ".so"):
                owners.setdefault(os.path.normpath(str(d.locate_file(f))), set()).add(name)
    seen = set()
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if f and (o := owners.get(os.path.normpath(f))):
            seen.add("|".join(sorted(o)))
    return sorted(seen)


def environment(hw: Hardware) -> dict:
    """Where the numbers come from: machine, GPU, driver, libraries, code."""
    import importlib.metadata as md

    import torch

    from bench.run_all import machine
    from harness import provenance

    versions = provenance.versions()
    for pkg in ("accelerate", "trl", "datasets", "mlflow-skinny", "sqlalchemy", "pyarrow", "fsspec", "typing-extensions"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "not installed"
    env = {"machine": machine(), "device": asdict(hw), "versions": versions, "commit": provenance.commit(),
           "torch_cuda": torch.version.cuda}
    if hw.kind == "cuda":
        env["gpu"] = {"name": hw.name, "capability": hw.capability, "memory_gib": hw.total_bytes / 2**30, "driver": hw.driver,
                      "cuda_runtime": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                      "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "float32_matmul_precision": torch.get_float32_matmul_precision()}
    return env


def write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def line(name: str, r: dict) -> str:
    """One part's result in a line."""
    from bench.gpu_parts import ATOL, RTOL

    head = f"[gpu_check] {name:14s} {r['status']:7s} {r.get('s', 0):6.1f} s"
    if r["status"] in ("skipped", "error") or "reason" in r:
        return f"{head}  {r.get('reason') or r.get('error', '')}"
    bits = []
    if "checks" in r:
        bits.append(f"{sum(r['checks'].values())}/{len(r['checks'])} checks (stopped, resumed from the checkpoint, "
                    f"one MLflow run, {r['s_per_step']:.3f} s/step)")
    for label, cmp in (("", r.get("comparison")), ("vs device fp32: ", r.get("vs_device_fp32"))):
        if isinstance(cmp, dict):
            top = next(iter(cmp["largest_rel_diff"].items()), None)
            bits.append(f"{label}responses identical through step {cmp['responses_identical_through_step']}/{cmp['steps']}, "
                        f"{cmp['n_outside']} of {cmp['values_compared']} values outside rel {RTOL:g} / abs {ATOL:g}"
                        + (f" (largest rel diff {top[1]['rel']:.1e}, {top[0]})" if top else "")
                        + (" (bf16: not required to agree)" if label and "bf16" in name else ""))
    if name == "speed":
        h = r["harness"]
        ph = ", ".join(f"{k} {v:.2f}" for k, v in h.get("phases_s", {}).items() if k != "trainer_step")
        bits.append(f"harness {h['step_s']:.3f} s/step ({ph}), {h['tokens_per_s']:.0f} tokens/s, MFU {h['mfu']:.1%} "
                    f"of {r['peak']['peak_gflops'] / 1e3:.1f} TFLOP/s measured"
                    + (f", peak {h['peak_gpu_gib']:.1f} GiB" if h.get("peak_gpu_gib") else ""))
        t = r["trl"]
        bits.append(f"TRL {t['step_s']:.3f} s/step: harness {r['trl_over_harness']:.2f}x" if "step_s" in t else f"TRL {t['reason']}")
    return f"{head}  " + "; ".join(bits)


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    a = parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench import gpu_parts as gp
    from harness import provenance

    temporary = a.workdir is None
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="gpu_check_")
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    try:
        problems = argument_problems(a)
        if problems:
            raise BadInput(problems)
        hw = probe(a.device)
        problems = hardware_problems(a, hw)
        if problems:
            raise BadInput(problems)
        skipped = skips(a, hw)
        if a.device == "cpu":  # before DeepSpeed is first imported (it would pick a GPU where one is visible)
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        problems = ensure_world(a)
        ctx = gp.Context(a.device, str(Path(a.world).resolve()), Path(a.workdir).resolve(), a.steps, a.stop_at, a.threads, a.tiny)
        problems = problems or config_problems(a, ctx, hw, skipped)
        if problems:
            raise BadInput(problems)
    except BadInput as e:
        print("error: the GPU check cannot run as asked:\n" + "\n".join(f"  - {p}" for p in e.args[0]),
              file=sys.stderr)
        return 2

    out_path = Path(a.out)
    res: dict = {"command": "python -m bench.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv),
                 "date": dt.datetime.now().isoformat(timespec="seconds"), "tiny": a.tiny, **environment(hw),
                 "world": {"dir": ctx.world, **provenance.world(ctx.world)},
                 "steps": a.steps, "stop_at": a.stop_at, "budget_s": a.budget_s, "parts": {}}
    print(f"[gpu_check] {hw.kind} {hw.name!r}{f' driver {hw.driver}' if hw.driver else ''}; parts {', '.join(a.parts)}; "
          f"work folder {a.workdir}; results -> {out_path}", flush=True)

    def time_left() -> float:
        """Seconds left of --budget-s (at most an hour: a subprocess's timeout)."""
        return 3600.0 if not a.budget_s else min(3600.0, a.budget_s - (time.perf_counter() - t_start))

    workload = gp.Workload(a.size_obj, a.batch, a.prompt_len, a.response_len, speed_bf16(a, hw), a.speed_steps, a.warmup, a.threads)
    run = {"correctness": lambda: gp.correctness(ctx),
           "speed": lambda: gp.speed(a.device, workload, Path(a.workdir) / "models", a.trl_python, hw.name, time_left),
           **{p: (lambda p=p: gp.train_and_resume(ctx, p)) for p in ("bf16_autocast", "zero2", "zero3", "zero2_bf16")}}
    for part in a.parts:
        t0 = time.perf_counter()
        if part in skipped:
            r = {"status": "skipped", "reason": skipped[part]}
        elif time_left() <= 0:
            r = {"status": "skipped", "reason": f"time budget of {a.budget_s:.0f} s spent (--budget-s)"}
        else:
            try:
                r = run[part]()
            except Exception as e:  # noqa: BLE001 - one part's failure must not lose the others' results
                r = {"status": "error", "error": f"{type(e).__name__}: {e}"[:4000], "traceback": traceback.format_exc()[-6000:]}
            gc.collect()
            if a.device == "cuda":
                import torch

                torch.cuda.empty_cache()  # the next part (a fresh speed process) gets the memory back
        r["s"] = time.perf_counter() - t0
        res["parts"][part] = r
        write(out_path, res)
        print(line(part, r), flush=True)

    from harness import parallel

    parallel.teardown()
    res["imported_distributions"] = imported_distributions()
    res["passed"] = all(r["status"] in ("passed", "skipped") for r in res["parts"].values())
    res["total_s"] = time.perf_counter() - t_start
    write(out_path, res)
    summary = {p: r["status"] for p, r in res["parts"].items()}
    print(f"[gpu_check] {'passed' if res['passed'] else 'FAILED'} in {res['total_s']:.0f} s: {json.dumps(summary)}; results in {out_path}")
    if temporary and not a.keep:
        import shutil

        shutil.rmtree(a.workdir, ignore_errors=True)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
