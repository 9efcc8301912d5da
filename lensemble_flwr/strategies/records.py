"""Carrying lensemble wire payloads inside Flower messages, both directions.

An instruction (server → node) is a Flower ``RecordDict`` that any ClientApp can read:

* ``"arrays"`` — the global params (what a stock Message-API ClientApp trains on);
* ``"config"`` — the one ConfigRecord (Flower's mods expect a single one): ``server-round``
  and the user's train config, the RoundOpen's fields under ``lensemble.*`` keys, and
  the previous round's RoundClose under ``lensemble.close.*`` when one is pending (it
  rides on the next instruction instead of costing an exchange of its own).

A reply (node → server) from a lensemble participant carries one ConfigRecord per
message it sends (``"lensemble.commitment"``, ``"lensemble.update"``), the update's
delta as the ArrayRecord ``"lensemble.update.delta"``, and a ``"metrics"``
MetricRecord (``num-examples``, and ``last-batch-loss`` when known). A reply from a stock
ClientApp (``"arrays"`` + a MetricRecord with ``num-examples``) is turned into an
*unbound* update by the receiver, which knows what it sent.

Nothing here validates: receivers run the result through ``messages.from_wire``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from lensemble_flwr.protocol.messages import PARTICIPANT_KINDS, MessageKind, WirePayload, kind_of
from lensemble_flwr.strategies.array_codec import from_array, to_array

NODE_PREFIX = "node-"
PREFIX = "lensemble."
ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"
CLOSE_PREFIX = PREFIX + "close."
"""Prefix of a RoundClose's fields riding in an instruction's ``config`` record."""
_ARRAY_FIELD = {MessageKind.ROUND_OPEN: "params", MessageKind.UPDATE: "delta"}
# Flower's ConfigRecord cannot carry None or mappings, and chokes on "" and [] (count_bytes
# raises, an empty list has no element type); such fields travel specially: the names of
# None, [] and "" fields as lists, mappings as canonical JSON strings.
_NULLS, _EMPTY_LISTS, _EMPTY_STRINGS = "__null__", "__empty_list__", "__empty_str__"
_JSON = "__json__"
# what a participant sends, in protocol order (MessageKind lists the kinds in that order)
_REPLY_KINDS = tuple(kind for kind in MessageKind if kind in PARTICIPANT_KINDS)
UNMASK_RECORD = PREFIX + MessageKind.UNMASK_REQUEST.value
CHECK_RECORD = PREFIX + MessageKind.SURVIVOR_CHECK.value
INSTRUCTION_KINDS = frozenset(
    {MessageKind.ROUND_OPEN, MessageKind.UNMASK_REQUEST, MessageKind.SURVIVOR_CHECK}
)
"""The kinds a train instruction carries (the ones a participant answers)."""
CARRIED = "carried-arrays"
"""Config field (under the ``lensemble.`` prefix) naming the instruction's arrays that are
carried with the model, not federated (integer buffers): not part of the RoundOpen."""


RecordT = TypeVar("RecordT", ArrayRecord, ConfigRecord, MetricRecord)


def records_of(content: RecordDict, kind: type[RecordT]) -> dict[str, RecordT]:
    """The records of type ``kind`` in ``content`` by name, in order: what
    ``content.config_records`` (``array_records``, ``metric_records``) holds, as a plain dict
    to read (Flower builds those views anew, re-checking every record, on each access)."""
    return {name: record for name, record in content.items() if isinstance(record, kind)}


def named_or_only(records_: Mapping[str, Any], key: str) -> Any:
    """The record named ``key``, else the only record there is (an app may name its
    instruction records as FedAvg's ``arrayrecord_key``/``configrecord_key`` say)."""
    if key in records_:
        return records_[key]
    lensemble_free = [name for name in records_ if not name.startswith(PREFIX)]
    return records_[lensemble_free[0]] if len(lensemble_free) == 1 else None


def participant_id(node_id: int) -> str:
    """The participant id of a Flower node: ``node-<node_id>``."""
    return f"{NODE_PREFIX}{node_id}"


def node_id_of(participant: str) -> int:
    """The Flower node id of a participant id (``node-<id>``)."""
    if not participant.startswith(NODE_PREFIX):
        raise ValueError(f"{participant!r} is not a Flower node participant")
    return int(participant[len(NODE_PREFIX) :])


def arrays_to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Named numpy arrays → ArrayRecord (sorted names; the arrays' bytes are copied, as
    ``Array(ndarray)`` encodes them: :mod:`.array_codec`)."""
    record = ArrayRecord()  # filled in place: ArrayRecord(dict) would copy every Array again
    for name in sorted(arrays):
        record[name] = to_array(arrays[name])
    return record


def record_to_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """ArrayRecord → named numpy arrays (fresh copies, as ``Array.numpy()`` gives)."""
    return {name: from_array(record[name]) for name in record}


def _fields_to_config(payload: WirePayload, skip: str | None, prefix: str = "") -> dict[str, Any]:
    config: dict[str, Any] = {}
    special: dict[str, list[str]] = {_NULLS: [], _EMPTY_LISTS: [], _EMPTY_STRINGS: [], _JSON: []}
    for name, value in payload.items():
        if name == skip:
            continue
        if value is None:
            special[_NULLS].append(name)
        elif isinstance(value, Mapping):
            special[_JSON].append(name)
            config[prefix + name] = json.dumps(dict(value), sort_keys=True)
        elif isinstance(value, (tuple, list)) and not value:
            special[_EMPTY_LISTS].append(name)
        elif isinstance(value, str) and not value:
            special[_EMPTY_STRINGS].append(name)
        else:
            config[prefix + name] = list(value) if isinstance(value, tuple) else value
    for key, names in special.items():
        if names:
            config[prefix + key] = names
    return config


def _config_to_fields(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    fields = {k[len(prefix) :]: v for k, v in config.items() if k.startswith(prefix)}
    for key, value in ((_NULLS, None), (_EMPTY_LISTS, []), (_EMPTY_STRINGS, "")):
        for name in fields.pop(key, []):
            fields[name] = value
    for name in fields.pop(_JSON, []):
        fields[name] = json.loads(fields[name])
    return fields


def encode_instruction(
    round_open: WirePayload,
    *,
    server_round: int,
    user_config: Mapping[str, Any] | None = None,
    round_close: WirePayload | None = None,
    params_record: ArrayRecord | None = None,
    carried: list[str] | None = None,
    arrays_key: str = ARRAYS,
    config_key: str = CONFIG,
    reuse: ConfigRecord | None = None,
) -> RecordDict:
    """A RoundOpen (and a pending RoundClose) as a train instruction any ClientApp reads.

    ``params_record`` is the RoundOpen's params already encoded (in the user's order, with
    the ``carried`` arrays that travel with the model): the global params are the same for
    every recipient of an attempt, so encode them once and share them. Everything is in
    the one ``config`` record (a pending RoundClose under ``lensemble.close.``), as
    Flower's mods expect a single ConfigRecord. ``reuse`` is the config record of an
    earlier instruction: it is shared (as FedAvg shares one record among its messages)
    when it holds exactly this instruction's config, which saves validating it again.
    """
    config = dict(user_config or {})
    config["server-round"] = server_round
    config.update(_fields_to_config(round_open, skip="params", prefix=PREFIX))
    if carried:
        config[PREFIX + CARRIED] = list(carried)
    if round_close is not None:
        config.update(encode_close(round_close))
    arrays = params_record if params_record is not None else arrays_to_record(round_open["params"])
    same = reuse is not None and dict(reuse) == config
    return RecordDict({arrays_key: arrays, config_key: reuse if same else ConfigRecord(config)})


def encode_exchange(request: WirePayload) -> RecordDict:
    """A masked round's request as a train instruction: an UnmaskRequest (the disclosure
    exchange) or a SurvivorCheck (the consistency exchange), by its ``kind``."""
    name = CHECK_RECORD if request["kind"] == MessageKind.SURVIVOR_CHECK.value else UNMASK_RECORD
    return RecordDict({name: ConfigRecord(_fields_to_config(request, skip=None))})


def encode_close(round_close: WirePayload) -> dict[str, Any]:
    """A RoundClose as the ``lensemble.close.*`` config entries that ride on the next
    instruction."""
    return _fields_to_config(round_close, skip=None, prefix=CLOSE_PREFIX)


def decode_instruction(content: RecordDict) -> list[dict[str, Any]]:
    """The lensemble payloads of an instruction, RoundClose first. Empty if there are none."""
    payloads: list[dict[str, Any]] = []
    config_records = records_of(content, ConfigRecord)
    for exchange in (UNMASK_RECORD, CHECK_RECORD):  # an instruction of its own
        if exchange in config_records:
            return [_config_to_fields(config_records[exchange])]
    config = named_or_only(config_records, CONFIG)
    if config is None:
        return payloads
    if config.get(CLOSE_PREFIX + "kind") == MessageKind.ROUND_CLOSE.value:
        payloads.append(_config_to_fields(config, prefix=CLOSE_PREFIX))
    if config.get(PREFIX + "kind") == MessageKind.ROUND_OPEN.value:
        fields = {k: v for k, v in _config_to_fields(config, prefix=PREFIX).items() if "." not in k}
        carried = set(fields.pop(CARRIED, []))
        arrays = named_or_only(records_of(content, ArrayRecord), ARRAYS)
        fields["params"] = (
            {n: a for n, a in record_to_arrays(arrays).items() if n not in carried}
            if arrays is not None
            else None
        )
        payloads.append(fields)
    return payloads


def instruction_user_config(content: RecordDict) -> dict[str, Any]:
    """The user's train config an instruction carries (``server-round`` included; none of
    lensemble's ``lensemble.*`` keys)."""
    config = named_or_only(records_of(content, ConfigRecord), CONFIG)
    if config is None:
        return {}
    return {k: v for k, v in config.items() if not k.startswith(PREFIX)}


def instruction_arrays(content: RecordDict) -> dict[str, np.ndarray]:
    """Every array of an instruction in the order the server gave them, carried ones
    included (what a NumPyClient's ``state_dict`` setter expects)."""
    arrays = named_or_only(records_of(content, ArrayRecord), ARRAYS)
    return record_to_arrays(arrays) if arrays is not None else {}


def encode_reply(payloads: list[WirePayload], metrics: Mapping[str, float]) -> RecordDict:
    """What a lensemble participant sends back: its messages, in order, and metrics."""
    content = RecordDict()
    for payload in payloads:
        kind = kind_of(payload)
        if kind is None or kind not in PARTICIPANT_KINDS:
            raise ValueError(f"a participant does not send {payload.get('kind')!s:.32}")
        array_field = _ARRAY_FIELD.get(kind)
        content[PREFIX + kind.value] = ConfigRecord(_fields_to_config(payload, skip=array_field))
        if array_field is not None:
            content[f"{PREFIX}{kind.value}.{array_field}"] = arrays_to_record(payload[array_field])
    content[METRICS] = MetricRecord(dict(metrics))
    return content


def is_lensemble_reply(content: RecordDict) -> bool:
    """True if the reply came from a lensemble participant (not a stock ClientApp)."""
    config_records = records_of(content, ConfigRecord)
    return any(PREFIX + kind.value in config_records for kind in _REPLY_KINDS)


def claimed_sender(content: RecordDict) -> str | None:
    """The sender a lensemble participant's reply names (its first payload's), or None."""
    config_records = records_of(content, ConfigRecord)
    for kind in _REPLY_KINDS:
        record = config_records.get(PREFIX + kind.value)
        if record is not None:
            sender = record.get("sender")
            return sender if isinstance(sender, str) else None
    return None


def decode_reply(content: RecordDict) -> list[dict[str, Any]]:
    """A lensemble participant's payloads, in protocol order (commitment, then update)."""
    payloads = []
    config_records = records_of(content, ConfigRecord)
    array_records = records_of(content, ArrayRecord)
    for kind in _REPLY_KINDS:
        record = config_records.get(PREFIX + kind.value)
        if record is None:
            continue
        fields = _config_to_fields(record)
        array_field = _ARRAY_FIELD.get(kind)
        if array_field is not None:
            arrays = array_records.get(f"{PREFIX}{kind.value}.{array_field}")
            fields[array_field] = record_to_arrays(arrays) if arrays is not None else None
        payloads.append(fields)
    return payloads


def stock_reply(
    content: RecordDict, weight_key: str = "num-examples"
) -> tuple[dict[str, np.ndarray], int, dict[str, float]] | None:
    """(arrays, example count, metrics) of a stock Message-API train reply, or None; the
    count is the metric ``weight_key`` (FedAvg's ``weighted_by_key``)."""
    array_records = records_of(content, ArrayRecord)
    arrays = array_records.get(ARRAYS)
    if arrays is None and len(array_records) == 1:
        arrays = next(iter(array_records.values()))
    metric_records = list(records_of(content, MetricRecord).values())
    if arrays is None or len(metric_records) != 1:
        return None
    metrics = dict(metric_records[0])
    count = metrics.get(weight_key)
    if not isinstance(count, (int, float)) or count < 1:
        return None
    scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    return record_to_arrays(arrays), int(count), scalars
