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
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"

has_spec() {  # the venv has every name==version of SPEC, and no torch but 2.13.0 (a +cpu suffix is fine)
  "$VENV/bin/python" - "$SPEC" 2>/dev/null <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    for req in sys.argv[1].split():
        name, _, want = req.partition("==")
        if want and version(name).split("+")[0] != want:
            sys.exit(1)
    for module in ("openai", "datasets"):
        version(module)
except PackageNotFoundError:
    sys.exit(1)
try:
    if version("torch").split("+")[0] != "2.13.0":
        sys.exit(1)
except PackageNotFoundError:
    pass
PYEOF
}

if [ -x "$VENV/bin/python" ] && has_spec; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q -c <(echo torch==2.13.0) $SPEC
has_spec || { echo "error: $VENV does not have $SPEC (and torch, if any, 2.13.0) after installing it" >&2; exit 1; }
