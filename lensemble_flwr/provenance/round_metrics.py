"""The run's per-round metrics file, ``RUN_DIR/round-metrics.json``, for curves.

The ledger records what the federation committed; it holds no losses. A Flower run's
strategy also keeps, per closed round, the aggregated metrics of the train replies
(``train``) and of the evaluation (``evaluate``), and rewrites this file after every
round (temp file, ``os.replace``; both fsynced when the run's store writes durably, as
everywhere but on the simulation engine), so that ``lensemble-flwr
report`` can plot training and validation curves. It is a diagnostic beside the run's
artifacts, not one of them: nothing verifies it and nothing else reads it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from lensemble_flwr.errors import ConfigError

METRICS_NAME = "round-metrics.json"
KINDS = ("train", "evaluate")

RoundMetrics = dict[int, dict[str, dict[str, float]]]
"""round → kind (``train`` / ``evaluate``) → metric name → value."""


def write_round_metrics(
    run_dir: str | os.PathLike[str], by_round: RoundMetrics, *, durable: bool = True
) -> Path:
    """Write ``by_round`` (numeric, finite values only; others are left out) atomically;
    ``durable``: fsync the file and its folder (off, a power loss may lose the last
    rounds' metrics; a killed process never leaves a half-written file under the name)."""
    clean = {
        str(r): {
            kind: {
                k: float(v)
                for k, v in metrics.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            }
            for kind, metrics in kinds.items()
            if kind in KINDS
        }
        for r, kinds in sorted(by_round.items())
    }
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / METRICS_NAME
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{METRICS_NAME}.")
    try:
        with os.fdopen(fd, "wb") as f:
            # compact: an indented dump takes json's pure-Python encoder, rewritten every round
            f.write(json.dumps({"rounds": clean}, sort_keys=True, separators=(",", ":")).encode())
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if not durable:
        return path
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def read_round_metrics(run_dir: str | os.PathLike[str]) -> RoundMetrics:
    """The run's per-round metrics ({} when the run has no metrics file).

    Raises:
        ConfigError: the file is there but is not a metrics file.
    """
    path = Path(run_dir) / METRICS_NAME
    if not path.exists():
        return {}
    try:
        rounds = json.loads(path.read_text())["rounds"]
        out: RoundMetrics = {}
        for r, kinds in rounds.items():
            if not isinstance(kinds, Mapping):
                raise TypeError(f"round {r}")
            out[int(r)] = {
                kind: {str(k): float(v) for k, v in kinds[kind].items()}
                for kind in KINDS
                if kind in kinds
            }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(METRICS_NAME, f"{path.name} is not a round metrics file: {exc}") from None
    return dict(sorted(out.items()))
