#!/usr/bin/env bash
# Install pdserve, start it (colocated mode, local Ray, default model) and stream one answer.
set -euo pipefail
cd "$(dirname "$0")"
bash deploy/local/install.sh
port="${PDSERVE_PORT:-50051}"
# The server logs (Ray's start, one line per finished request) go to a file, so that the terminal
# shows only the answer and its summary.
log="${PDSERVE_LOG:-${TMPDIR:-/tmp}/pdserve-quickstart.log}"
echo "pdserve: starting the server on port $port (its log: $log)" >&2
pdserve serve --port "$port" --threads 2 >"$log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
# The first start converts the model once (tens of seconds); later starts take seconds.
until python -c "from pdserve.client import Client; Client('127.0.0.1:$port').wait_ready(timeout=5)" 2>/dev/null; do
  if ! kill -0 "$server" 2>/dev/null || ((SECONDS > 600)); then
    echo "pdserve: the server did not start; the end of its log ($log):" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
done
pdserve generate --target "127.0.0.1:$port" --chat --temperature 0 --max-tokens 96 \
  "${1:-In two sentences, what is disaggregated prefill and decode serving?}"
