#!/usr/bin/env bash
# Set up a virtualenv (once, and again when pyproject.toml changes), then run a job.
#   ./dev.sh main        the main job: `flwr run .` on Flower's local simulation engine
#                        (its run config checked first; extra arguments go to `flwr run`)
#   ./dev.sh inprocess   the same runtime in one process, on a simulated clock
#   ./dev.sh test        the test suite
#   ./dev.sh api [OUT]   the API reference, from the docstrings, into OUT (docs/api/)
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
  export FLWR_HOME FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_DISABLE_UPDATE_CHECK=1
  export PATH="$(cd "$VENV" && pwd)/bin:$PATH"
}

run_flower_app() {
  # Check the app's run config and the --run-config overrides first (under a second):
  # Flower says only "Invalid run configuration", or stops the ServerApp after its start-up.
  "$VENV/bin/python" -m lensemble_flwr.simulations.check_config "${APP:-.}" \
    --flwr-run-args "$@" || exit 1
  # Start the local simulation SuperLink ourselves, so that we know its PID and stop it
  # afterwards (a SuperLink that `flwr run` starts on its own keeps running).
  local port="${FLWR_LOCAL_SUPERLINK_HTTP_API_PORT:-39091}" control="${FLWR_LOCAL_CONTROL_API_PORT:-39093}"
  # A SuperLink left running on these ports would take the run instead of ours.
  "$VENV/bin/python" - "$port" "$control" <<'PY' || exit 1
import socket, sys
for port in map(int, sys.argv[1:]):
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            sys.exit(f"port {port} on 127.0.0.1 is in use (a SuperLink still running from an "
                     "earlier `flwr run`?): stop that process by its PID, or set "
                     "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT and FLWR_LOCAL_CONTROL_API_PORT")
PY
  setsid "$VENV/bin/flower-superlink" --insecure --simulation --isolation subprocess \
    --control-api-address "127.0.0.1:$control" --host 127.0.0.1 --port "$port" \
    --database "$FLWR_HOME/state.db" --log-file "$FLWR_HOME/superlink.log" \
    >"$FLWR_HOME/superlink.out" 2>&1 &
  local superlink=$!
  trap 'kill -- -'"$superlink"' 2>/dev/null || true' EXIT
  for _ in $(seq 100); do
    "$VENV/bin/python" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=0.5)" 2>/dev/null && break
    sleep 0.2
  done
  if ! kill -0 "$superlink" 2>/dev/null; then
    echo "the SuperLink did not start: see $FLWR_HOME/superlink.out" >&2
    cat "$FLWR_HOME/superlink.out" >&2
    exit 1
  fi
  "$VENV/bin/flwr" run "${APP:-.}" --stream --federation-config "num-supernodes=${NUM_SUPERNODES:-10}" "$@"
  # `flwr run` exits 0 even when the run failed: ask the SuperLink.
  "$VENV/bin/flwr" ls --format json | "$VENV/bin/python" -c '
import json, sys
runs = json.load(sys.stdin)["runs"]
run = max(runs, key=lambda r: r["pending-at"]) if runs else {"status": "no run"}
status = run["status"]
ok = status == "finished:completed"
details = "" if ok or not run.get("status-details") else " (" + run["status-details"] + ")"
print("run status: " + status + details)
sys.exit(0 if ok else 1)'
}

case "${1:-}" in
  main)
    setup
    flower_env
    shift
    run_flower_app "$@"
    ;;
  inprocess)
    setup
    shift
    exec "$VENV/bin/python" -m lensemble_flwr.simulations.inprocess "$@"
    ;;
  test)
    setup
    flower_env
    shift
    trap 'rm -rf "$FLWR_HOME"' EXIT  # the tests' Flower home: nothing of it is kept
    "$VENV/bin/python" -m pytest -q "$@"
    ;;
  api)
    setup
    shift
    exec "$VENV/bin/python" docs/build_api.py "$@"
    ;;
  *)
    echo "usage: ./dev.sh main|inprocess|test|api [args...]" >&2
    exit 2
    ;;
esac
