# Sourced by scripts/*_venv.sh: a side virtual environment (vLLM's, TRL's, verifiers') that lives
# outside the project's .venv because its packages pin their own versions.
#   side_venv_ready VENV SPEC [venv_has.py options]  the venv exists and has SPEC (metadata only)
#   side_venv_create VENV                             create it if absent ($PYTHON, else python3.11/python3)
#   side_venv_check VENV SPEC [options]               fail naming what is missing after an install

SIDE_VENV_LIB="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

side_venv_ready() {
  local venv="$1"; shift
  [ -x "$venv/bin/python" ] && "$venv/bin/python" "$SIDE_VENV_LIB/venv_has.py" "$@" 2>/dev/null
}

side_venv_create() {
  local venv="$1"
  if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-$(command -v python3.11 || command -v python3)}" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
  fi
}

side_venv_check() {
  local venv="$1" spec="$2"
  side_venv_ready "$@" || { echo "error: $venv does not have $spec after installing it" >&2; exit 1; }
}
