# The two commands a user needs: `make demo` and `make test` (`make lint` for contributors). All set up .venv
# on first use.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-stamp
INSTALL_STAMP := $(VENV)/.install-stamp
PYTEST_ARGS ?=

.PHONY: all build test lint demo bench clean

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): $(PY) Makefile
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" pybind11 ninja "setuptools>=77" wheel packaging numpy \
		pytest pytest-timeout scikit-learn matplotlib rich click tqdm \
		cloudpickle psutil "grpcio>=1.60" "grpcio-health-checking>=1.60" "protobuf>=4.21" \
		ruff mypy "keras>=3.15"
	touch $@

$(INSTALL_STAMP): $(DEPS_STAMP) pyproject.toml setup.py
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

# First run: pip's editable install. Later runs: ninja rebuilds only the C++ files that changed.
build: $(INSTALL_STAMP)
	$(PY) setup.py -q build_ext --inplace

test: build
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Lint and type-check the package (config in pyproject.toml); CI runs it before the tests.
lint: $(DEPS_STAMP)
	$(PY) -m ruff check torchstrategies tests
	$(PY) -m mypy torchstrategies

demo: build
	$(PY) -m torchstrategies demo

bench: build
	$(PY) -m torchstrategies bench kernels

clean:
	rm -rf build *.egg-info torchstrategies/*.so
