# Freight: `make run` brings the whole stack up on embedded defaults and runs a sample batch;
# `make test` runs every test against real services; `make stop` stops what `make run` started.
SHELL := /bin/bash
PY := .venv/bin/python
RUN_DIR := var/run
MODEL_DIR := models/demo
BENCH_MODEL_DIR := models/bench

.PHONY: run stop test lint install model bench-model bench clean

install:
	@bash infra/install.sh

model: install
	@$(PY) infra/build_demo_model.py $(MODEL_DIR)

# the benchmark model: the demo model's tokenizer and layout at 4x the per-token compute
bench-model: install
	@$(PY) infra/build_demo_model.py $(BENCH_MODEL_DIR) --hidden 512 --heads 8 --kv-heads 2 --intermediate 1536

run: model
	@bash infra/run_demo.sh

stop:
	@if [ -x $(PY) ]; then $(PY) -m infra.services stop-all $(RUN_DIR); else echo "nothing to stop"; fi

lint: install
	$(PY) -m ruff check --no-cache .
	$(PY) -m ruff format --no-cache --check api storage scheduler workers infra tests examples migrations
	@d=$$(mktemp -d); FREIGHT_DATABASE_URL=sqlite:///$$d/check.db $(PY) -m api.cli db upgrade && \
	  FREIGHT_DATABASE_URL=sqlite:///$$d/check.db $(PY) -m alembic -c migrations/alembic.ini check

test: model lint
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(PY) -m pytest -p no:cacheprovider -q

# the scheduler benchmark (bench/README.md): writes bench/results/scheduler.json; BENCH_ARGS=--quick for a smoke run
bench: model bench-model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(PY) -m bench.scheduler $(BENCH_ARGS)

clean: stop
	rm -rf var test-artifacts
