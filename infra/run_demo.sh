#!/usr/bin/env bash
# `make run`: start the local stack on embedded defaults (SQLite, local object store, Redis on a
# loopback port), create a demo tenant once, submit examples/requests.jsonl with the openai client.
# Settings persist in var/freight.env; edit it (or export FREIGHT_* first) to change them.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=.venv/bin/python
RUN_DIR=var/run
ENV_FILE=var/freight.env
# var/ holds the data folder, the settings and the demo API key: its owner's alone (folders 0700,
# files 0600), and so is everything the stack started from here writes (it inherits the umask)
umask 077
mkdir -p var "$RUN_DIR"
chmod 700 var
for secret in "$ENV_FILE" var/demo-api-key; do [ ! -e "$secret" ] || chmod 600 "$secret"; done

if [ ! -f "$ENV_FILE" ]; then
    cat >"$ENV_FILE" <<EOV
FREIGHT_DATA_DIR=${FREIGHT_DATA_DIR:-$REPO/var/data}
FREIGHT_MODELS=${FREIGHT_MODELS:-demo=$REPO/models/demo}
FREIGHT_BROKER_URL=${FREIGHT_BROKER_URL:-redis://127.0.0.1:6390/0}
FREIGHT_API_PORT=${FREIGHT_API_PORT:-8080}
FREIGHT_ENGINE_ENFORCE_EAGER=${FREIGHT_ENGINE_ENFORCE_EAGER:-true}
# cost per engine-hour of this machine (a small cloud VM); set yours, and the accelerator's
# FREIGHT_ACCELERATOR_PEAK_TFLOPS / FREIGHT_ACCELERATOR_BANDWIDTH_GBS for MFU and MBU
FREIGHT_INSTANCE_PRICE_PER_HOUR=${FREIGHT_INSTANCE_PRICE_PER_HOUR:-0.10}
EOV
fi
set -a; . "$ENV_FILE"; set +a

$PY -m infra.daemons stop-all "$RUN_DIR" >/dev/null 2>&1 || true
echo "starting Redis, API, control worker, engine worker (vLLM) and beat; logs in $RUN_DIR ..."
$PY -m infra.processes up "$RUN_DIR"

if [ ! -s var/demo-api-key ]; then
    $PY -m api.cli tenant create demo | tail -n 1 >var/demo-api-key
fi
export FREIGHT_API_KEY=$(cat var/demo-api-key)
export FREIGHT_API_URL="http://127.0.0.1:${FREIGHT_API_PORT}"
$PY examples/submit.py

cat <<MSG

Freight is running (stop it with: make stop)
  API:     $FREIGHT_API_URL/v1   (OpenAI-compatible: files, batches, models)
  API key: $FREIGHT_API_KEY
  console: $FREIGHT_API_URL/console/   (sign in with the API key above)
  logs:    $RUN_DIR/*.log

The freight command finds this stack from this folder (var/freight.env, the demo key beside it).
Put it on your PATH for this shell:
  export PATH="$REPO/.venv/bin:\$PATH"
  freight config
MSG
