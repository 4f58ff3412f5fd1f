#!/usr/bin/env bash
# Sets up .venv (scripts/bootstrap.sh) and vLLM's venv (scripts/vllm_venv.sh, for the vllm-marked
# tests), then runs the whole test suite. Extra arguments go to pytest.
#   INFLIGHT_SKIP_VLLM=1   do not create vLLM's venv; the vllm-marked tests then skip (or pass
#                          -m "not vllm" to leave them out)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
if [ "${INFLIGHT_SKIP_VLLM:-0}" != "1" ]; then
  scripts/vllm_venv.sh
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q "$@"
