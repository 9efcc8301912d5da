"""Attacks on the shared-folder mode by anyone who can write the folder (every participant
must): records and outcomes are signed by their authors and checked by every reader
(issue 12, §5). Each test reproduces what worked before and shows it now fails."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from shared_folder_worker import identities_of, identity_of

from lensemble_flwr.errors import ConfigError, ForgedMessage, LedgerError
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.shared_folder.barrier import SittingKey
from lensemble_flwr.shared_folder.records import (
    FolderRecord,
    Outcome,
    decode_genesis,
    encode,
    encode_record,
)
from lensemble_flwr.shared_folder.signed import document_body, sign_document
from tests.shared_folder.test_runner import node, store_of, together, when

OUTSIDER = IdentityKey.generate()  # can write the folder, is no participant


def test_a_forged_final_outcome_leads_nobody_off_the_ledger(tmp_path: Path) -> None:
    """A forged outcome used to make every process leave with a global state that is not
    in the ledger (and verify passed). Unsigned, or signed by an outsider: every reader
    refuses it. Signed by a participant (it decided, and lied): every reader checks the
    closed state against the ledger and refuses it."""
    n0, n1 = node(tmp_path, "p00"), node(tmp_path, "p01")
    together([n0, n1], 1)
    store = store_of(tmp_path)
    head = Ledger(store).head()
    assert head is not None
    lie = Outcome(
        run_id="run",
        round=2,
        sitting=1,
        state=RoundState.CLOSED,
        decided_by="p00",
        contributors=("p00", "p01"),
        global_hash="ab" * 32,
    )
    place = "run/barrier/00000002.001/outcome"
    store.claim("barrier/00000002.001/decision", store.put(b"p00"))
    for forged, error, match in [
        (encode(lie), ForgedMessage, "unreadable"),
        (sign_document(OUTSIDER, "p00", place, encode(lie)), ForgedMessage, "not signed by p00"),
        (sign_document(OUTSIDER, "eve", place, encode(lie)), ForgedMessage, "not a participant"),
        (sign_document(identity_of("p00"), "p00", place, encode(lie)), LedgerError, "ledger"),
    ]:
        (store.root / "names" / "barrier" / "00000002.001" / "outcome").unlink(missing_ok=True)
        store.claim("barrier/00000002.001/outcome", store.put(forged))
        for participant in ("p00", "p01"):
            with pytest.raises(error, match=match):
                node(tmp_path, participant).run(2)
    assert [r.round for r in verify(store)] == [1]  # nobody left round 2 on the lie


def test_a_forged_record_in_another_participants_name_is_refused_loudly(
    tmp_path: Path, caplog: Any
) -> None:
    """A record deposited in p01's slot by somebody else used to be admitted under p01's
    name. Unsigned, signed by an outsider, or signed by p00 for p01's slot: refused, with
    an ERROR naming the slot and the claimed author; the round goes on without it."""
    n0, n1 = node(tmp_path, "p00"), node(tmp_path, "p01")
    store = store_of(tmp_path)
    with ThreadPoolExecutor(1) as pool, caplog.at_level(logging.ERROR):
        running = pool.submit(n0.run, 1)
        when(lambda: bool(store.bound("barrier/genesis")))
        genesis = decode_genesis(document_body(store.get(store.resolve("barrier/genesis"))))
        record = n1.answer(genesis.first)  # what p01 would say
        place = "run/barrier/00000001.001/record/p01"
        forged = sign_document(identity_of("p00"), "p00", place, encode_record(record))
        n0.barrier.deposit(SittingKey(1, 1), "p01", forged)
        running.result()
    assert [r.contributors for r in verify(store)] == [("p00",)]
    assert "REFUSED the record in the slot of p01" in caplog.text
    assert "the slot of p01 holds a document by p00" in caplog.text


def test_a_signed_record_that_speaks_for_another_participant_is_left_out(
    tmp_path: Path, caplog: Any
) -> None:
    """p00 signs, for its own slot, a record that also carries messages relabelled as p01's:
    the record speaks for somebody other than its author, so it is left out entirely (and
    the relabelled messages keep p00's signatures, which the coordinator, running with the
    allow-list, would refuse as p01's)."""
    n0, n1 = node(tmp_path, "p00"), node(tmp_path, "p01")
    store = store_of(tmp_path)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(n1.run, 1)
        when(lambda: bool(store.bound("barrier/genesis")))
        genesis = decode_genesis(document_body(store.get(store.resolve("barrier/genesis"))))
        mine = n0.answer(genesis.first)
        as_p01 = tuple(
            {**p, "sender": "p01", "participant_id": "p01"} for p in mine.payloads
        )  # keeps p00's signatures, which do not verify for p01
        crafted = FolderRecord("run", 1, 1, "p00", mine.num_examples, mine.payloads + as_p01)
        n0.barrier.deposit(SittingKey(1, 1), "p00", n0.seal_record(crafted))
        running.result()
    contributors = [r.contributors for r in verify(store)]
    assert contributors == [("p01",)]  # the record speaks for p01 too: left out entirely


def test_garbage_in_a_participants_own_slot_stops_it_loudly(tmp_path: Path) -> None:
    """Garbage written into p01's slot before p01 deposits used to exclude p01 quietly
    ('already deposited (a restart?)' at INFO). Now p01 refuses to go on, naming the slot,
    and the decider refuses the garbage."""
    n0, n1 = node(tmp_path, "p00", quorum=1, round_timeout=1.0), node(tmp_path, "p01")
    store = store_of(tmp_path)
    n0_start = ThreadPoolExecutor(1)
    try:
        running = n0_start.submit(n0.run, 1)
        when(lambda: bool(store.bound("barrier/genesis")))
        n0.barrier.deposit(SittingKey(1, 1), "p01", b"garbage, not a record")
        with pytest.raises(ForgedMessage, match="the slot of p01 holds a record it did not write"):
            n1.run(1)
        running.result()
    finally:
        n0_start.shutdown()
    assert [r.contributors for r in verify(store)] == [("p00",)]


def test_a_shared_folder_participant_needs_keys_or_an_explicit_opt_out(tmp_path: Path) -> None:
    args: dict[str, Any] = {"identity": None, "identities": None}
    with pytest.raises(ConfigError, match="authenticates nothing by itself"):
        node(tmp_path, "p00", **args)
    with pytest.raises(ConfigError, match="exactly the participants"):
        node(tmp_path, "p00", identities=identities_of(["p00"]))
    with pytest.raises(ConfigError, match="p00's private key"):
        node(tmp_path, "p00", identity=IdentityKey.generate())
    with pytest.raises(ConfigError, match=r"identities\[p01\]"):
        node(tmp_path, "p00", identities={**identities_of(["p00", "p01"]), "p01": "junk"})
    node(tmp_path, "p00", unauthenticated=True, **args)  # accepted, with a warning
