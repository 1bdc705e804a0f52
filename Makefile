# Two commands on a fresh machine: `make demo` and `make test` (both create .venv and install first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first and explicitly: an unpinned torch pulls a multi-GB CUDA build. On a GPU machine: make TORCH=torch ...
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install demo test bench-produce clean

$(BIN)/dflashq: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

install: $(BIN)/dflashq

demo: install
	$(BIN)/dflashq demo --out demo-out

test: install
	$(BIN)/pytest -q $(PYTEST_ARGS)

bench-produce: install
	$(BIN)/python benchmarks/produce.py

clean:
	rm -rf $(VENV) demo-out dflashq-runs
