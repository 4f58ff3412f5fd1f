#!/usr/bin/env bash
# Creates (or reuses) TRL's own virtual environment for `inflight bench peers` (TRL's GRPOTrainer
# against inflight's trainers). Idempotent; when the venv is there with the wanted versions it only
# reads their metadata (well under a second; TRL not imported) and changes nothing. TRL is not a
# dependency of the package: the bench runs inflight/bench/trl_worker.py with this venv's python.
#   TRL_VENV    where (default: .venv-trl in the repository)
#   TRL_SPEC    what to install (default: "torch==2.13.0 trl==1.16.0"; torch pinned first so that
#               nothing pulls a CUDA build on a CPU machine)
#   PYTHON      the interpreter that creates it (default: python3.11, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TRL_VENV:-.venv-trl}"
SPEC="${TRL_SPEC:-torch==2.13.0 trl==1.16.0}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"

has_spec() {  # the venv has every name==version of SPEC (a local suffix such as +cpu is fine)
  "$VENV/bin/python" - "$SPEC" 2>/dev/null <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    for req in sys.argv[1].split():
        name, _, want = req.partition("==")
        if want and version(name).split("+")[0] != want:
            sys.exit(1)
    for module in ("transformers", "datasets", "accelerate"):
        version(module)
except PackageNotFoundError:
    sys.exit(1)
PYEOF
}

if [ -x "$VENV/bin/python" ] && has_spec; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
TORCH="$(printf '%s\n' $SPEC | grep '^torch==' || true)"
# shellcheck disable=SC2086
[ -z "$TORCH" ] || "$VENV/bin/python" -m pip install -q $TORCH
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q $SPEC
has_spec || { echo "error: $VENV does not have $SPEC after installing it" >&2; exit 1; }
