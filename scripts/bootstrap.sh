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
  .venv/bin/python -m pip install -q -e ".[test,megatron,ray,trackers,lora,docs,environments,agents]" $TORCH_SPEC
  echo "$want" > "$stamp"
fi
# Test oracles (tests/algorithms compares inflight.algorithms with SkyRL's and verl's own functions):
# SkyRL and verl without their dependencies, plus only the modules their algorithm files import, into
# .venv/oracles (a --target folder the tests put on sys.path; nothing else sees them, so they stay test
# oracles, never dependencies of inflight). verl's wheel also ships its own test suite as top-level
# `tests` and `scripts` packages, which would shadow ours: removed.
ORACLES="skyrl==0.3.0 skyrl-gym==0.4.0 verl==0.9.1 jaxtyping==0.3.11 wadler-lindig==0.1.8 loguru==0.7.3
omegaconf==2.4.0 tensordict==0.10.0 pyvers==0.1.0 orjson==3.13.0 codetiming==1.4.0 torchdata==0.11.0"
oracle_dir=".venv/oracles"
oracle_stamp="$oracle_dir/.inflight-installed"
oracle_want="$(echo $ORACLES)"
if [ "$(cat "$oracle_stamp" 2>/dev/null)" != "$oracle_want" ]; then
  rm -rf "$oracle_dir"
  # shellcheck disable=SC2086
  if ! .venv/bin/python -m pip install -q --no-deps --target "$oracle_dir" $ORACLES; then
    echo "bootstrap: installing the test oracles ($oracle_want) into $oracle_dir failed" >&2
    exit 1
  fi
  rm -rf "$oracle_dir/tests" "$oracle_dir/scripts"
  echo "$oracle_want" > "$oracle_stamp"
fi
