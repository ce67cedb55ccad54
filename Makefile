# The two commands of the README: `make run` and `make test`. Both install what they need first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BIND ?= 127.0.0.1:8203

.PHONY: run test chaos bench install clean

# The trainer's sandbox is bubblewrap (`sandbox` setting, README "The sandbox"). Without it, say so first.
NO_BWRAP_NOTICE = command -v bwrap >/dev/null || [ -n "$$LORA_WORKER_SANDBOX" ] || printf '%s %s\n%s\n' \
	"lora-worker: bubblewrap (bwrap) is not installed:" "$(1)" \
	"lora-worker: install it with: sudo apt-get install bubblewrap"

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

# Dev server: SQLite under ./var, schema migrated, dead jobs reconciled, then gunicorn (1 worker) on loopback.
run: $(VENV)/.installed
	$(BIN)/lora-worker migrate
	$(BIN)/lora-worker reconcile
	@$(call NO_BWRAP_NOTICE,the trainer runs WITHOUT its sandbox here (sandbox = none).); \
	[ -n "$$LORA_WORKER_SANDBOX" ] || command -v bwrap >/dev/null || export LORA_WORKER_SANDBOX=none; \
	exec $(BIN)/gunicorn -c systemd/gunicorn.conf.py --bind $(BIND) 'lora_worker.wsgi:app'

test: $(VENV)/.installed
	@$(call NO_BWRAP_NOTICE,the sandbox tests are skipped.)
	$(BIN)/python -m pytest

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
