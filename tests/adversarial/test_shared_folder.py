"""Attacks on the shared-folder mode by anyone who can write the folder (every participant
must): records and outcomes are signed by their authors and checked by every reader
(issue 12, §5). Each test reproduces what worked before and shows it now fails."""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from shared_folder_worker import identities_of, identity_of

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint, encode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json, derive_seed, digest_arrays
from lensemble_flwr.cli import main as cli_main
from lensemble_flwr.cli.output import EXIT_FAILED
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import ConfigError, ForgedMessage, LedgerError
from lensemble_flwr.identity.endorsement import endorse, verify_run
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import (
    ContributionRecord,
    Ledger,
    RoundEntry,
    RunManifest,
    entries_digest,
    header_digest,
)
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.shared_folder.barrier import SittingKey
from lensemble_flwr.shared_folder.decision import SittingDecider
from lensemble_flwr.shared_folder.records import (
    FolderRecord,
    Outcome,
    decode_genesis,
    encode,
    encode_record,
)
from lensemble_flwr.shared_folder.signed import document_body, sign_document
from tests.shared_folder.test_runner import folder_config, node, store_of, together, when

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


def claim_next_round(store: Store) -> ContributionRecord:
    """What a process with no identity key but write access to the folder can do once a
    round's records are deposited: claim the round's manifest entry, ledger record and
    checkpoint before its decider, all consistent with each other and with the chain (a
    model of its choosing, the round listed as closed by the same participants)."""
    manifest, head = RunManifest.load(store), Ledger(store).head()
    assert head is not None
    real = decode_checkpoint(store.get(head.checkpoint))
    t = head.round + 1
    params = {n: a + 1.0 for n, a in real.params.items()}
    new_hash = digest_arrays(params, "params")
    digests = {p: "ab" * 32 for p in head.contributors}
    entry = RoundEntry(
        round=t, attempt=1, state=RoundState.CLOSED,
        round_seed=derive_seed(manifest.root_seed, "round", t),
        prior_global_hash=head.new_global_hash, contributors=head.contributors,
        count=head.count, total_weight=head.total_weight, update_digests=digests,
        aggregate_digest="cd" * 32, new_global_hash=new_hash, invited=head.contributors,
    )  # fmt: skip
    manifest.with_round(store, entry)
    return Ledger(store).append(
        ContributionRecord(
            round=t, attempt=1, invited=head.contributors, contributors=head.contributors,
            count=head.count, total_weight=head.total_weight,
            dataset_roots=head.dataset_roots, update_digests=digests,
            aggregate_digest="cd" * 32, previous_global_hash=head.new_global_hash,
            new_global_hash=new_hash,
            checkpoint=store.put(encode_checkpoint(t, params, real.momentum)),
            round_seed=entry.round_seed, header_digest=header_digest(manifest),
            entries_digest=entries_digest([entry]), registry_digest=head.registry_digest,
            previous_record_hash=head.record_hash,
        )
    )  # fmt: skip


def test_a_round_claimed_by_a_keyless_writer_is_refused_by_everyone_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 41: a writer with no identity key claimed round 2's record, manifest entry and
    checkpoint (consistent, resealed) while its participants waited for the decider. Every
    participant stopped with a LedgerError that did not say forged, verify passed with the
    forged model, and Coordinator.resume continued from it. The run is endorsed on write:
    nobody endorsed that record, and everyone who reads it says so, naming it."""
    together([node(tmp_path, "p00"), node(tmp_path, "p01")], 1)
    store = store_of(tmp_path)
    decide = SittingDecider.decide
    forged: list[ContributionRecord] = []

    def race(self: SittingDecider, announcement: Any, snapshot: Any) -> Any:
        if not forged:  # the records are deposited, the decision claimed: the forger wins
            forged.append(claim_next_round(self.store))
        return decide(self, announcement, snapshot)

    monkeypatch.setattr(SittingDecider, "decide", race)
    outcomes = together([node(tmp_path, "p00"), node(tmp_path, "p01")], 2)
    named = rf"round 2: ledger record {forged[0].record_hash[:12]}… is UNENDORSED.*FORGED"
    for outcome in outcomes:  # every participant stops, saying what and which
        assert isinstance(outcome, LedgerError)
        assert re.search(named, str(outcome)), outcome
    verify(store)  # every hash and link of the forgery holds: the chain cannot tell
    with pytest.raises(LedgerError, match=named):
        verify_run(store)
    with pytest.raises(LedgerError, match=named):
        Coordinator.resume(folder_config(min_participants=1), store=store)
    code = cli_main(["verify", str(store.root)])
    out = capsys.readouterr().out
    assert code == EXIT_FAILED and "BROKEN round 2: endorsements" in out
    assert cli_main(["show", str(store.root)]) == 0  # show reads; it says, and fails nothing
    shown = capsys.readouterr().out
    assert "round 1: endorsed by p00, p01" in shown
    assert "round 2: UNENDORSED: needs 1 of p00, p01, signed by nobody" in shown
    joiner = node(tmp_path, "p01").participant  # holds no RoundClose of round 2
    with pytest.raises(LedgerError, match=named):
        joiner.join(str(store.root))


def test_a_forged_endorsement_deposited_in_the_folder_stops_its_readers(tmp_path: Path) -> None:
    together([node(tmp_path, "p00"), node(tmp_path, "p01")], 1)
    store = store_of(tmp_path)
    head = Ledger(store).head()
    assert head is not None
    name = "endorsements/00000001/p01"
    store.bind(name, store.put(endorse(OUTSIDER, head.record_hash).encode()))
    with pytest.raises(ForgedMessage, match=f"{name}: not p01's endorsement of round 1"):
        node(tmp_path, "p00").run(1)
    with pytest.raises(LedgerError, match="round 1: FORGED endorsement: endorsements/00000001/p01"):
        verify_run(store)


def test_only_a_run_endorsed_on_write_asks_its_readers_for_endorsements(tmp_path: Path) -> None:
    """A run started before endorsements existed has none to show: a process walking past
    its published rounds reads them as before. One started now must show them."""
    together([node(tmp_path, "p00"), node(tmp_path, "p01")], 1)
    store = store_of(tmp_path)
    for name in store.bound("endorsements"):  # nobody's endorsement of round 1 is left
        (store.root / "names" / name).unlink()
    with pytest.raises(LedgerError, match=r"round 1: ledger record \w+… is UNENDORSED"):
        node(tmp_path, "p00").run(1)
    header = json.loads(store.get(store.resolve("manifest/header")))
    assert header.pop("endorsement") == "on-write"
    store.bind("manifest/header", store.put(canonical_json(header)))  # as an older version
    assert node(tmp_path, "p00").run(1).round == 1
