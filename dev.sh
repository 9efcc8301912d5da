#!/usr/bin/env bash
# Set up a virtualenv (once, and again when pyproject.toml changes), then run a job.
#   ./dev.sh main   the main job: a federation (see README)
#   ./dev.sh test   the test suite
set -euo pipefail
cd "$(dirname "$0")"
VENV="${LENSEMBLE_VENV:-.venv}"
PY="${PYTHON:-python3}"

setup() {
  local stamp="$VENV/.lensemble-installed"
  local want
  want="$(sha256sum pyproject.toml | cut -c1-64)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # The CPU build of torch comes from this machine's disk; a bare "torch" would pull CUDA.
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet -e ".[test]"
  echo "$want" > "$stamp"
}

flower_env() {
  FLWR_HOME="$(mktemp -d)"
  export FLWR_HOME FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
  export PATH="$PWD/$VENV/bin:$PATH"
}

case "${1:-}" in
  main)
    setup
    flower_env
    shift
    exec "$VENV/bin/python" -m lensemble_flwr.simulations.inprocess "$@"
    ;;
  test)
    setup
    flower_env
    shift
    exec "$VENV/bin/python" -m pytest -q "$@"
    ;;
  *)
    echo "usage: ./dev.sh main|test [args...]" >&2
    exit 2
    ;;
esac
