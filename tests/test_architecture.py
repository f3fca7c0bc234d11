"""The house's shape: no import cycles, and layers point one way (harness -> analysis -> reports).

Every import in a module counts, also the ones inside functions: a lazy import is still a
dependency. `harness.main` (the main job: world -> grid -> figures -> report) is the one module
allowed above both analysis and reports.
"""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness", "analysis", "reports")
MAIN_JOB = "harness.main"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that `name` is or lies in (a.b.c -> a.b when c is a symbol)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = pkg.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                r = _resolve(t, known)
                if r and r != mod and not mod.startswith(r + "."):  # a package's own __init__ is not a cycle
                    graph[mod].add(r)
    return graph


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_layers_point_one_way():
    graph = import_graph()
    rank = {"harness": 0, "analysis": 1, "reports": 2}
    bad = [
        f"{m} imports {n}"
        for m, deps in graph.items() if m != MAIN_JOB
        for n in deps if rank[n.split(".")[0]] > rank[m.split(".")[0]]
    ]
    assert not bad, "lower layer imports a higher one:\n" + "\n".join(bad)


def test_nothing_imports_the_main_job():
    """The main job is the top of the house: reports.rerun and everything else reach the world
    builds and grids through harness.ablate, never through harness.main."""
    graph = import_graph()
    assert not [m for m, deps in graph.items() if MAIN_JOB in deps]


def test_one_definition_of_the_known_metrics_and_the_stop_file():
    """Each rule and default has one home: the metrics a file may name (harness.keys.KNOWN_METRICS),
    the STOP file's name (harness.keys.STOP_FILE)."""
    import re

    for path in (ROOT / "harness").rglob("*.py"):
        text = path.read_text()
        if path.name != "keys.py":
            assert not re.search(r'STOP_FILE\s*=\s*"', text), f"{path} defines STOP_FILE again"
            assert "STEP_METRICS + " not in text, f"{path} builds a list of known metrics again"


RUNNERS = ("harness.ablate", "harness.sweep", "harness.trials", "harness.study", "harness.launch", MAIN_JOB)
"""What runs studies (locks, workers, training); analysis reads what they stored through the read-only
modules beside them (harness.sweepstore, harness.sweepfile, harness.registry, harness.tracking)."""


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in graph[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


def test_the_two_runners_are_siblings_that_never_import_each_other():
    graph = import_graph()
    assert "harness.sweep" not in _reaches(graph, "harness.ablate")
    assert "harness.ablate" not in _reaches(graph, "harness.sweep")


RERUN = "reports.rerun"
"""`make reference`: it reruns every figure file and sweep (through the runners), then builds the reports."""


def test_analysis_and_reports_never_import_a_runner():
    """Reading a study back needs no runner, Optuna's sampling or a worker pool: only what it stored."""
    graph = import_graph()
    readers = [m for m in graph if m.startswith(("analysis", "reports")) and m != RERUN]
    bad = [f"{m} reaches {sorted(_reaches(graph, m) & set(RUNNERS))}" for m in readers
           if _reaches(graph, m) & set(RUNNERS)]
    assert not bad, "a reader imports a runner:\n" + "\n".join(bad)


def test_no_module_of_the_harness_is_above_700_lines_and_the_sweep_runner_is_slim():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in (ROOT / "harness").rglob("*.py")}
    assert not {p: n for p, n in sizes.items() if n > 700}
    assert sizes["harness/sweep.py"] <= 450


def _imported_names(path: Path) -> set[str]:
    """Every module an import in this file names (the lazy ones inside functions too), as written."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add("." * node.level + node.module)
    return names


def test_no_test_module_imports_another_test_module():
    """What test modules share lives in tests/helpers.py (plain functions and constants) and tests/conftest.py
    (fixtures, which pytest hands out, never imported): importing a test module runs its collection-time
    code again, and a second copy of conftest under another name (tests.conftest) is a second module."""
    own = {p.stem for p in (ROOT / "tests").glob("*.py")}
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for name in sorted(_imported_names(path)):
            first = name.lstrip(".").split(".")[0]
            if first == "tests" or first == "conftest" or (first.startswith("test_") and first in own):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "a test module imports another test module (move what it needs to tests/helpers.py):\n" + \
        "\n".join(bad)


def test_the_tests_spell_a_sqlite_store_in_one_place():
    """A test's SQLite store or study database is tests/helpers.py's sqlite_uri, store_uri or study_storage; a URI
    written out in a test (sqlite:/// and a path) is only where a literal is the point (an expected message)."""
    spelled = re.compile(r"sqlite:///\{")
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "tests").glob("*.py")) if p.name != "helpers.py"
           for n, line in enumerate(p.read_text().splitlines(), 1) if spelled.search(line)]
    assert not bad, "build the URI with tests/helpers.py's sqlite_uri / store_uri / study_storage:\n" + "\n".join(bad)
