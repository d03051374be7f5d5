# The two commands a user needs: `make demo` and `make test` (`make lint` for contributors). All set up .venv
# on first use.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-stamp
INSTALL_STAMP := $(VENV)/.install-stamp
PYTEST_ARGS ?= --durations=15
# torch's extension builder runs whichever `ninja` is first on PATH: make it the one installed here.
WITH_VENV_PATH := PATH="$(abspath $(VENV))/bin:$$PATH"

.PHONY: all build test lint demo bench clean

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): $(PY) Makefile
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" pybind11 ninja "setuptools>=77" wheel packaging numpy \
		pytest pytest-timeout scikit-learn matplotlib rich click tqdm \
		cloudpickle psutil "grpcio>=1.60" "grpcio-health-checking>=1.60" "protobuf>=4.21" \
		ruff mypy accelerate transformers lightning "keras>=3.15" "xxhash>=3"
	touch $@

# The editable install is the Python package only: pip's editable build would compile the extension in a
# temporary directory, and build_ext --inplace below would then compile it all again.
$(INSTALL_STAMP): $(DEPS_STAMP) pyproject.toml setup.py
	TORCHSTRATEGIES_NO_EXTENSION=1 $(WITH_VENV_PATH) $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

# The one compile of the C++ extension (build/temp, setup.cfg); later runs rebuild only what changed.
build: $(INSTALL_STAMP)
	$(WITH_VENV_PATH) $(PY) setup.py -q build_ext --inplace

test: build
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Lint and type-check the package (config in pyproject.toml); CI runs it before the tests.
lint: $(DEPS_STAMP)
	$(PY) -m ruff check torchstrategies torchstrategies_cli tests
	$(PY) -m mypy torchstrategies torchstrategies_cli

demo: build
	$(PY) -m torchstrategies demo

# Regenerates the figures in benchmarks/results/ (JSON + plot each, stamped with date, machine and load).
bench: build
	for f in kernels allreduce train train_ps; do $(PY) benchmarks/$$f.py || exit 1; done

clean:
	rm -rf build *.egg-info torchstrategies/*.so
