"""Which Flower node is which participant.

Flower names a node by a number the SuperLink assigns, which changes from run to run (on
the simulation engine too). A participant names itself by something that does not: its
``lensemble-id`` or ``partition-id`` node config, or its identity key (see
:func:`lensemble_flwr.clients.app.participant_name`). The coordinator can only address
nodes, so a node it has not heard from yet is ``node-<id>``; the first reply in which
the node names itself teaches :class:`NodeNames` the node's participant id, which is the
name from then on (the ledger, the manifest, seeds and samples all use it, so two runs
with the same config and data are the same run).

A name is the node's own claim; the SuperLink authenticates the node, not the name. A
name already held by another node is refused (first come, first named), and a node
cannot change its name. Where a name has a key (an allow-list, a key bound by a
commitment, or ``require-signatures``), the transport asks for a reply signed by it
before it teaches this class the name (:mod:`.name_claims`).
"""

from __future__ import annotations

from collections.abc import Collection

from lensemble_flwr.strategies.records import NODE_PREFIX, node_id_of, participant_id
from lensemble_flwr.transports.base import COORDINATOR


class NodeNames:
    """Participant ids of Flower nodes: ``node-<id>`` until a node names itself."""

    def __init__(self) -> None:
        self._by_node: dict[int, str] = {}
        self._by_name: dict[str, int] = {}

    def name_of(self, node_id: int) -> str:
        """The node's participant id (``node-<id>`` while it has not named itself)."""
        return self._by_node.get(node_id, participant_id(node_id))

    def node_of(self, name: str) -> int:
        """The Flower node id of a participant id.

        Raises:
            ValueError: neither a learnt name nor ``node-<id>``.
        """
        if name in self._by_name:
            return self._by_name[name]
        return node_id_of(name)

    def learn(
        self,
        node_id: int,
        claimed: str,
        *,
        connected: Collection[int] | None = None,
        allowed: Collection[str] | None = None,
    ) -> str | None:
        """The node says it is participant ``claimed``: returns the address it had before
        (``node-<id>``) when this names it, None when it already had this name.

        A name held by a node that is no longer ``connected`` moves to the claimant (a
        SuperNode that restarted gets a new Flower id). With ``allowed`` (the
        coordinator's identity allow-list), only its names may be claimed.

        Raises:
            ValueError: the node already has another name, the name is a connected
                node's, not allowed, or looks like a node address or the coordinator.
        """
        current = self.name_of(node_id)
        if claimed == current:
            return None
        if node_id in self._by_node:
            raise ValueError(f"node {node_id} is {current!r}, not {claimed!r}")
        if claimed.startswith(NODE_PREFIX) or claimed == COORDINATOR:
            raise ValueError(f"node {node_id} claims {claimed!r}, a name no node may take")
        if allowed is not None and claimed not in allowed:
            raise ValueError(f"node {node_id} claims {claimed!r}, which is not allow-listed")
        holder = self._by_name.get(claimed)
        if holder is not None:
            if connected is None or holder in connected:
                raise ValueError(f"node {node_id} claims {claimed!r}, node {holder}'s name")
            del self._by_node[holder]  # the holder is gone: its name is free again
        self._by_node[node_id] = claimed
        self._by_name[claimed] = node_id
        return current

    def forget(self, node_id: int) -> None:
        """Undo a node's name (the coordinator refused the rename)."""
        name = self._by_node.pop(node_id, None)
        if name is not None:
            self._by_name.pop(name, None)
