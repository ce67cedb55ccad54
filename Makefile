# The three commands of the README: `make run`, `make test` and `make demo`. Each installs what it needs first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BIND ?= 127.0.0.1:8203

.PHONY: run test demo chaos bench install clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

# Dev server: SQLite under ./var, schema migrated, dead jobs reconciled, then gunicorn (1 worker) on loopback.
run: $(VENV)/.installed
	$(BIN)/lora-worker config --bind $(BIND)
	$(BIN)/lora-worker migrate
	$(BIN)/lora-worker reconcile
	exec $(BIN)/gunicorn -c systemd/gunicorn.conf.py --bind $(BIND) 'lora_worker.wsgi:app'

test: $(VENV)/.installed
	$(BIN)/python -m pytest

# No GPU, no sd-scripts: a simulated host under ./var/demo (the test suite's fake trainer, a 24 GB card running
# TTS and a 48 GB card), the real service on 127.0.0.1:8204, one `fast` job trained live to a verified LoRA,
# then the curl commands for each step. The server stays up until Ctrl-C. Its own, smaller install: the
# `demo` extra (tqdm, which the simulated trainer draws its progress bars with).
$(VENV)/.demo-installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $@

demo: $(VENV)/.demo-installed
	exec $(BIN)/lora-worker demo

# The fault suite at length: hundreds of random kills, a longer contention window, more lifecycle sequences.
chaos: $(VENV)/.installed
	CHAOS_ITERATIONS=200 CHAOS_SECONDS=30 CHAOS_MODEL_EXAMPLES=60 $(BIN)/python -m pytest tests/chaos

# The benchmarks (bench/, docs/benchmarks.md): tables of ratios against baselines measured in the same run.
# They report and never fail on a number, and are not part of `make test`, which only runs each one at tiny
# sizes (tests/test_bench_smoke.py) to check it still works.
# bench/status.py needs wrk (apt-get install -y wrk). About 10 minutes.
bench: $(VENV)/.installed
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) var .pytest_cache .hypothesis
