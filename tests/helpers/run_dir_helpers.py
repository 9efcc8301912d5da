"""Run directories for the audit, CLI and proof tests: a real one from an in-process
federation, a hand-made one, and ways to tamper with either on disk (the store itself
refuses to overwrite, so tampering goes around it, the way an attacker would)."""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from federation_helpers import dp_config, federation

from lensemble_flwr.artifacts.checkpoint import encode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import digest_arrays
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import (
    GENESIS,
    ContributionRecord,
    Ledger,
    RoundEntry,
    RunManifest,
    entries_digest,
    header_digest,
)
from lensemble_flwr.transports.faults import FaultPlan

ROUNDS = 3
ABORTED_ROUND = 2


def federated_run(root: Path) -> Path:
    """Three closed rounds of four DP participants, round 2 aborted once (two of them drop
    below the quorum of three) and closed on its second attempt. Returns the run dir."""
    config = dp_config(root / "budgets", dp_epsilon=50.0)
    faults = (
        FaultPlan()
        .drop("p01", round=ABORTED_ROUND, at=RoundState.COLLECTING)
        .drop("p02", round=ABORTED_ROUND, at=RoundState.COLLECTING)
        .rejoin("p01", round=ABORTED_ROUND)
        .rejoin("p02", round=ABORTED_ROUND)
    )
    coordinator, _, _ = federation(root, participants=4, faults=faults, config=config)
    coordinator.run(ROUNDS)
    # The store removes the empty temp files it kept ready for its next writes when it is
    # collected; the objects of a federation refer to each other, so collect them now:
    # a copy of the run holds what the run leaves, whenever the collector would have run.
    del coordinator
    gc.collect()
    return root / "run"


def synthetic_run(
    root: Path,
    roots_by_round: list[Mapping[str, str | None]],
    *,
    frame_drift: bool = True,
) -> Path:
    """A run written directly through the ledger and manifest APIs (no coordinator): tiny
    checkpoints, one closed attempt per round, the given dataset roots per contributor,
    and a ``frame_drift`` diagnostic when asked."""
    store = Store(root)
    zeros = {"w": np.zeros(2, np.float32)}
    global_hash = digest_arrays(zeros, "params")
    manifest = RunManifest(
        run_id="synthetic",
        config={},
        root_seed=0,
        initial_params_hash=global_hash,
        initial_checkpoint=store.put(encode_checkpoint(0, zeros, zeros)),
    )
    manifest.start(store)
    ledger, previous = Ledger(store), GENESIS
    for t, roots in enumerate(roots_by_round):
        drift = 0.01 * (t + 1) if frame_drift else None
        params = {"w": np.full(2, t + 1.0, np.float32)}
        new_hash = digest_arrays(params, "params")
        contributors = tuple(sorted(roots))
        digests = {p: hashlib.sha256(f"{p}/{t}".encode()).hexdigest() for p in contributors}
        aggregate = hashlib.sha256(f"sum/{t}".encode()).hexdigest()
        diagnostics = {"mean_delta_l2": 1.0 / (t + 1)}
        if drift is not None:
            diagnostics["frame_drift"] = drift
        entry = RoundEntry(
            round=t + 1,  # round t + 1 takes θ_t to θ_{t+1}
            attempt=1,
            state=RoundState.CLOSED,
            round_seed=t,
            prior_global_hash=global_hash,
            invited=contributors,
            contributors=contributors,
            count=len(contributors),
            total_weight=len(contributors),
            update_digests=digests,
            aggregate_digest=aggregate,
            new_global_hash=new_hash,
            diagnostics=diagnostics,
        )
        record = ledger.append(
            ContributionRecord(
                round=t + 1,
                attempt=1,
                invited=contributors,
                contributors=contributors,
                count=len(contributors),
                total_weight=len(contributors),
                dataset_roots=dict(roots),
                update_digests=digests,
                aggregate_digest=aggregate,
                previous_global_hash=global_hash,
                new_global_hash=new_hash,
                checkpoint=store.put(encode_checkpoint(t + 1, params, zeros)),
                round_seed=t,
                frame_drift=drift,
                header_digest=header_digest(manifest),
                entries_digest=entries_digest([entry]),
                registry_digest=None,
                previous_record_hash=previous,
            )
        )
        manifest = manifest.with_round(store, entry)
        global_hash, previous = new_hash, record.record_hash
    return root


def copy_run(src: Path, dest: Path) -> Path:
    return Path(shutil.copytree(src, dest))


# -- tampering, on disk ----------------------------------------------------------------------
def digest_of(run: Path, name: str) -> str:
    return (run / "names" / name).read_text().strip()


def blob_path(run: Path, digest: str) -> Path:
    return run / "blobs" / digest[:2] / digest


def read_json(run: Path, name: str) -> dict[str, Any]:
    return json.loads(blob_path(run, digest_of(run, name)).read_bytes())


def rebind(run: Path, name: str, data: bytes) -> str:
    """Store ``data`` as a correctly addressed blob and point ``name`` at it."""
    digest = hashlib.sha256(data).hexdigest()
    path = blob_path(run, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    (run / "names" / name).write_text(digest + "\n")
    return digest


def rewrite_json(run: Path, name: str, **changes: Any) -> dict[str, Any]:
    """Change fields of the JSON document bound to ``name`` (a new blob, name rebound)."""
    doc = read_json(run, name) | changes
    rebind(run, name, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    return doc


def reseal_record(run: Path, name: str, **changes: Any) -> ContributionRecord:
    """Change a ledger record and recompute its record hash (a forger with write access)."""
    doc = read_json(run, name) | changes
    record = ContributionRecord.model_validate(doc).sealed()
    rebind(run, name, json.dumps(record.model_dump(mode="json"), sort_keys=True).encode())
    return record


def flip_byte(path: Path, offset: int = -1) -> None:
    """Flip the bits of one byte in place (the file keeps its name, so its address lies)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
