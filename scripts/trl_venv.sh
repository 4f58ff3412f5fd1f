#!/usr/bin/env bash
# Creates (or reuses) TRL's own virtual environment for `inflight bench peers` (TRL's GRPOTrainer
# against inflight's trainers). Idempotent; when the venv is there with the wanted versions it only
# reads their metadata (well under a second; TRL not imported) and changes nothing. TRL is not a
# dependency of the package: the bench runs inflight/bench/trl_worker.py with this venv's python.
#   TRL_VENV    where (default: .venv-trl in the repository)
#   TRL_SPEC    what to install (default: "torch==2.13.0 trl==1.16.0 peft==0.22.0"; torch pinned first
#               so that nothing pulls a CUDA build on a CPU machine; peft for the LoRA workloads, the
#               version the project's .venv has, so both sides build the same adapters)
#   PYTHON      the interpreter that creates it (default: python3.11, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TRL_VENV:-.venv-trl}"
SPEC="${TRL_SPEC:-torch==2.13.0 trl==1.16.0 peft==0.22.0}"
source scripts/lib/side_venv.sh
CHECK=(--modules transformers datasets accelerate)

if side_venv_ready "$VENV" "$SPEC" "${CHECK[@]}"; then
  exit 0
fi
side_venv_create "$VENV"
TORCH="$(printf '%s\n' $SPEC | grep '^torch==' || true)"
# shellcheck disable=SC2086
[ -z "$TORCH" ] || "$VENV/bin/python" -m pip install -q $TORCH
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q $SPEC
side_venv_check "$VENV" "$SPEC" "${CHECK[@]}"
