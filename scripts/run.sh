#!/usr/bin/env bash
# Sets up .venv (scripts/bootstrap.sh) and runs the main job on the built-in default.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
if [ $# -eq 0 ]; then set -- train; fi
exec .venv/bin/inflight "$@"
