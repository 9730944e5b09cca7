# Two entry points for a fresh machine with Python 3.11, git and make:
#   make serve   set up, then run the server on 127.0.0.1:8000 with the default model
#   make test    set up, then lint, type-check and run the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve test lint typecheck pytest model browser clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, so pip takes the local CPU build rather than a CUDA one
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(STAMP)

model: setup
	$(PY) -m streamer models pull

serve: model
	$(PY) -m streamer serve --model default --host 127.0.0.1 --port 8000

browser:
	@command -v chromium >/dev/null 2>&1 || ( apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null ) \
	  || ( sudo apt-get update -qq && sudo apt-get install -y -qq chromium chromium-driver >/dev/null )

lint: setup
	$(VENV)/bin/ruff check streamer kernels tests benchmarks loadtest examples

typecheck: setup
	$(VENV)/bin/mypy streamer/engine streamer/server streamer/lang streamer/distributed streamer/router streamer/messages.py streamer/sampling_params.py streamer/engine_stats.py streamer/frames.py streamer/config.py streamer/speculative_config.py streamer/model/draft.py streamer/model/eagle_draft.py streamer/sampling/rejection.py streamer/kv

# The suite in PYTEST_WORKERS processes (pytest-xdist), a test file at a time each
# (--dist loadfile: a module's fixtures are built once and its tests keep their order), torch
# on one thread in each: one pytest process kept ~1 of CI's 2 cores busy (Python-bound
# interpreter kernels, servers, HTTP), and two processes of two OpenMP threads each would
# contend for the cores.
PYTEST_WORKERS ?= 2

pytest: setup model browser
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -x --durations=15 -n $(PYTEST_WORKERS) --dist loadfile

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
