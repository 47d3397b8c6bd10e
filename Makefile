# Two commands: `make test` and `make demo` (4 arms, 1 seed: ~10 min on 2 cores; `make demo-all`: the
# preregistered 8 arms x 3 seeds). All create/refresh .venv through `make install`.
# Torch is installed first from an overridable pin so a fresh install never pulls a CUDA build
# unasked:  make install TORCH_SPEC="torch==2.5.1+cu121" PIP_EXTRA="--index-url ..."
PY ?= python3
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test test-slow test-all demo demo-all lint clean

install: $(VENV)/.installed-$(EXTRAS)

$(VENV)/.installed-$(EXTRAS): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(PIP_EXTRA)
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

lint: install
	$(BIN)/ruff check .

# the bitwise promises again on MKL's SSE4.2 path, the one AMD CPUs take (docs/reproducibility.md)
test: lint
	$(BIN)/python -m pytest -q -m "not slow and not gpu"
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 $(BIN)/python -m pytest -q -m "bitwise and not slow and not gpu"

test-slow: install
	$(BIN)/python -m pytest -q -m "slow and not gpu"

test-all: lint
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/projected-grpo demo

demo-all: install
	$(BIN)/projected-grpo demo --arms all --seeds 3

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
