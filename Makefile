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
# Two workers, a whole file each at a time; tests/conftest.py hands the files out longest first.
JOBS ?= 2
PYTEST_FLAGS ?= -q -n $(JOBS) --dist loadfile --durations=15
NBVAL_FLAGS   = --nbval-lax --nbval-current-env --nbval-cell-timeout=600
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# make lab: JupyterLab's folder and extra options (tests/test_browser.py sets them)
LAB_ROOT  ?= .
LAB_FLAGS ?=

.PHONY: lab lab-serve test test-versions test-gpu test-lib test-notebooks wheel exercises colab-sync bench clean

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
# One BLAS / OpenMP thread per process while the suite runs: two workers, the known-wrong runs' kernels and
# the clusters' ranks already share 2 cores, and a numpy or scipy call that starts OpenBLAS's threads
# beside them mostly waits (a parametric fit of notebook 13 took 7.3 s with them against 2.7 s without,
# next to three busy processes). Only the tests' environment: a learner's kernel keeps the defaults.
TEST_THREADS = OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
test: wheel
	$(TBIN)/python -P -m course_lib.grading build --check
	$(TBIN)/python -P -c "import course_lib, sys; p = course_lib.__file__; \
	    sys.exit(0 if '/site-packages/' in p else f'make test: course_lib imported from {p}, not from the installed wheel')"
	rm -rf $(TEST_RUN) && mkdir -p $(TEST_RUN)/notebooks && cp notebooks/*.ipynb $(TEST_RUN)/notebooks/
	cd $(TEST_RUN) && $(TEST_THREADS) $(TBIN)/python -P -m pytest $(PYTEST_FLAGS) $(NBVAL_FLAGS) \
	    $(CURDIR)/tests notebooks

# The supported-versions matrix (CONTRIBUTING.md, "Supported versions"): Google Colab's stock image (its Python and
# the pins of course_lib.colab.COLAB_IMAGE, with the [test] extra only, so ipywidgets stays 7.7.1) and the
# newest releases this machine installs, each in its own build/venv-versions-<name> with the course's
# wheel; library tests and lecture notebooks as in `make test`. Not part of `make test` or CI (CONTRIBUTING.md:
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

# make test-gpu: the one GPU check, on a machine with at least one CUDA GPU (INSTRUCTORS.md, "GPUs"). It runs in
# the current Python, $(PYTHON), with no venv (the GPU image's own CUDA torch and jax), the course imported
# from this source tree, and stops at the first failing step; every step prints its wall time:
#   GPUs and environment   nvidia-smi -L; torch sees CUDA; nbval, ipykernel, ipywidgets, cloudpickle import
#   library                tests/test_gpu.py (-m gpu): every technique under NCCL on cuda at world size 1, and
#                          on 2 and 4 GPUs where there are that many (skipped with the reason otherwise)
#   demos                  torchrun --standalone --nproc_per_node=1 (as $(PYTHON) -m torch.distributed.run, so
#                          this Python's torch): hello, selftest, hybrid --check, frontier --check, resilient
#   notebooks              every lecture notebook under nbval, copied into an empty folder as in `make test`
#                          (the Colab GPU case), $(GPU_JOBS) at a time where pytest-xdist is installed
#   benchmark              benchmarks/bench_gpu.py: MFU and memory, figures in $(GPU_RUN)/bench_gpu.json
# An image without nbval, ipykernel or ipywidgets: `make test-gpu WHEELS=.whl` installs that folder's wheels
# (tools/gpu-wheels downloads them where pip can reach PyPI) into $(GPU_SITE) first, offline and --no-deps.
# Sized to finish within 8 minutes on one H200; the whole run is stopped after GPU_TIMEOUT seconds.
GPU_RUN     = build/gpu
GPU_SITE   ?= /tmp/course-gpu-site
GPU_TIMEOUT ?= 900
GPU_JOBS    ?= 4
WHEELS      ?=
TORCHRUN    = $(PYTHON) -m torch.distributed.run --standalone --nproc_per_node=1
test-gpu:
	@start=$$(date +%s); deadline=$$((start + $(GPU_TIMEOUT))); \
	step() { name=$$1; shift; t0=$$(date +%s); left=$$((deadline - t0)); \
	  echo "== test-gpu: $$name: $$(printf '%s' "$$*" | head -n 1)"; \
	  if [ $$left -le 0 ]; then rc=124; else timeout -k 10 $$left "$$@"; rc=$$?; fi; \
	  dt=$$(( $$(date +%s) - t0 )); \
	  if [ $$rc -eq 124 ] || [ $$rc -eq 137 ]; then \
	    echo "== test-gpu: $$name: TIMED OUT after $$dt s (the whole run may take GPU_TIMEOUT=$(GPU_TIMEOUT) s)"; exit 1; fi; \
	  if [ $$rc -ne 0 ]; then echo "== test-gpu: $$name: FAILED (exit $$rc) after $$dt s"; exit 1; fi; \
	  echo "== test-gpu: $$name: ok in $$dt s"; }; \
	rm -rf $(GPU_RUN) && mkdir -p $(GPU_RUN)/notebooks && cp notebooks/*.ipynb $(GPU_RUN)/notebooks/ || exit 1; \
	$(if $(WHEELS),step wheels sh -c 'rm -rf $(GPU_SITE) && $(PYTHON) -m pip install -q --no-index --no-deps \
	    --no-compile --target $(GPU_SITE) $(abspath $(WHEELS))/*.whl';) \
	export PYTHONPATH="$(CURDIR)$(if $(WHEELS),:$(GPU_SITE))$${PYTHONPATH:+:$$PYTHONPATH}"; \
	step GPUs nvidia-smi -L; \
	step environment $(PYTHON) -c 'import sys, importlib.util as u, torch, jax; \
	    print("python", sys.version.split()[0], "| torch", torch.__version__, "| jax", jax.__version__, \
	          "| CUDA GPUs", torch.cuda.device_count()); \
	    missing = [m for m in ("nbval", "ipykernel", "ipywidgets", "cloudpickle") if u.find_spec(m) is None]; \
	    sys.exit("torch sees no CUDA GPU" if not torch.cuda.is_available() else \
	             "missing: " + ", ".join(missing) + " (download wheels with sh tools/gpu-wheels, then make test-gpu WHEELS=.whl)" \
	             if missing else 0)'; \
	step library $(PYTHON) -m pytest -q -m gpu tests/test_gpu.py; \
	step "demo hello" $(TORCHRUN) -m course_lib.demos.hello; \
	step "demo selftest" $(TORCHRUN) -m course_lib.demos.selftest; \
	step "demo hybrid" $(TORCHRUN) -m course_lib.demos.hybrid --check; \
	step "demo frontier" $(TORCHRUN) -m course_lib.demos.frontier --check; \
	step "demo resilient" $(TORCHRUN) -m course_lib.demos.resilient --dir $(GPU_RUN)/resilient --steps 10 --every 5; \
	xdist=$$($(PYTHON) -c 'import xdist' 2>/dev/null && echo "-n $(GPU_JOBS) --dist loadfile"); \
	(cd $(GPU_RUN) && step notebooks $(PYTHON) -m pytest -q -p course_lib.grading.nbval_plugin $(NBVAL_FLAGS) \
	    $$xdist notebooks) || exit 1; \
	step benchmark $(PYTHON) benchmarks/bench_gpu.py --json $(GPU_RUN)/bench_gpu.json; \
	echo "== test-gpu: every step passed in $$(( $$(date +%s) - start )) s"

clean:
	rm -rf $(VENV) build .pytest_cache
