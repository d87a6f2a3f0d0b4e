#!/usr/bin/env bash
# Install pdserve, start it (colocated mode, local Ray, default model) and stream one answer.
set -euo pipefail
cd "$(dirname "$0")"
bash deploy/local/install.sh
port="${PDSERVE_PORT:-50051}"
pdserve serve --port "$port" --threads 2 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
# The first start converts the model once (about 30 s); later starts take seconds.
python -c "from pdserve.client import Client; Client('127.0.0.1:$port').wait_ready(timeout=300)"
pdserve generate --target "127.0.0.1:$port" --chat --temperature 0 --max-tokens 96 \
  "${1:-In two sentences, what is disaggregated prefill and decode serving?}"
