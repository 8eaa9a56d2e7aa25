# The two commands a newcomer needs (see README):
#   make lab   -- set up .venv if missing, install the course, open JupyterLab on notebooks/
#   make test  -- set up .venv if missing, install the course, run every test
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.course-installed
PYTEST_FLAGS ?= -q

.PHONY: lab test test-lib test-notebooks exercises bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall when the package metadata changes; the package itself is installed editable.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# Jupyter refuses to run as root (containers, cloud VMs) unless told it may.
lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/ $$(test "$$(id -u)" = 0 && echo --allow-root)

test: $(STAMP)
	$(BIN)/python -m course_lib.grading build --check
	$(BIN)/python -m pytest $(PYTEST_FLAGS) tests
	$(BIN)/python -m pytest $(PYTEST_FLAGS) --nbval-lax --nbval-cell-timeout=600 notebooks

test-lib: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_FLAGS) tests

test-notebooks: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_FLAGS) --nbval-lax --nbval-cell-timeout=600 notebooks

# Regenerate exercises/ from solutions/ (never edit exercises/ by hand).
exercises: $(STAMP)
	$(BIN)/python -m course_lib.grading build

# From-scratch vs production, printed ratios from one run (not part of `make test`).
bench: $(STAMP)
	for f in benchmarks/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
