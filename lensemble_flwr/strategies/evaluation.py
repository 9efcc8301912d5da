"""Federated evaluation as FedAvg asks for it: who evaluates, and what they are sent.

:func:`evaluation_sample` is FedAvg's sample, drawn from a seed of the round;
:func:`evaluate_content` the instruction (the global arrays and the evaluation config,
with the round's RoundClose riding along as on a RoundOpen); :func:`usable_evaluations`
the replies that can be averaged, naming those that cannot (FedAvg would stop the run
on them; the round is committed already).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID

from lensemble_flwr.canonical import derive_seed, seeded_sample
from lensemble_flwr.protocol.messages import WirePayload
from lensemble_flwr.strategies import records
from lensemble_flwr.strategies.reporting import not_weighted

log = logging.getLogger(__name__)


def evaluation_sample(
    server_round: int, peers: Sequence[str], fraction: float, min_nodes: int, root_seed: int
) -> list[str]:
    """FedAvg's evaluation sample: ``max(int(N * fraction), min_nodes)`` of the N nodes
    (at most N; none at fraction 0), ranked by a SHA-256 of a seed of the round and each
    node's id."""
    if fraction <= 0 or not peers:
        return []
    count = min(len(peers), max(1, int(len(peers) * fraction), min_nodes))
    seed = derive_seed(root_seed, "evaluate", server_round)
    return seeded_sample(list(peers), count, seed, "evaluate-sample")


def evaluate_content(
    server_round: int,
    arrays: ArrayRecord,
    config: ConfigRecord | None,
    close: WirePayload | None,
    *,
    arrays_key: str,
    config_key: str,
) -> RecordDict:
    """An evaluate instruction's content: ``arrays`` and ``config`` under FedAvg's keys,
    the config holding ``server-round`` and the last RoundClose (if any)."""
    cfg = dict(config or {})
    cfg["server-round"] = server_round
    if close is not None:
        # rides along, as on RoundOpen (in the one config record Flower's mods expect)
        cfg.update(records.encode_close(close))
    return RecordDict({arrays_key: arrays, config_key: ConfigRecord(cfg)})


def usable_evaluations(
    server_round: int, replies: Iterable[Message], name_of: Callable[[int], str], key: str
) -> list[RecordDict]:
    """The contents of the evaluation replies that can be averaged by ``key``, in the
    nodes' order (not the replies' arrival order: with stable participant names, two runs
    of the same federation report the same metrics to the last bit); the others are
    named in one warning."""
    valid: list[tuple[str, RecordDict]] = []
    left_out: list[str] = []
    for reply in replies:
        source = reply.metadata.src_node_id
        node = "the SuperLink" if source == SUPERLINK_NODE_ID else name_of(source)
        if reply.has_error():
            reason = " ".join((reply.error.reason or "no reason given").split())
            cut = reason if len(reason) <= 200 else reason[:199] + "…"
            left_out.append(f"{node} (error {reply.error.code}: {cut})")
        elif (why := not_weighted(reply.content, key)) is not None:
            left_out.append(f"{node} ({why})")
        else:
            valid.append((node, reply.content))
    valid.sort(key=lambda named: named[0])
    say_left_out(server_round, left_out)
    return [content for _, content in valid]


def say_left_out(server_round: int, left_out: list[str]) -> None:
    """Warn, naming them (the first three), of the evaluation replies left out."""
    if not left_out:
        return
    more = f" and {len(left_out) - 3} more" if len(left_out) > 3 else ""
    log.warning(
        "round %d: %d evaluation repl%s left out of the aggregated metrics: %s%s",
        server_round,
        len(left_out),
        "y" if len(left_out) == 1 else "ies",
        "; ".join(left_out[:3]),
        more,
    )
