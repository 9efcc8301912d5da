"""RoundOpen contents for a Flower Grid, encoded once and shared.

The coordinator hands every bound recipient of an attempt the same frozen RoundOpen; its
recipients share one encoded content, as FedAvg's nodes share one RecordDict. The global
arrays become one ArrayRecord per params mapping, and consecutive instructions share the
config record when it did not change. A content is kept by the RoundOpen it encodes (the
RoundOpen is kept too, so its id stays its own) while the close it carries and the user
config are the ones it was encoded with (compared by value: a config changed in place is
noticed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, RecordDict

from lensemble_flwr.protocol.messages import RoundOpen, WirePayload
from lensemble_flwr.strategies import records
from lensemble_flwr.strategies.layout import ArrayLayout

ENCODED_KEPT = 8
"""Encoded RoundOpen contents kept (an attempt has two at most: for recipients that are
bound and for those asked for a commitment)."""


class OpenEncoder:
    """The encoded contents of the RoundOpens sent since the close or the user config
    last changed."""

    def __init__(self) -> None:
        self._params_record: tuple[Any, Any] | None = None  # (params mapping, ArrayRecord)
        self._config_record: ConfigRecord | None = None  # the last instruction's, to share
        self._encoded: dict[int, tuple[RoundOpen, RecordDict]] = {}
        self._encoded_with: tuple[WirePayload | None, dict[str, Any]] | None = None

    def content(
        self,
        message: RoundOpen,
        payload: WirePayload,
        *,
        user_config: Mapping[str, Any],
        round_close: WirePayload | None,
        layout: ArrayLayout | None,
        arrays_key: str,
        config_key: str,
    ) -> RecordDict:
        """``message``'s content (``payload`` is its wire form), encoded once while
        ``round_close`` and ``user_config`` stay what it was encoded with."""
        kept = self._kept(message, round_close, user_config)
        if kept is not None:
            return kept
        params = payload["params"]
        if self._params_record is None or self._params_record[0] is not params:
            record = layout.to_record(params) if layout else records.arrays_to_record(params)
            self._params_record = (params, record)
        content = records.encode_instruction(
            payload,
            server_round=message.round,  # one numbering: Flower's
            user_config=dict(user_config),
            round_close=round_close,
            params_record=self._params_record[1],
            carried=layout.carried_names if layout else None,
            arrays_key=arrays_key,
            config_key=config_key,
            reuse=self._config_record,
        )
        shared = content[config_key]
        self._config_record = shared if isinstance(shared, ConfigRecord) else None
        if len(self._encoded) >= ENCODED_KEPT:
            self._encoded.clear()
        self._encoded[id(message)] = (message, content)
        return content

    def _kept(
        self, message: RoundOpen, round_close: WirePayload | None, user_config: Mapping[str, Any]
    ) -> RecordDict | None:
        """The content kept for ``message``; None if none is, or if the close or the
        config changed (then every kept content is forgotten)."""
        if (
            self._encoded_with is None
            or self._encoded_with[0] is not round_close
            or self._encoded_with[1] != user_config
        ):
            self._encoded.clear()
            self._encoded_with = (round_close, dict(user_config))
            return None
        held = self._encoded.get(id(message))
        return held[1] if held is not None and held[0] is message else None
