"""Starts crash-drill processes without paying the imports each time (a test helper).

Run as a script. It imports the drill (torch, the coordinator, the participants) once,
then for every request on stdin — one JSON line ``{"argv": [...], "log": path,
"timeout": seconds}`` — forks a child that runs ``crash_drill.main(argv)`` with its
stdout and stderr in ``log``, waits for it, and answers one JSON line
``{"returncode": n}`` on stdout: the exit status, or minus the signal that killed it
(``-9`` for SIGKILL), or null if it ran past the timeout (it is then killed). Each child
is a real process: a SIGKILL ends it exactly as it would end ``python -m``. Nothing here
runs torch before forking, so the children start from a clean, single-threaded image.
It exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import torch._dynamo  # noqa: F401  (AdamW imports it lazily: ~0.8 s per run otherwise)

from lensemble_flwr.simulations import crash_drill


def _child(argv: list[str], log: str) -> None:
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = crash_drill.main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(argv: list[str], log: str, timeout: float) -> int | None:
    pid = os.fork()
    if pid == 0:
        _child(argv, log)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.01)


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        code = _run(request["argv"], request["log"], float(request["timeout"]))
        sys.stdout.write(json.dumps({"returncode": code}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
