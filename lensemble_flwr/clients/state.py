"""A participant's PortableState kept in Flower's ``Context.state`` between messages.

A SuperNode may start a fresh process for every message, so nothing a participant must
remember (inner optimizer, local groups, the last round it answered; later its keys and
privacy accountant) can live in module globals. It lives in ``context.state``: the arrays
in one ArrayRecord, the metadata as canonical JSON in one ConfigRecord.
"""

from __future__ import annotations

import json

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.participant.local_training import PortableState
from lensemble_flwr.strategies.records import arrays_to_record, record_to_arrays

ARRAYS_KEY = "lensemble.state.arrays"
META_KEY = "lensemble.state.meta"
TOKEN_FIELD = "token"
"""The field of the meta record naming the saved state (:mod:`lensemble_flwr.clients.live`)."""


def load_state(state: RecordDict) -> PortableState:
    """The participant state stored in ``state`` (empty for a new participant)."""
    arrays, meta = state.get(ARRAYS_KEY), state.get(META_KEY)
    arrays = arrays if isinstance(arrays, ArrayRecord) else None
    meta = meta if isinstance(meta, ConfigRecord) else None
    return PortableState(
        arrays=record_to_arrays(arrays) if arrays is not None else {},
        meta=json.loads(str(meta["json"])) if meta is not None else {},
    )


def saved_token(state: RecordDict) -> str | None:
    """The token the state in ``state`` was saved under (None: none, or no state)."""
    meta = state.get(META_KEY)
    token = meta.get(TOKEN_FIELD) if isinstance(meta, ConfigRecord) else None
    return token if isinstance(token, str) else None


def save_state(state: RecordDict, portable: PortableState, token: str | None = None) -> None:
    """Store ``portable`` in ``state``, replacing what was there (under ``token``, if
    given: see :func:`saved_token`)."""
    state[ARRAYS_KEY] = arrays_to_record(portable.arrays) if portable.arrays else ArrayRecord()
    meta: dict[str, str] = {"json": canonical_json(portable.meta).decode("ascii")}
    if token is not None:
        meta[TOKEN_FIELD] = token
    state[META_KEY] = ConfigRecord(meta)
