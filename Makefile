# The two commands a newcomer needs (see README):
#   make lab   -- set up .venv if missing, install the course, open JupyterLab on the course (START_HERE)
#   make test  -- build the course's wheel, install it into build/venv-test, run every test from there
# Neither needs a pre-step. Without an NVIDIA GPU both install the CPU build of PyTorch
# (tools/install-torch says where it comes from), never the 5.5 GB CUDA stack.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.course-installed
# make test runs in its own environment with the course installed from its wheel (what Colab and a
# pip user get), from an empty folder: a notebook that depends on the repository layout fails there.
TEST_VENV ?= build/venv-test
TBIN       = $(abspath $(TEST_VENV))/bin
TEST_STAMP = $(TEST_VENV)/.deps-installed
WHEEL_DIR  = build/wheel
JOBS ?= 2
PYTEST_FLAGS ?= -q -n $(JOBS) --dist loadfile --durations=15
NBVAL_FLAGS   = --nbval-lax --nbval-current-env --nbval-cell-timeout=600
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# make lab: JupyterLab's folder and extra options (tests/test_browser.py sets them)
LAB_ROOT  ?= .
LAB_FLAGS ?=

.PHONY: lab lab-serve test test-versions test-lib test-notebooks wheel exercises colab-sync bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall when the package metadata changes; the package itself is installed editable.
$(STAMP): pyproject.toml | $(BIN)/python
	sh tools/install-torch $(BIN)/python $(TORCH_CPU_INDEX)
	$(BIN)/python -m pip install --quiet -e ".[lab,test]"
	touch $(STAMP)

# Jupyter refuses to run as root (containers, cloud VMs) unless told it may.
lab: $(STAMP)
	$(MAKE) --no-print-directory lab-serve

# The JupyterLab command of `make lab`, without the install step.
lab-serve:
	cd $(LAB_ROOT) && $(abspath $(BIN))/jupyter lab START_HERE.ipynb \
	    $$(test "$$(id -u)" = 0 && echo --allow-root) $(LAB_FLAGS)

$(TBIN)/python:
	$(PYTHON) -m venv $(TEST_VENV)

$(TEST_STAMP): pyproject.toml | $(TBIN)/python
	sh tools/install-torch $(TBIN)/python $(TORCH_CPU_INDEX)
	$(TBIN)/python -m pip install --quiet build
	touch $(TEST_STAMP)

# Build the wheel and install it (and its [lab,test] dependencies) into $(TEST_VENV), fresh each time.
wheel: $(TEST_STAMP)
	rm -rf $(WHEEL_DIR) build/lib build/bdist.*  # setuptools would keep deleted modules from build/lib
	$(TBIN)/python -m build --wheel --outdir $(WHEEL_DIR) . > build/wheel.log 2>&1 || (cat build/wheel.log; exit 1)
	$(TBIN)/python -m pip install --quiet "$$(ls $(WHEEL_DIR)/*.whl)[lab,test]"
	$(TBIN)/python -m pip install --quiet --force-reinstall --no-deps $(WHEEL_DIR)/*.whl

# make test: the wheel is built and installed into $(TEST_VENV) (never the repository's source: `python -P`
# keeps the current folder off sys.path), the lecture notebooks are copied into an empty folder and run
# there by nbval next to the library, grader and browser tests, all in one pytest run on $(JOBS) workers.
# It prints the slowest tests and the reason for every skipped one (a missing browser, no Slurm).
TEST_RUN = build/test-run
test: wheel
	$(TBIN)/python -P -m course_lib.grading build --check
	$(TBIN)/python -P -c "import course_lib, sys; p = course_lib.__file__; \
	    sys.exit(0 if '/site-packages/' in p else f'make test: course_lib imported from {p}, not from the installed wheel')"
	rm -rf $(TEST_RUN) && mkdir -p $(TEST_RUN)/notebooks && cp notebooks/*.ipynb $(TEST_RUN)/notebooks/
	cd $(TEST_RUN) && $(TBIN)/python -P -m pytest $(PYTEST_FLAGS) $(NBVAL_FLAGS) \
	    $(CURDIR)/tests notebooks

# The supported-versions matrix (README "Supported versions"): Google Colab's stock image (its Python and
# the pins of course_lib.colab.COLAB_IMAGE, with the [test] extra only, so ipywidgets stays 7.7.1) and the
# newest releases this machine installs, each in its own build/venv-versions-<name> with the course's
# wheel; library tests and lecture notebooks as in `make test`. Not part of `make test` or CI (README:
# how long). COLAB_PYTHON / NEWEST_PYTHON name the interpreters (pyenv: PYENV_VERSION=3.13.0 python3.13).
COLAB_PYTHON  ?= python3.13
NEWEST_PYTHON ?= $(PYTHON)
NEWEST_SET    ?= torch==2.14.1 jax[cpu]==0.10.2
test-versions: wheel
	WHEEL="$$(ls $(abspath $(WHEEL_DIR))/*.whl)" PYTEST_ARGS="$(PYTEST_FLAGS) $(NBVAL_FLAGS)" REPO=$(CURDIR) \
	    sh tools/test-versions colab "$(COLAB_PYTHON)" "$$($(PYTHON) course_lib/colab.py pins | tail -n +2)" test --colab
	WHEEL="$$(ls $(abspath $(WHEEL_DIR))/*.whl)" PYTEST_ARGS="$(PYTEST_FLAGS) $(NBVAL_FLAGS)" REPO=$(CURDIR) \
	    sh tools/test-versions newest "$(NEWEST_PYTHON)" "$(NEWEST_SET)" lab,test

# Quicker loops while developing, in .venv with the editable install.
test-lib: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_FLAGS) tests

test-notebooks: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_FLAGS) $(NBVAL_FLAGS) notebooks

# Regenerate exercises/ from solutions/ (never edit exercises/ by hand).
exercises: $(STAMP)
	$(BIN)/python -m course_lib.grading build

# Rewrite the Colab badge + set-up cell of every notebook and solution, and START_HERE.ipynb.
colab-sync: $(STAMP)
	$(BIN)/python -m course_lib.colab sync
	$(BIN)/python -m course_lib.grading build

# From-scratch vs production, printed ratios from one run (not part of `make test`).
bench: $(STAMP)
	for f in benchmarks/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) build .pytest_cache
