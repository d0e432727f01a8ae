# The two commands the README starts with: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STOFC := $(VENV)/bin/stofc
EXTRAS ?= gpu,test

.PHONY: venv demo test test-quick lint gpu-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) examples/run_demo.py --out out/demo

lint: venv
	$(VENV)/bin/ruff check stofc tests bench examples
	$(VENV)/bin/mypy

# The suite runs on two pytest-xdist workers, one per core of a CI machine (safe on two).
# Serially it took 777-1068 s of a CI run limited to 30 min. PYTEST_ARGS= runs it serially.
PYTEST_ARGS ?= -n 2
test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

test-quick: lint
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

gpu-test: venv
	$(PY) -m pytest -q tests/gpu

clean:
	rm -rf $(VENV) out .pytest_cache
