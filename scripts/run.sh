#!/usr/bin/env bash
# Sets up .venv (scripts/bootstrap.sh) and runs the main job: the built-in demo (examples/default.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
if [ $# -eq 0 ]; then set -- train --config examples/default.yaml; fi
exec .venv/bin/inflight "$@"
