#!/usr/bin/env bash
# Creates .venv and installs inflight with its test tools. Idempotent and fast when nothing changed.
# INFLIGHT_TORCH picks the torch requirement (default: the CPU build torch==2.13.0); for CUDA, e.g.
#   INFLIGHT_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" scripts/bootstrap.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${INFLIGHT_TORCH:-torch==2.13.0}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.inflight-installed"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1) $TORCH_SPEC"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first, pinned, so nothing below can pull a multi-GB CUDA build.
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install -q $TORCH_SPEC
  .venv/bin/python -m pip install -q -e ".[test,megatron,ray,trackers,lora]" $TORCH_SPEC
  echo "$want" > "$stamp"
fi
