"""The walk of one update, from a participant's ``handle`` to the committed checkpoint,
enters each module of the top floor once.

One plaintext and one masked round run in process under a profiler that records, at
every call, the stack of the package's top-floor modules (coordinator/, participant/,
release/, secagg/, strategies/, shared_folder/). No stack may leave a module and come
back to it: no core -> mode -> driver -> core callback for the unmask exchange, no
admission -> mode -> admission detour for a masked update, no commit -> coordinator ->
commit, no participant <-> secagg bounce. Methods of values (dataclasses and pydantic
models: ``Release.replace``, ``RunManifest.with_round``) are data, not steps of the walk,
and are not counted; nor are layers below the top floor (a kernel calling back into the
function that handed it a chunk).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pydantic
import pytest

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.simulations.toy import ToyTrainer, initial_params
from lensemble_flwr.transports.inprocess import InProcessNetwork

TOP_FLOOR = tuple(
    f"lensemble_flwr.{part}."
    for part in ("coordinator", "participant", "release", "secagg", "strategies", "shared_folder")
)


def _a_value_method(frame: FrameType) -> bool:
    owner = frame.f_locals.get("self")
    return owner is not None and (
        dataclasses.is_dataclass(owner) or isinstance(owner, pydantic.BaseModel)
    )


def _revisits(coordinator: Coordinator) -> dict[str, int]:
    """Run one round under the profiler: every top-floor module path that leaves a module
    and comes back to it, with how many calls took it."""
    found: dict[str, int] = {}
    stack: list[str | None] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "return":
            if stack:
                stack.pop()
            return
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        top = module.startswith(TOP_FLOOR) and not _a_value_method(frame)
        stack.append(module if top else None)
        if not top:
            return
        path: list[str] = []
        for entry in stack:
            if entry is not None and (not path or path[-1] != entry):
                path.append(entry)
        if len(path) != len(set(path)):
            key = " > ".join(path)
            found[key] = found.get(key, 0) + 1

    sys.setprofile(profile)
    try:
        coordinator.run(num_rounds=1)
    finally:
        sys.setprofile(None)
    return found


@pytest.mark.parametrize("secagg_threshold", [0, 3], ids=["plaintext", "masked"])
def test_one_update_enters_each_top_floor_module_once(
    tmp_path: Path, secagg_threshold: int
) -> None:
    config = LensembleConfig(
        federation={"min_participants": 3, "secagg_threshold": secagg_threshold}
    )
    network = InProcessNetwork(join_endpoint=str(tmp_path))
    for i in range(4):
        pid = f"p{i}"
        network.attach(
            Participant(
                config, participant_id=pid, transport=network.transport_for(pid),
                trainer=ToyTrainer(i),
            )
        )  # fmt: skip
    coordinator = Coordinator(
        config, transport=network.coordinator, initial_params=initial_params(),
        store=Store(tmp_path),
    )  # fmt: skip
    coordinator.run(num_rounds=1)  # the first round: the members' keys, the joins
    assert _revisits(coordinator) == {}
    assert coordinator.global_state().round == 2
