"""When a Flower node's reply makes it the participant it names.

A reply names its sender in its messages; the SuperLink only says which node it came
from. A node becomes the participant it names when its reply proves the name: the
reply's first message (its Commitment when it sends one) passes the coordinator's
signature check for that name (the key the allow-list or an earlier Commitment
registered, or the key a first Commitment registers; unsigned only where the name has no
key and no signature is required). A claim that is not proven binds nothing: the node
keeps its address, and what it sent in the claimed name is the coordinator's to reject.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from flwr.app import RecordDict

from lensemble_flwr.protocol.messages import WirePayload
from lensemble_flwr.strategies import records
from lensemble_flwr.strategies.node_names import NodeNames

log = logging.getLogger("lensemble_flwr.strategies.grid_transport")


def claim_proven(
    content: RecordDict,
    source: str,
    claimed: str,
    proves_name: Callable[[WirePayload], bool] | None,
    logged: set[tuple[str, str]],
) -> bool:
    """Whether the reply ``content`` of the node ``source`` proves the name ``claimed``
    (``proves_name``: the coordinator's check of one payload; None: every claim is
    taken). A claim that is not proven is logged once per node and name (``logged``
    remembers those already logged)."""
    if proves_name is None:
        return True
    payloads = records.decode_reply(content)
    if payloads and proves_name(payloads[0]):
        return True
    if (source, claimed) not in logged:
        logged.add((source, claimed))
        log.warning(
            "%s names itself %s and cannot sign for that name: not bound to it; its "
            "messages in that name are rejected as forged",
            source,
            claimed,
        )
    return False


def bind_claim(
    names: NodeNames,
    source: str,
    claimed: str,
    *,
    connected: Collection[int],
    allowed: Collection[str] | None,
    on_rename: Callable[[str, str], bool] | None,
) -> bool:
    """Bind the node addressed as ``source`` to the name ``claimed`` it proved; True when
    this renamed it (``on_rename`` was told, and agreed).

    Raises:
        ValueError: the name is not the node's to take (:meth:`NodeNames.learn`), or
            ``on_rename`` refused it (the node answered this attempt under its old name
            already): nothing is bound.
    """
    node = names.node_of(source)
    address = names.learn(node, claimed, connected=connected, allowed=allowed)
    if address is None:
        return False
    if on_rename is not None and not on_rename(address, claimed):
        names.forget(node)
        raise ValueError(f"{address} answered already; it cannot be {claimed}")
    return True
