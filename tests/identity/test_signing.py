"""Signed participant messages: forged, replayed and duplicated updates are rejected at
ingress with their typed error, never admitted, and the round goes on without them."""

from __future__ import annotations

import logging
from pathlib import Path

import federation_helpers
import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from federation_helpers import small_config

from lensemble_flwr.errors import ConfigError, ForgedMessage
from lensemble_flwr.identity.signing import (
    IdentityKey,
    parse_public_key,
    verify_signature,
)
from lensemble_flwr.protocol.messages import (
    Commitment,
    MessageKind,
    Update,
    from_wire,
    to_wire,
)
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.testing import FaultPlan
from lensemble_flwr.transports.base import COORDINATOR

PIDS = ("p00", "p01", "p02", "p03")
KEYS = {pid: IdentityKey.generate() for pid in PIDS}


def signed_federation(tmp: Path, **kwargs):
    return federation_helpers.signed_federation(tmp, KEYS, **kwargs)


def capture(into: list[dict]):
    def keep(payload: dict) -> dict:
        into.append(dict(payload))
        return payload

    return keep


def test_a_signed_federation_registers_keys_and_closes_rounds(tmp_path: Path) -> None:
    coordinator, _, _ = signed_federation(tmp_path)
    coordinator.run(2)
    assert [o.count for o in coordinator.outcomes] == [4, 4]
    registered = {p: c.identity_key for p, c in coordinator.registry.commitments.items()}
    assert registered == {p: KEYS[p].public_openssh for p in PIDS}
    verify(coordinator.store)


def test_an_update_signed_by_someone_else_is_forged(tmp_path: Path, caplog) -> None:
    intruder = IdentityKey.generate()

    def resign(payload: dict) -> dict:  # p02's update, re-signed by a key that is not p02's
        msg = from_wire(payload)
        return dict(intruder.sign(msg, _seed(msg.round)))

    faults = FaultPlan().corrupt("p02", round=2, kind=MessageKind.UPDATE, mutate=resign)
    coordinator, _, _ = signed_federation(tmp_path, faults=faults)
    with caplog.at_level(logging.WARNING):
        coordinator.run(2)
    last = coordinator.outcomes[-1]
    assert last.contributors == ("p00", "p01", "p03") and last.rejected == 1
    assert "ForgedMessage" in caplog.text or "not signed by its registered" in caplog.text


def test_an_update_altered_in_flight_is_forged(tmp_path: Path) -> None:
    def scale(payload: dict) -> dict:
        payload["delta"] = {k: v * 2 for k, v in payload["delta"].items()}
        return payload

    faults = FaultPlan().corrupt("p01", round=1, kind=MessageKind.UPDATE, mutate=scale)
    coordinator, _, _ = signed_federation(tmp_path, faults=faults)
    coordinator.run(1)
    assert coordinator.outcomes[-1].contributors == ("p00", "p02", "p03")
    assert coordinator.outcomes[-1].rejected == 1


def test_a_replayed_update_is_refused_in_a_later_round(tmp_path: Path, caplog) -> None:
    seen: list[dict] = []
    faults = FaultPlan().corrupt("p01", round=1, kind=MessageKind.UPDATE, mutate=capture(seen))
    coordinator, network, _ = signed_federation(tmp_path, faults=faults)
    coordinator.run(1)
    assert coordinator.outcomes[-1].count == 4
    # the same bytes again during round 1, and a copy relabelled as round 1
    network.inject("p01", COORDINATOR, seen[0])
    network.inject("p01", COORDINATOR, {**seen[0], "round": 2})
    with caplog.at_level(logging.WARNING):
        coordinator.run(1)
    assert "(ReplayedMessage)" in caplog.text and "(ForgedMessage)" in caplog.text
    last = coordinator.outcomes[-1]
    assert last.rejected == 2 and last.count == 4  # p01's real round-1 update is admitted
    records = verify(coordinator.store)
    assert records[0].update_digests["p01"] != records[1].update_digests["p01"]


def test_an_update_sent_twice_in_one_round_counts_once(tmp_path: Path, caplog) -> None:
    faults = FaultPlan().duplicate("p03", round=1, kind=MessageKind.UPDATE)
    coordinator, network, _ = signed_federation(tmp_path, faults=faults)
    network.set_compute_time("p03", 0.1)  # so that both copies come before the others
    with caplog.at_level(logging.WARNING):
        coordinator.run(1)
    assert "(DuplicateMessage)" in caplog.text and "(ReplayedMessage)" not in caplog.text
    last = coordinator.outcomes[-1]
    assert last.count == 4 and last.rejected == 1
    assert verify(coordinator.store)[0].contributors == PIDS


def test_required_signatures_refuse_an_unsigned_participant(tmp_path: Path) -> None:
    config = small_config(require_signatures=True)
    coordinator, _, _ = signed_federation(tmp_path, config=config, unsigned=("p02",))
    coordinator.run(1)
    assert coordinator.outcomes[-1].contributors == ("p00", "p01", "p03")
    assert "p02" not in coordinator.registry.commitments  # its commitment was refused too


def test_an_allow_list_admits_only_listed_keys(tmp_path: Path) -> None:
    listed = {p: KEYS[p].public_openssh for p in ("p00", "p01", "p02")}
    listed["p02"] = IdentityKey.generate().public_openssh  # p02 signs with another key
    config = small_config(min_participants=2)
    coordinator, _, _ = signed_federation(tmp_path, config=config, identities=listed)
    coordinator.run(1)
    assert coordinator.outcomes[-1].contributors == ("p00", "p01")
    with pytest.raises(ConfigError, match=r"identities\[x\]"):
        signed_federation(tmp_path / "bad", identities={"x": "ssh-rsa AAAA"})


def test_a_registered_key_cannot_be_replaced(tmp_path: Path) -> None:
    coordinator, network, nodes = signed_federation(tmp_path)
    coordinator.run(1)
    intruder = IdentityKey.generate()
    claim = Commitment(
        run_id=coordinator.run_id,
        round=2,
        sender="p01",
        participant_id="p01",
        dataset_root=nodes[1].dataset_root,
        num_examples=nodes[1].training.num_examples(),
        identity_key=intruder.public_openssh,
    )
    network.inject("p01", COORDINATOR, to_wire(intruder.sign(claim, _seed(1))))
    nodes[1].identity = intruder  # and p01's own messages now come signed by that key
    coordinator.run(1)
    assert coordinator.registry.commitments["p01"].identity_key == KEYS["p01"].public_openssh
    assert coordinator.outcomes[-1].contributors == ("p00", "p02", "p03")
    assert coordinator.outcomes[-1].rejected == 2


def _seed(round: int) -> int:
    from lensemble_flwr.canonical import derive_seed

    return derive_seed(small_config().federation.root_seed, "round", round)


def test_signatures_bind_round_seed_and_key(tmp_path: Path) -> None:
    key = KEYS["p00"]
    update = Update(
        run_id="r",
        round=4,
        sender="p00",
        participant_id="p00",
        dataset_root=None,
        delta={"w": np.ones(2, np.float32)},
        l2_norm=1.0,
        num_examples=1,
    )
    signed = key.sign(update, 11)
    verify_signature(signed, key.public_openssh, 11)
    with pytest.raises(ForgedMessage, match="not signed"):
        verify_signature(signed, key.public_openssh, 12)  # another round seed
    with pytest.raises(ForgedMessage, match="not signed"):
        verify_signature(signed, KEYS["p01"].public_openssh, 11)
    with pytest.raises(ForgedMessage, match="unsigned"):
        verify_signature(update, key.public_openssh, 11)


def test_identity_keys_are_nist_ec_in_openssh_format(tmp_path: Path) -> None:
    key = IdentityKey.generate(ec.SECP384R1)
    path = tmp_path / "id_ecdsa"
    path.write_bytes(key.private_openssh())
    loaded = IdentityKey.load(path)
    assert loaded.public_openssh == key.public_openssh
    assert key.public_openssh.startswith("ecdsa-sha2-nistp384 ")
    ed = ed25519.Ed25519PrivateKey.generate()
    (tmp_path / "id_ed25519").write_bytes(
        ed.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(ForgedMessage):
        IdentityKey.load(tmp_path / "id_ed25519")
    ed_pub = ed.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    with pytest.raises(ForgedMessage, match="ECDSA"):
        parse_public_key(ed_pub.decode())
    with pytest.raises(ForgedMessage):
        IdentityKey(ec.generate_private_key(ec.SECP256K1()))  # not a NIST curve


def test_a_client_app_node_reads_its_identity_key_from_node_config(tmp_path: Path) -> None:
    from flwr.app import Context, RecordDict

    from lensemble_flwr.clients.app import identity_from_node_config

    path = tmp_path / "id_ecdsa"
    path.write_bytes(KEYS["p00"].private_openssh())

    def context(node_config: dict) -> Context:
        return Context(
            run_id=1, node_id=5, node_config=node_config, state=RecordDict(), run_config={}
        )

    key = identity_from_node_config(context({"identity-key": str(path)}))
    assert key is not None and key.public_openssh == KEYS["p00"].public_openssh
    assert identity_from_node_config(context({})) is None
    path.write_text("not a key")
    with pytest.raises(ForgedMessage):
        identity_from_node_config(context({"identity-key": str(path)}))
