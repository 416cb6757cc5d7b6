# Freight: `make run` brings the whole stack up on embedded defaults and runs a sample batch;
# `make test` runs every test against real services; `make stop` stops what `make run` started.
SHELL := /bin/bash
PY := .venv/bin/python
RUN_DIR := var/run
MODEL_DIR := models/demo
EMBED_MODEL_DIR := models/embed
BENCH_MODEL_DIR := models/bench

.PHONY: run stop test lint install model embed-model score-model whisper-model vlm-model adapters bench-model bench bench-engine-step bench-parquet bench-int4 bench-int4-quality bench-reliability bench-dispatcher bench-request-rate bench-head-start bench-embeddings bench-lora bench-images bench-estimates bench-validation bench-finalization bench-uploads bench-refill-pass bench-engine-stats bench-kv-cache-dtype bench-tuning bench-status bench-table int4-model clean quantize-env policy-env audit-env lock lock-check audit

install:
	@bash infra/install.sh

model: install
	@$(PY) infra/build_demo_model.py $(MODEL_DIR)

# the demo embedding model (/v1/embeddings): a tiny LlamaModel with the demo model's tokenizer
embed-model: install
	@$(PY) infra/build_embed_model.py $(EMBED_MODEL_DIR)

# the demo cross-encoder (/v1/score, /v1/rerank): a tiny LlamaForSequenceClassification, one label
score-model: install
	@$(PY) infra/build_score_model.py models/score

# the demo speech model (/v1/audio/transcriptions, /v1/audio/translations): a tiny random Whisper
whisper-model: install
	@$(PY) infra/build_whisper_model.py models/whisper

# the demo vision-language model (images in chat): a tiny Idefics3 with the demo model's tokenizer
vlm-model: install
	@$(PY) infra/build_vlm_model.py models/vlm

# the demo LoRA adapters of the demo model (alpha, beta: each answers its word), trained with peft
adapters: model
	@$(PY) infra/build_lora_adapters.py $(MODEL_DIR) models/adapters

# the benchmark model: the demo model's tokenizer and layout at 4x the per-token compute
bench-model: install
	@$(PY) infra/build_demo_model.py $(BENCH_MODEL_DIR) --hidden 512 --heads 8 --kv-heads 2 --intermediate 1536

run: model
	@bash infra/run_demo.sh

stop:
	@if [ -x $(PY) ]; then $(PY) -m infra.daemons stop-all $(RUN_DIR); else echo "nothing to stop"; fi

lint: install policy-env audit-env
	$(PY) -m ruff check --no-cache .
	$(PY) -m ruff format --no-cache --check api storage scheduler workers infra tests examples migrations bench
	$(PY) -m mypy
	@d=$$(mktemp -d); FREIGHT_DATABASE_URL=sqlite:///$$d/check.db $(PY) -m api.cli db upgrade && \
	  FREIGHT_DATABASE_URL=sqlite:///$$d/check.db $(PY) -m alembic -c migrations/alembic.ini check
	@d=$$(mktemp -d); for o in cpu-demo gpu; do kubectl kustomize infra/k8s/overlays/$$o > $$d/$$o.yaml || exit 1; done; \
	  $(CHECKOV) --config-file infra/k8s/checkov.yaml --skip-download -d $$d; s=$$?; rm -rf $$d; exit $$s
	$(PY) -m infra.dependency_lock check
	$(AUDIT_DB_ENV) $(PY) -m infra.dependency_lock audit

# The CPU install's lock file with hashes (infra/requirements-cpu.lock; infra/dependency_lock.py):
# infra/constraints.txt's pins with the sha256 of each version's files from PyPI's simple index,
# torch's CPU wheel hashed from the local file pip finds (find-links). install.sh installs a CPU
# host from it with --require-hashes (docs/deployment.md, "Dependencies"). lock also writes the GPU
# image's lock (infra/requirements-gpu.lock; infra/gpu_lock.py), resolved by pip from PyPI for the
# image's platform without a GPU (needs the index: 2-3 minutes here).
# lock-check (in make lint, offline) keeps the CPU lock and constraints.txt in step and tells when the
# GPU lock stale; audit runs pip-audit over both locks, from a virtualenv of its own as Checkov;
# where PyPI's JSON API does not answer, it matches them against ADVISORY_DB, a local copy of github.com/pypa/advisory-database
# (make audit ADVISORY_DB=var/advisory-db), or says why it cannot
PIP_AUDIT_VERSION := 2.10.1
AUDIT_ENV := .venv-audit
ADVISORY_DB ?=
AUDIT_DB_ENV := $(if $(ADVISORY_DB),FREIGHT_ADVISORY_DB=$(ADVISORY_DB))
audit-env:
	@$(AUDIT_ENV)/bin/pip-audit --version 2>/dev/null | grep -qx 'pip-audit $(PIP_AUDIT_VERSION)' || { python3 -m venv $(AUDIT_ENV) && \
	  $(AUDIT_ENV)/bin/pip install -q 'pip-audit==$(PIP_AUDIT_VERSION)'; }

lock: install
	$(PY) -m infra.dependency_lock lock

lock-check:
	$(PY) -m infra.dependency_lock check

audit: audit-env
	$(AUDIT_DB_ENV) $(PY) -m infra.dependency_lock audit

# Checkov, the Kubernetes policy check of `make lint` (infra/k8s/checkov.yaml), in a virtualenv of its
# own: its dependencies pin other versions than Freight's
CHECKOV_VERSION := 3.3.30
CHECKOV := .venv-policy/bin/checkov
policy-env:
	@$(CHECKOV) --version 2>/dev/null | grep -qx '$(CHECKOV_VERSION)' || { python3 -m venv .venv-policy && \
	  .venv-policy/bin/pip install -q 'checkov==$(CHECKOV_VERSION)'; }

# The cpu image, offline from this repository and Debian's packages, no base image pulled:
# mmdebstrap's Debian 12 as the base, the lock's wheels gathered here, buildah with no network
# (infra/image_build.sh; docs/deployment.md, "Container image"). Needs root, buildah, mmdebstrap, runc
.PHONY: image image-check image-pin
image: install
	@PY=$(PY) bash infra/image_build.sh

# the built image run with podman as a deployment runs it (API, control worker, engine worker, beat
# against a Redis and PostgreSQL of its own) and a batch through it (infra/image_check.py)
image-check: model
	$(PY) -m infra.image_check

# the digest make image printed (var/image/digest, or DIGEST=sha256:...) into the cpu-demo overlay
image-pin:
	$(PY) -m infra.image_pin $(DIGEST)

# llm-compressor's own virtualenv (GPTQ/AWQ pin other transformers/compressed-tensors than vLLM)
quantize-env: install
	@$(PY) -m workers.quantize_env .venv-quantize

# two processes, grouped so that live stacks never overlap (tests/conftest.py, README "Tests")
test: model embed-model score-model whisper-model vlm-model adapters lint quantize-env
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(PY) -m pytest -p no:cacheprovider -q -n 2 --dist loadgroup

# the scheduler benchmark (bench/README.md): writes bench/results/scheduler.json; BENCH_ARGS=--quick for a smoke run
# Every benchmark runs through bench/resume.py: one whose result file is fresh (no commit since
# touches what it measures), of the same command and of this machine kind is not run again, so a
# `make bench` stopped part-way (it takes longer than one sitting) is taken up where it stopped on
# the same code; FORCE=1 runs every benchmark
RESUME = $(PY) -m bench.resume $(if $(FORCE),--force)
bench: model bench-model bench-engine-step bench-parquet bench-int4 bench-int4-quality bench-reliability bench-dispatcher bench-request-rate bench-head-start bench-embeddings bench-lora bench-images bench-estimates bench-validation bench-finalization bench-uploads bench-refill-pass bench-engine-stats bench-kv-cache-dtype bench-input-order bench-tuning
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) scheduler.json -- bench.scheduler $(BENCH_ARGS)

# validation + planning of a 1,000,000-line batch, JSON-only vs columnar: bench/results/parquet.json
bench-parquet: model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) parquet.json -- bench.parquet $(PARQUET_BENCH_ARGS)

# BF16 against INT4 (every INT4 kernel here) on a ~373M-parameter model: bench/results/int4.json
int4-model: install
	@$(PY) infra/build_demo_model.py models/int4-bench --hidden 1024 --layers 24 --heads 16 --kv-heads 4 --intermediate 4096

bench-int4: model int4-model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) int4.json -- bench.int4 $(INT4_BENCH_ARGS)

# what INT4 costs in quality on the trained demo model (any CPU): bench/results/int4_quality.json
bench-int4-quality: model quantize-env
	$(RESUME) int4_quality.json -- bench.int4_quality

# Freight's engine fed as its loop feeds it against LLM.chat, step for step, and with answers
# decoded token by token as before workers/output_text.py (issue #51 part 2): bench/results/engine-step.json
bench-engine-step: bench-model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) engine-step.json -- bench.engine_step $(ENGINE_STEP_BENCH_ARGS)

# `freight models tune` per workload shape, then Freight end to end against the bare engine at
# Freight's previous defaults and at vLLM's own (issue #51 part 4): bench/results/tuning.json
bench-tuning: bench-model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) tuning.json -- bench.tuning $(TUNING_BENCH_ARGS)

# 20,000 tiny requests, in-process engine vs Freight (issue #21 s2): bench/results/request_rate.json
bench-request-rate: model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) request_rate.json -- bench.request_rate --tracing $(REQUEST_RATE_BENCH_ARGS)

# early slices (workers/head_start.py, FREIGHT_VALIDATION_HEAD_ROWS=256, the default) against
# the code before them (7debfdf: every row waited for the whole file), side by side on the
# request-rate workload
bench-head-start: model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) head_start.json -- bench.request_rate --head-rows 256 --baseline-rev 7debfdf --out bench/results/head_start.json --control-plane ''

# 20,000 inputs of mixed lengths embedded by Freight and by vLLM's run_batch (issue #22):
# bench/results/embeddings.json
bench-embeddings: embed-model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) embeddings.json -- bench.embeddings $(EMBEDDINGS_BENCH_ARGS)

# 8 LoRA adapters x 250 lines in 4 jobs: Freight vs vLLM's engine with LoRA and vs run_batch once
# per adapter (issue #47): bench/results/lora.json
bench-lora: adapters
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) lora.json -- bench.lora $(LORA_BENCH_ARGS)

# 2,000 chat lines over 50 images: Freight vs vLLM's LLM.chat on Freight's order and vs run_batch
# on the file as written (issue #47): bench/results/images.json
bench-images: model vlm-model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) images.json -- bench.images $(IMAGES_BENCH_ARGS)

# dry-run estimates against the batches they priced, on the scheduler workloads (issue #22 s5):
# bench/results/estimates.json
bench-estimates: model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) estimates.json -- bench.estimates $(ESTIMATES_BENCH_ARGS)

# validation + planning of a 1,000,000-line batch on one and two control processes (issue #21):
# bench/results/validation_1m.json and control_plane.json's validation_1m_s; then 1.5 KB lines,
# bench/results/validation_1m_docs.json and control_plane.json's validation_docs (no target)
bench-validation: model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) validation_1m.json -- bench.parallel_validation --rows 1000000 --repeats 2 --out bench/results/validation_1m.json $(VALIDATION_BENCH_ARGS)
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) validation_1m_docs.json -- bench.parallel_validation --rows 1000000 --shape docs --configs one_task,chunks_2 --out bench/results/validation_1m_docs.json

# finalization of a 1,000,000-request batch on SeaweedFS and the local store (issue #21):
# bench/results/finalization.json and control_plane.json's finalization_1m_s
bench-finalization: install
	$(RESUME) finalization.json -- bench.finalization $(FINALIZATION_BENCH_ARGS)

# a 2 GiB batch file sent through /v1/uploads in 64 MiB parts against the live stack, local store
# and SeaweedFS: time, the API's and control worker's memory, validation (issue #48 part 1):
# bench/results/uploads.json; UPLOADS_BENCH_ARGS=--quick for a 0.2 GiB smoke run
bench-uploads: model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) uploads.json -- bench.uploads $(UPLOADS_BENCH_ARGS)

# the dispatcher at fleet scale (10M requests, 1,000 simulated workers) on real PostgreSQL and Redis:
# the "dispatcher" section of bench/results/control_plane.json; DISPATCHER_BENCH_ARGS="--scale 0.01" for a smoke run
bench-dispatcher: install
	$(RESUME) control_plane.json:dispatcher -- bench.dispatcher_sim $(DISPATCHER_BENCH_ARGS)

# one model's refill pass on the fleet simulation's loaded database (10M requests, 1,000 batches),
# this code against 0d21c49, the revision before the pass was cut, in turns (issue #21 s3; a
# worktree of it is made and removed): bench/results/refill_pass.json, whose targets need the baseline
bench-refill-pass: install
	$(RESUME) refill_pass.json -- bench.refill_pass --baseline-rev 0d21c49 $(REFILL_PASS_BENCH_ARGS)

# a million result lines downloaded in input order through the API, the API's memory (issue #48
# part 5): bench/results/input_order.json
bench-input-order: install
	$(RESUME) input_order.json -- bench.input_order --stores s3

# what vLLM's stat logging (FREIGHT_ENGINE_METRICS_BIND) costs an engine, off/on/off/on, 512 prompts
# x 64 tokens, 3 passes each (docs/metrics.md): bench/results/engine_stats.json
bench-engine-stats: model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) engine_stats.json -- bench.engine_stats $(ENGINE_STATS_BENCH_ARGS)

# kv_cache_dtype=fp8 against the serving dtype's KV cache at the same bytes, on a tenth of the
# shared-prefix workload (docs/models.md): bench/results/kv_cache_dtype.json
bench-kv-cache-dtype: model
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) kv_cache_dtype.json -- bench.kv_cache_dtype $(KV_CACHE_DTYPE_BENCH_ARGS)

# each result file, the revision it was run on and whether a commit has since touched what it
# measures (bench/provenance.py); old files without a provenance block say so
bench-status:
	@$(PY) -m bench.provenance

# the README's benchmark table, written from the result files' targets (bench/readme_table.py), and
# every marked figure of the README's prose and docs/ (bench/doc_figures.py); tests/test_docs.py
# checks the pages hold exactly these
bench-table:
	$(PY) -m bench.readme_table --write
	$(PY) -m bench.doc_figures --write

# every fault, load and hostile-input scenario of issue 8: bench/results/reliability.json
bench-reliability: model quantize-env
	VLLM_CPU_NUM_OF_RESERVED_CPU=0 $(RESUME) reliability.json -- bench.reliability $(RELIABILITY_BENCH_ARGS)

clean: stop
	rm -rf var test-artifacts
