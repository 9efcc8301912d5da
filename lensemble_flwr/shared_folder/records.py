"""What the shared-folder barrier's bytes mean: records, outcomes, the run's genesis.

* A **record** is what one participant process deposits for a sitting: the wire payloads
  its :class:`Participant` sent in answer to the RoundOpen (a Commitment when it is not
  bound yet, then its Update, or a Refusal) and its size, the example count it is weighed
  by (or None). Safetensors bytes: the payloads' arrays as tensors ``<i>/<field>/<name>``
  and everything else as one canonical-JSON metadata entry (never pickle: the folder is
  shared).
* An **announcement** is what a sitting starts from: the checkpoint of the global state
  and, for each participant, the RoundOpen the coordinator would send it — exactly
  ``Coordinator.round_open_for``'s fields, minus the params, which are the checkpoint's.
* An **outcome** is what the decider of a sitting published: closed, aborted by the
  coordinator, or incomplete (somebody never came); the error if it did not close; and
  the announcement of the next sitting, or none when the run stops there.
* The **genesis** is what the process that created the run published: the run id, the
  expected participants and the announcement of round 1's first sitting.

Payloads are not validated here; the coordinator runs them through ``from_wire`` like any
other transport's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lensemble_flwr.artifacts.tensors import pack, unpack
from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.errors import LedgerError, RoundError
from lensemble_flwr.protocol.messages import (
    _HEX64,
    MessageKind,
    RoundOpen,
    WirePayload,
    kind_of,
)
from lensemble_flwr.protocol.round import TerminalState

RECORD_FORMAT = "lensemble-folder-record/1"

OutcomeState = Literal[TerminalState, "incomplete"]
"""How a sitting ended. RoundState.CLOSED: the round committed; RoundState.ABORTED: the
coordinator's attempt ended without a commit (or deciding failed); ``"incomplete"``: some
participants never deposited (no attempt ran, so it is not a round's terminal state)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# -- records -----------------------------------------------------------------------------
class _RecordHeader(_Frozen):
    format: Literal["lensemble-folder-record/1"]
    run_id: str
    round: int = Field(ge=1)
    sitting: int = Field(ge=1)
    participant: str
    num_examples: int | None = Field(None, ge=1)
    payloads: list[dict[str, Any]]
    arrays: list[list[str]] = Field(description="per payload, the fields that are arrays")

    @model_validator(mode="after")
    def _one_array_list_per_payload(self) -> _RecordHeader:
        if len(self.arrays) != len(self.payloads):
            raise ValueError(
                f"{len(self.payloads)} payloads and {len(self.arrays)} lists of array fields"
            )
        return self


@dataclasses.dataclass(frozen=True)
class FolderRecord:
    """One participant's deposit for one sitting."""

    run_id: str
    round: int
    sitting: int
    participant: str
    num_examples: int | None
    payloads: tuple[dict[str, Any], ...]


def update_of(payloads: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The Update among a participant's payloads, if it sent one."""
    return next((p for p in payloads if kind_of(p) is MessageKind.UPDATE), None)


def _is_arrays(value: Any) -> bool:
    return isinstance(value, Mapping) and any(isinstance(v, np.ndarray) for v in value.values())


def encode_record(record: FolderRecord) -> bytes:
    """The record's bytes (a deterministic function of the record)."""
    tensors: dict[str, np.ndarray] = {}
    payloads, arrays = [], []
    for i, payload in enumerate(record.payloads):
        fields, array_fields = {}, []
        for field, value in payload.items():
            if _is_arrays(value):
                array_fields.append(field)
                for name, array in value.items():
                    tensors[f"{i}/{field}/{name}"] = np.asarray(array, order="C")  # 0-d stays 0-d
            else:
                fields[field] = list(value) if isinstance(value, tuple) else value
        payloads.append(fields)
        arrays.append(sorted(array_fields))
    header = _RecordHeader(
        format=RECORD_FORMAT,
        run_id=record.run_id,
        round=record.round,
        sitting=record.sitting,
        participant=record.participant,
        num_examples=record.num_examples,
        payloads=payloads,
        arrays=arrays,
    )
    return pack(tensors, header.model_dump(mode="json"))


def decode_record(data: bytes) -> FolderRecord:
    """Parse a record.

    Raises:
        RoundError: the bytes are not a record (their payloads are checked later, by the
            coordinator).
    """
    try:
        tensors, meta = unpack(data)
        header = _RecordHeader.model_validate(meta)
    except ValueError as e:  # a ValidationError is one
        raise RoundError(f"unreadable shared-folder record: {str(e)[:200]}") from None
    payloads: list[dict[str, Any]] = []
    for i, (fields, array_fields) in enumerate(zip(header.payloads, header.arrays, strict=True)):
        payload = dict(fields)
        for field in array_fields:
            prefix = f"{i}/{field}/"
            payload[field] = {
                key[len(prefix) :]: value
                for key, value in tensors.items()
                if key.startswith(prefix)
            }
        payloads.append(payload)
    return FolderRecord(
        run_id=header.run_id,
        round=header.round,
        sitting=header.sitting,
        participant=header.participant,
        num_examples=header.num_examples,
        payloads=tuple(payloads),
    )


# -- announcements, outcomes, genesis ----------------------------------------------------
class Announcement(_Frozen):
    """What one sitting starts from."""

    round: int = Field(ge=1)
    sitting: int = Field(ge=1)
    checkpoint: str = Field(pattern=_HEX64, description="Store digest of the state's checkpoint.")
    params_hash: str = Field(pattern=_HEX64)
    round_opens: dict[str, dict[str, Any]] = Field(
        description="participant -> its RoundOpen's fields, without the params"
    )

    @classmethod
    def of(
        cls,
        round_opens: Mapping[str, RoundOpen],
        *,
        sitting: int,
        checkpoint: str,
    ) -> Announcement:
        """Announce a sitting whose participants receive ``round_opens`` (all of one
        round and one global state)."""
        first = next(iter(round_opens.values()))
        return cls(
            round=first.round,
            sitting=sitting,
            checkpoint=checkpoint,
            params_hash=first.global_hash,
            round_opens={
                pid: message.model_dump(mode="json", exclude={"params"})
                for pid, message in sorted(round_opens.items())
            },
        )

    def round_open(self, participant: str, params: Mapping[str, np.ndarray]) -> WirePayload:
        """The wire payload of ``participant``'s RoundOpen, on ``params``."""
        return {**self.round_opens[participant], "params": dict(params)}

    def again(self) -> Announcement:
        """The next sitting of the same round, on the same state and RoundOpens (nothing
        ran in between: the coordinator's attempt number has not moved)."""
        return self.model_copy(update={"sitting": self.sitting + 1})


class Outcome(_Frozen):
    """What the decider of a sitting published."""

    run_id: str
    round: int = Field(ge=1)
    sitting: int = Field(ge=1)
    state: OutcomeState
    decided_by: str
    contributors: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    error: str | None = Field(None, description="the error's class name, if not closed")
    error_field: str | None = Field(None, description="a ConfigError's field")
    reason: str | None = None
    global_hash: str = Field(pattern=_HEX64, description="the global state after the sitting")
    next: Announcement | None = Field(None, description="None: the run stops here")


class Genesis(_Frozen):
    """What the process that created the run published."""

    run_id: str
    participants: tuple[str, ...]
    created_by: str
    first: Announcement


def encode(value: Outcome | Genesis) -> bytes:
    """Canonical JSON bytes of an outcome or a genesis."""
    return canonical_json(value.model_dump(mode="json"))


def decode_outcome(data: bytes) -> Outcome:
    """Raises LedgerError when the stored outcome does not parse."""
    return _parse(Outcome, data, "shared-folder outcome")


def decode_genesis(data: bytes) -> Genesis:
    """Raises LedgerError when the stored genesis does not parse."""
    return _parse(Genesis, data, "shared-folder genesis")


def _parse(model: type[Any], data: bytes, what: str) -> Any:
    try:
        return model.model_validate_json(data)
    except (ValidationError, ValueError) as exc:
        raise LedgerError(f"{what} does not parse: {str(exc)[:200]}") from None
