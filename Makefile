# Two commands do all set-up on a fresh machine (see README):
#   make run    unpack the embedded world if missing, run the Fig. 6 grid, draw it, build its report
#   make test   ruff, then the test suite (a worker per core and one more)
# Both create or reuse .venv from requirements.lock, whose torch is the CPU build (2.13.0+cpu), so
# the install never pulls a CUDA build.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0
UV      := uv==0.13.9
# uv does not read pip's settings: a machine's local wheel folders (PIP_FIND_LINKS, where this kind
# of machine keeps the CPU torch wheel) are passed on to it.
FIND_LINKS := $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))
ABLATION ?= ablations/score_reparam.yaml
WORKERS ?= 2
# The suite's workers: one more than the cores, as its tests wait on other processes and servers about a
# quarter of the time (2 cores: 9 min 56 s with 2 workers, 8 min 56 s with 3; bench/RESULTS.md, session 16).
TEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 2) + 1 )))

.PHONY: venv run test bench reference lock clean-runs help

help:
	@echo "make run    - main job on the embedded world (world -> $(ABLATION) -> figures -> report PDF)"
	@echo "make test   - the test suite"
	@echo "make bench  - speed benchmarks (installs the optional bench group)"
	@echo "make reference - rerun every figure file and sweep into reference-runs/ and rebuild reports/ (~10 h)"
	@echo "make lock   - re-resolve dependencies into requirements.lock"

# Installs the exact versions in requirements.lock (the world build and the runs depend on them),
# then the project itself without touching them. uv (pip-installed into the venv) does it: on a
# fresh 2-core machine 60 s against pip's 145 s with empty caches (python -m bench.install): parallel
# downloads, bytecode compiled on both cores (measured 2026-12-01, bench/RESULTS.md).
$(STAMP): pyproject.toml requirements.lock
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q $(UV)
	$(VENV)/bin/uv pip install -q --python $(VPY) $(FIND_LINKS) --compile-bytecode -r requirements.lock
	$(VENV)/bin/uv pip install -q --python $(VPY) --no-deps -e .
	touch $(STAMP)

# Re-resolve the dependencies from pyproject.toml in a scratch venv and write the lock.
lock:
	rm -rf .venv-lock && $(PY) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q $(TORCH)
	.venv-lock/bin/python -m pip install -q -e '.[test,postgres]'
	(echo "# Exact versions of every dependency (make installs these; regenerate with: make lock)"; \
	 .venv-lock/bin/python -m pip freeze --exclude-editable) > requirements.lock
	rm -rf .venv-lock

venv: $(STAMP)

run: $(STAMP)
	$(VPY) -m harness.main --ablation $(ABLATION) --workers $(WORKERS)

# The linter first (seconds), then the whole suite on cores + 1 workers (pytest-xdist): a test file stays on one
# worker (--dist loadfile), so a module's shared fixtures (a trained reference grid) are made once; modules go out
# in tests/conftest.py's order, longest first (--no-loadscope-reorder: xdist's own order is by test count).
# Targeted runs: .venv/bin/python -m pytest -q tests/test_study.py -k sigterm (docs/CONTRIBUTING.md).
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The committed reference results from scratch (python -m reports.rerun --help); resumable.
reference: $(STAMP)
	$(VPY) -m reports.rerun --workers $(WORKERS)

# TRL 1.12 (the last TRL with a PPO trainer) lives in its own venv so it never changes the main one.
BENCH_VENV := .venv-bench
$(BENCH_VENV)/.installed:
	test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q $(UV)
	$(BENCH_VENV)/bin/uv pip install -q --python $(BENCH_VENV)/bin/python $(FIND_LINKS) --compile-bytecode \
		'$(TORCH)+cpu' 'trl==1.12.0' 'transformers>=5.0' pyyaml
	touch $@

bench: $(STAMP) $(BENCH_VENV)/.installed
	$(VPY) -m bench.run_all --grid
