# The three commands of the README: `make run`, `make test` and `make demo`. Each installs what it needs first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Empty: gunicorn takes the `bind` setting (the config file, LORA_WORKER_BIND, else 127.0.0.1:8203);
# `make run BIND=host:port` overrides it.
BIND ?=
# `make demo PORT=8214`: the demo's server on 127.0.0.1:PORT instead of 8204.
PORT ?=
LOCK := deploy/requirements.lock

.PHONY: run test test-fast fuzz lint demo demo-slurm chaos bench gpu-bundle gpu-check install lock clean

# The trainer's sandbox is bubblewrap (`sandbox` setting, docs/sandbox.md). Without it, say so first.
NO_BWRAP_NOTICE = command -v bwrap >/dev/null || [ -n "$$LORA_WORKER_SANDBOX" ] || printf '%s %s\n%s\n' \
	"lora-worker: bubblewrap (bwrap) is not installed:" "$(1)" \
	"lora-worker: install it with: sudo apt-get install bubblewrap"

# What the service needs and nothing more, from the lock with its hashes (as the installer does); then the
# worker itself, editable, built with the locked setuptools.
$(VENV)/.runtime: setup.cfg pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes --no-deps -r $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# The runtime plus the test extras.
$(VENV)/.installed: $(VENV)/.runtime
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

# Dev server: SQLite under ./var, schema migrated, dead jobs reconciled, then gunicorn (1 worker) on loopback.
run: $(VENV)/.runtime
	$(BIN)/lora-worker config $(if $(BIND),--bind $(BIND))
	$(BIN)/lora-worker migrate
	$(BIN)/lora-worker reconcile
	@$(call NO_BWRAP_NOTICE,the trainer runs WITHOUT its sandbox here (sandbox = none).); \
	[ -n "$$LORA_WORKER_SANDBOX" ] || command -v bwrap >/dev/null || export LORA_WORKER_SANDBOX=none; \
	exec $(BIN)/gunicorn -c systemd/gunicorn.conf.py $(if $(BIND),--bind $(BIND)) 'lora_worker.wsgi:app'

# Re-lock every dependency, transitive ones included, with hashes, after a pin in setup.cfg changed.
lock: $(VENV)/.runtime
	$(BIN)/python -m pip install --quiet -e '.[lock]'
	$(BIN)/uv pip compile setup.cfg deploy/build-requirements.in --universal --python-version 3.11 \
		--generate-hashes -o $(LOCK)

# ruff and mypy first (seconds; pyproject.toml says which rules and why), then the suite on TEST_WORKERS processes
# (pytest-xdist). Most tests wait on real child processes, so more workers than cores pay. What starts a real
# Slurm cluster (tests/cluster, the Slurm benchmark's smoke test among them) runs beside it, in one process of its
# own, one test after another (never two clusters at once), its output printed when both are done: its tests
# mostly wait on the scheduler, so side by side the suite takes the longer of the two, not their sum.
CLUSTER_TESTS := tests/cluster
TEST_WORKERS ?= 4
lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy

# pytest keeps the test modules it rewrites (its assert rewriting) in __pycache__ only where bytecode may be written:
# where PYTHONDONTWRITEBYTECODE is set, as some shells and containers set it, every xdist worker rewrote every test
# module on every run (collecting took 7.7 s of CPU cold against 2.3 s warm; alternating `make test-fast` runs on the
# 2-core build machine, 2026-12-05: 41.9 and 44.4 s with it unset, 44.7 and 45.1 s set). Empty, it is unset.
test test-fast: export PYTHONDONTWRITEBYTECODE =

test: lint
	@$(call NO_BWRAP_NOTICE,the sandbox tests are skipped.)
	@log=$$(mktemp); \
	$(BIN)/python -m pytest -p no:cacheprovider $(CLUSTER_TESTS) >"$$log" 2>&1 & cluster=$$!; \
	status=0; $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --ignore=$(CLUSTER_TESTS) || status=$$?; \
	wait $$cluster || status=$$?; \
	echo "--- $(CLUSTER_TESTS), run beside the rest in one process:"; cat "$$log"; rm -f "$$log"; exit $$status

# The edit-test loop, under a minute: no real process and no cluster (the tests not marked `slow`; one that starts
# a process unmarked fails), no lint.
test-fast: $(VENV)/.installed
	LW_TEST_FAST=1 $(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadgroup -q

# The property tests of the parsers of outside bytes (marked `fuzz`: the safetensors header, the trainer's states,
# sd-scripts' output, the dataset's names and captions, the Slurm node's files, Retry-After, a receiver's answer)
# at length: each draws the `fuzz` Hypothesis profile's budget (tests/helpers/fuzz.py FUZZ_EXAMPLES) instead of the few
# that `make test` draws, with no per-test timeout. Hypothesis keeps what it found in .hypothesis/ and tries it
# first next time.
fuzz: $(VENV)/.installed
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -m fuzz -n $(TEST_WORKERS) -p no:cacheprovider --timeout=0 -q

# No GPU, no sd-scripts: a simulated host under ./var/demo (the test suite's fake trainer, a 24 GB card running
# TTS and a 48 GB card), the real service on 127.0.0.1:8204, one `fast` job trained live to a verified LoRA,
# then the curl commands for each step. The server stays up until Ctrl-C (or the terminal closes, or make is
# killed: nothing it started outlives it). Its own, smaller install: the
# `demo` extra (tqdm, which the simulated trainer draws its progress bars with).
$(VENV)/.demo-installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $@

demo: $(VENV)/.demo-installed
	exec $(BIN)/lora-worker demo $(if $(PORT),--bind 127.0.0.1:$(PORT))

# The same demo with backend = slurm, each job an sbatch to a single-node Slurm of its own (tests/cluster/cluster.py:
# munge, MariaDB + slurmdbd, slurmctld, slurmd, two fake GPUs), stopped at the end. Needs root and the Debian
# packages slurmctld slurmd slurm-client slurmdbd munge mariadb-server. Against a cluster of your own instead:
# LORA_WORKER_BACKEND=slurm SLURM_CONF=... make demo (docs/slurm.md).
demo-slurm: $(VENV)/.demo-installed
	$(BIN)/python -m tests.cluster.cluster $(BIN)/lora-worker demo

# The fault suite at length: hundreds of random kills, a longer contention window, more lifecycle sequences.
# `make test` runs the same loops shorter (100 iterations each). A new seed each run; a failure names the
# CHAOS_SEED and CHAOS_ITERATIONS that replay it (docs/testing.md, "Which runs where").
chaos: $(VENV)/.installed
	CHAOS_ITERATIONS=200 CHAOS_SECONDS=30 CHAOS_MODEL_EXAMPLES=60 $(BIN)/python -m pytest tests/chaos

# The benchmarks (bench/, docs/benchmarks.md): tables of ratios against baselines measured in the same run.
# They report and never fail on a number, and are not part of `make test`, which only runs each one at tiny
# sizes (tests/test_bench_smoke.py) to check it still works.
# Every row also goes to var/bench.json as data (value, baseline, ratio, target, met): `python -m bench --json`.
# bench/status.py's throughput rows need wrk (apt-get install -y wrk); without it they are skipped, and said so.
# About 9 minutes on the 2-core build machine (2026-12-05, docs/benchmarks.md).
bench: $(VENV)/.installed
	mkdir -p var
	$(BIN)/python -m bench --json var/bench.json

# The GPU check (issue #35, bench/gpu_check, docs/benchmarks.md "The first real GPU"). `make gpu-bundle` fetches here,
# from PyPI and Debian, what a borrowed GPU machine (no network) lacks for the real trainer, into .gpu-bundle/ in two
# parts that each fit one device call; SD_SCRIPTS_DIR is a checkout of sd-scripts at the pinned commit (the CPU rig's).
# `make gpu-check` is what runs on the GPU machine, after part a was installed there (device.sh install-a).
SD_SCRIPTS_DIR ?= ../rig/sd-scripts
gpu-bundle: $(VENV)/.runtime
	$(BIN)/python -m bench.gpu_check.bundle --sd-scripts $(SD_SCRIPTS_DIR)

gpu-check:
	bash bench/gpu_check/device.sh run

clean:
	rm -rf $(VENV) var .pytest_cache .hypothesis
