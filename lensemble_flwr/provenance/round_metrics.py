"""The run's per-round metrics file, ``RUN_DIR/round-metrics.jsonl``, for curves.

The ledger records what the federation committed; it holds no losses. A Flower run's
strategy also keeps, per closed round, the aggregated metrics of the train replies
(``train``), of the federated evaluation (``evaluate``) and of the server-side
``evaluate_fn`` on the round's global model (``server``; round 0 is the initial model's,
when ``evaluate_fn`` evaluated it): one JSON line per round, appended as
the round is reported, so that a round costs the same however many came before it
(rewriting one JSON document every round made a run of R rounds cost O(R²)). The line
and the file are fsynced when the run's store writes durably (everywhere but on the
simulation engine). ``lensemble-flwr report`` plots the curves. It is a diagnostic
beside the run's artifacts, not one of them: nothing verifies it and nothing else reads
it.

A process killed in the middle of an append can leave a last line without its newline;
a reader skips it, and the next append cuts it off first. A round reported twice (a run
resumed after its last report) keeps its last line.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lensemble_flwr.atomic_write import fsync_folder, write_atomically
from lensemble_flwr.errors import ConfigError

METRICS_NAME = "round-metrics.jsonl"
KINDS = ("train", "evaluate", "server")
ALWAYS = ("train", "evaluate")
"""The kinds every line holds (empty or not); ``server`` is written only when it holds a
metric, so a run without an ``evaluate_fn`` writes the lines it always wrote."""

RoundMetrics = dict[int, dict[str, dict[str, float]]]
"""round → kind (``train`` / ``evaluate`` / ``server``) → metric name → value."""


def _line(server_round: int, kinds: Mapping[str, Mapping[str, Any]]) -> bytes:
    """One round's line: numeric, finite values only (others are left out)."""
    clean: dict[str, Any] = {"round": int(server_round)}
    for kind in KINDS:
        metrics = kinds.get(kind) or {}
        if kind not in ALWAYS and not metrics:
            continue
        clean[kind] = {
            str(k): float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
    # compact, one line: json's C encoder (an indented dump takes the pure-Python one)
    return json.dumps(clean, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def append_round_metrics(
    run_dir: str | os.PathLike[str],
    server_round: int,
    kinds: Mapping[str, Mapping[str, Any]],
    *,
    durable: bool = True,
) -> Path:
    """Append round ``server_round``'s metrics (``kinds``: ``train`` / ``evaluate`` /
    ``server`` → name → value) as one line, in one write. A last line a killed writer
    left without its newline is cut off first. ``durable``: fsync the file (and its
    folder when the file is new); off, a power loss may lose the last rounds' lines.

    Raises:
        OSError: the file cannot be written (the caller decides whether that matters).
    """
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / METRICS_NAME
    line = _line(server_round, kinds)
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            os.ftruncate(fd, _end_of_last_line(fd, size))
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    if durable and created:
        fsync_folder(folder)
    return path


def _end_of_last_line(fd: int, size: int) -> int:
    """The offset just past the file's last newline (0 if it has none)."""
    end = size
    while end > 0:
        start = max(0, end - 65536)
        block = os.pread(fd, end - start, start)
        cut = block.rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0


def write_round_metrics(
    run_dir: str | os.PathLike[str], by_round: RoundMetrics, *, durable: bool = True
) -> Path:
    """Replace the file with ``by_round``, one line per round in round order, atomically
    (:func:`lensemble_flwr.atomic_write.write_atomically`); ``durable``: fsync the file and
    its folder (off, a power loss may lose it; a killed process never leaves a
    half-written file under the name)."""
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / METRICS_NAME
    write_atomically(path, [_line(r, kinds) for r, kinds in sorted(by_round.items())], sync=durable)
    return path


def read_round_metrics(run_dir: str | os.PathLike[str]) -> RoundMetrics:
    """The run's per-round metrics, by round ({} when the run has no metrics file); a
    round with several lines keeps its last, and a last line without its newline (an
    append a killed process did not finish) is skipped.

    Raises:
        ConfigError: the file is there but a complete line is not a round's metrics.
    """
    path = Path(run_dir) / METRICS_NAME
    if not path.exists():
        return {}
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(METRICS_NAME, f"{path.name} cannot be read: {exc}") from None
    complete = data[: data.rfind(b"\n") + 1]
    out: RoundMetrics = {}
    for number, raw in enumerate(complete.splitlines(), start=1):
        try:
            entry = json.loads(raw)
            if not isinstance(entry, Mapping):
                raise TypeError("not an object")
            server_round = entry["round"]
            if not isinstance(server_round, int) or isinstance(server_round, bool):
                raise TypeError(f"round {server_round!r}")
            out[server_round] = {
                kind: {str(k): float(v) for k, v in entry[kind].items()}
                for kind in KINDS
                if kind in entry
            }
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(
                METRICS_NAME, f"{path.name} line {number} is not a round's metrics: {exc}"
            ) from None
    return dict(sorted(out.items()))
