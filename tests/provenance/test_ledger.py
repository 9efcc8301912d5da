"""The ledger's records and chain (provenance/ledger.py): sealing, appending in order,
claiming each round once, and parsing stored documents into typed errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.errors import LedgerError
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import (
    GENESIS,
    ContributionRecord,
    Ledger,
    RoundEntry,
    RunManifest,
    UnreadableDocument,
    ledger_name,
    manifest_entry_name,
    parse_document,
)


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _record(round: int, previous: str, **changes: object) -> ContributionRecord:
    fields: dict[str, object] = {
        "round": round,
        "attempt": 1,
        "invited": ("p0",),
        "contributors": ("p0",),
        "count": 1,
        "total_weight": 3,
        "dataset_roots": {"p0": None},
        "update_digests": {"p0": _hash(f"u{round}")},
        "aggregate_digest": _hash(f"a{round}"),
        "previous_global_hash": _hash(f"g{round - 1}"),
        "new_global_hash": _hash(f"g{round}"),
        "checkpoint": _hash(f"c{round}"),
        "round_seed": round,
        "header_digest": _hash("header"),
        "entries_digest": _hash(f"e{round}"),
        "registry_digest": None,
        "previous_record_hash": previous,
    }
    fields.update(changes)
    return ContributionRecord(**fields)  # type: ignore[arg-type]


def test_a_sealed_record_hashes_every_field_but_its_own_hash() -> None:
    sealed = _record(1, GENESIS).sealed()
    assert sealed.record_hash == sealed.expected_hash() != ""
    assert _record(1, GENESIS, round_seed=9).sealed().record_hash != sealed.record_hash
    assert sealed.model_copy(update={"record_hash": "x"}).expected_hash() == sealed.record_hash


def test_records_chain_in_round_order_and_each_round_is_claimed_once(tmp_path: Path) -> None:
    store = Store(tmp_path)
    ledger = Ledger(store)
    assert ledger.head() is None and ledger.records() == []
    first = ledger.append(_record(1, GENESIS))
    second = ledger.append(_record(2, first.record_hash))
    assert [r.round for r in Ledger(store).records()] == [1, 2]
    assert Ledger(store).head() == second  # read back from the store
    assert store.bound("ledger") == [ledger_name(1), ledger_name(2)] == [
        "ledger/00000001",
        "ledger/00000002",
    ]
    with pytest.raises(LedgerError, match="does not follow the ledger head"):
        ledger.append(_record(3, GENESIS))  # not linked to the head
    with pytest.raises(LedgerError, match="does not follow the ledger head"):
        ledger.append(_record(4, second.record_hash))  # a round skipped
    stale = Ledger(store, head=first)  # a writer that missed round 2
    with pytest.raises(LedgerError, match="round 2 is already recorded"):
        stale.append(_record(2, first.record_hash, round_seed=7))
    assert Ledger(store).head() == second  # nothing changed


def test_a_manifest_records_each_attempt_once(tmp_path: Path) -> None:
    store = Store(tmp_path)
    manifest = RunManifest(
        run_id="r",
        config={},
        root_seed=1,
        initial_params_hash=_hash("g0"),
        initial_checkpoint=_hash("c0"),
    )
    manifest.start(store)
    with pytest.raises(LedgerError, match="already holds a run manifest"):
        manifest.start(store)
    entry = RoundEntry(
        round=1, attempt=1, state=RoundState.ABORTED, round_seed=1, prior_global_hash=_hash("g0")
    )
    manifest = manifest.with_round(store, entry)
    with pytest.raises(LedgerError, match="round 1 attempt 1 is already recorded"):
        manifest.with_round(store, entry)
    assert RunManifest.load(store) == manifest
    assert RunManifest.entry(store, 1, 1) == entry and RunManifest.entry(store, 1, 2) is None
    assert manifest_entry_name(1, 2) == "manifest/rounds/00000001-0002"


@pytest.mark.parametrize(
    ("data", "detail"),
    [
        (b"not json", "document: "),
        (canonical_json({"round": 1}), "attempt: Field required"),
        (b"\xff\xfe", "document: "),
    ],
)
def test_a_document_that_does_not_parse_is_a_typed_error(data: bytes, detail: str) -> None:
    with pytest.raises(UnreadableDocument, match="ledger/00000001 does not parse") as caught:
        parse_document(RoundEntry, data, "ledger/00000001")
    assert caught.value.what == "ledger/00000001"
    assert caught.value.detail.startswith(detail)
    assert isinstance(caught.value, LedgerError)
