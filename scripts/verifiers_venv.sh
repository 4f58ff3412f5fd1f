#!/usr/bin/env bash
# Creates (or reuses) verifiers' own virtual environment for `environment.env_class=verifiers:<env id>`
# (inflight/agents/verifiers_worker.py runs there, one process per run). Idempotent; when the venv is
# there with the wanted versions it only reads their metadata (well under a second; verifiers not
# imported) and changes nothing. verifiers lives outside the project's .venv: its releases pin their
# own openai, datasets and more. Install your environments' packages into it afterwards
# (.venv-verifiers/bin/pip install <package>).
#   VERIFIERS_VENV   where (default: .venv-verifiers in the repository)
#   VERIFIERS_SPEC   what to install (default: "verifiers==0.1.8.post2", the legacy API SkyRL's
#                    integration drives; it needs no torch, and torch stays pinned to 2.13.0 should
#                    anything ask for it, so that nothing pulls a CUDA build on a CPU machine)
#   PYTHON           the interpreter that creates it (default: python3.11, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VERIFIERS_VENV:-.venv-verifiers}"
SPEC="${VERIFIERS_SPEC:-verifiers==0.1.8.post2}"
source scripts/lib/side_venv.sh
CHECK=(--modules openai datasets --torch-if-any 2.13.0)

if side_venv_ready "$VENV" "$SPEC" "${CHECK[@]}"; then
  exit 0
fi
side_venv_create "$VENV"
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q -c <(echo torch==2.13.0) $SPEC
side_venv_check "$VENV" "$SPEC" "${CHECK[@]}"
