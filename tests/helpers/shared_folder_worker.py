"""One participant process for tests/shared_folder/test_runner.py.

The test starts these as real processes (forked from a server that imported torch once,
so that a process costs milliseconds instead of seconds). Each runs a
:class:`SharedFolderParticipant` on the toy task and writes a JSON report. ``mutant`` names
a broken variant (or a scripted fault, :class:`BarrierFaults`) applied to the participant
before it runs; the mutation tests check that the invariants of a round catch every one
of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric import ec

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import StoreError
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.shared_folder.runner import SharedFolderParticipant
from lensemble_flwr.simulations.toy import ToyTrainer, initial_params
from lensemble_flwr.testing import BarrierFaults

RACE_WINDOW = 0.3
"""Seconds between the resolve and the bind of the racy claim: longer than a poll, so
every waiter looks while the first claimant is between the two."""


def identity_of(pid: str) -> IdentityKey:
    """A deterministic identity key per participant id (a test key: every process of a
    test derives the same one without sharing files)."""
    secret = int.from_bytes(hashlib.sha256(b"test-identity|" + pid.encode()).digest(), "big")
    return IdentityKey(ec.derive_private_key(secret % (2**255) + 1, ec.SECP256R1()))


def identities_of(ids: list[str] | tuple[str, ...]) -> dict[str, str]:
    return {pid: identity_of(pid).public_openssh for pid in ids}


def folder_config(**federation: Any) -> LensembleConfig:
    """The tests' config: a tiny inner loop, one attempt per round unless told otherwise."""
    fed = {"min_participants": 2, "root_seed": 11, "max_round_attempts": 1}
    fed.update(federation)
    return LensembleConfig(federation=fed, inner={"steps": 2, "lr": 0.05, "batch_size": 8})


Mutant = Callable[[SharedFolderParticipant], None]
MUTANTS: dict[str, Mutant] = {}


def _mutant(name: str) -> Callable[[Mutant], Mutant]:
    def register(patch: Mutant) -> Mutant:
        MUTANTS[name] = patch
        return patch

    return register


@_mutant("claim-as-resolve-then-bind")
def _resolve_then_bind(node: SharedFolderParticipant) -> None:
    def claim(self: Store, name: str, digest: str) -> bool:
        try:
            self.resolve(name)
        except StoreError:
            time.sleep(RACE_WINDOW)
            self.bind(name, digest)
            return True
        return False

    Store.claim = claim  # type: ignore[method-assign]


@_mutant("no-wait")
def _no_wait(node: SharedFolderParticipant) -> None:
    node.barrier.round_timeout = 1e-9  # nobody waits for the others: the deadline is now


@_mutant("no-publish")
def _no_publish(node: SharedFolderParticipant) -> None:
    # the decider goes on with its outcome; nobody else ever sees it
    node.barrier.faults = BarrierFaults(lose=lambda name: name.endswith("/outcome"))


@_mutant("killed-when-deciding")
def _killed_when_deciding(node: SharedFolderParticipant) -> None:
    """Not a mutant: whoever wins the decision is killed before it decides or publishes
    anything."""

    def die(claim: str) -> None:
        if claim.endswith("/decision"):
            os.kill(os.getpid(), signal.SIGKILL)

    node.barrier.faults = BarrierFaults(on_claim=die)


def run(spec: dict[str, Any], report_path: str) -> None:
    """Run one participant as ``spec`` says and write its report to ``report_path``."""
    torch.set_num_threads(1)
    ids: list[str] = spec["participants"]
    node = SharedFolderParticipant(
        spec["folder"],
        config=folder_config(**spec.get("federation", {})),
        participant_id=spec["me"],
        trainer=ToyTrainer(ids.index(spec["me"])),
        participants=ids,
        initial_params=initial_params(),
        run_id=spec.get("run_id", "run"),
        quorum=spec.get("quorum"),
        round_timeout=spec["round_timeout"],
        publish_timeout=spec["publish_timeout"],
        poll_interval=spec.get("poll_interval", 0.02),
        identity=identity_of(spec["me"]),
        identities=identities_of(ids),
    )
    if spec.get("mutant"):
        MUTANTS[spec["mutant"]](node)
    report: dict[str, Any] = {"me": spec["me"], "pid": os.getpid()}
    try:
        state = node.run(spec["rounds"])
        report |= {"round": state.round, "global_hash": state.params_hash}
    except Exception as exc:  # reported: the test decides what a failure means
        report["error"] = [type(exc).__name__, str(exc)]
    report["decided"] = [[d.key.round, d.key.sitting, d.state] for d in node.decisions]
    report["deposited"] = [[k.round, k.sitting] for k in node.deposits]
    with open(report_path, "w") as f:
        json.dump(report, f)
