"""One round numbering wherever a user sees a round: Flower's (issue 13, item 12).

Round r (from 1) takes θ_{r-1} to θ_r. A run of two rounds through the strategy must say
rounds 1 and 2 in ``result``, in every log line, in Flower's ``server-round``, in the
ledger records and their store names, in the manifest entries, in the checkpoints the
records name and in ``lensemble-flwr show``; a 0-based round must be refused wherever one
could be written.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from flwr.app import ConfigRecord
from pydantic import ValidationError

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.cli import main as cli_main
from lensemble_flwr.protocol.messages import RoundOpen
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.audit import audit_run
from lensemble_flwr.provenance.ledger import LEDGER, MANIFEST_ROUNDS, RoundEntry, RunManifest
from lensemble_flwr.provenance.verify import verify as verify_run
from lensemble_flwr.shared_folder.barrier import SittingKey
from lensemble_flwr.simulations.toy import initial_params
from lensemble_flwr.strategies.records import arrays_to_record
from lensemble_flwr.testing import FaultPlan
from tests.strategies.test_grid_transport import _serverapp_identity  # noqa: F401  (autouse: the ServerApp identity)
from tests.strategies.test_lensemble import stock_loop_federation

ROUND_IN_TEXT = re.compile(r"\bround (\d+)\b|\[ROUND (\d+)/\d+\]", re.IGNORECASE)


def test_a_two_round_run_says_rounds_1_and_2_everywhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    strategy, grid = stock_loop_federation(tmp_path)
    with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger="flwr"):
        result = strategy.start(
            grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=2
        )
    assert sorted(result.train_metrics_clientapp) == [1, 2]

    # every round number in every log line, Flower's and the core's, is 1 or 2
    messages = [r.getMessage() for r in caplog.records]
    said = [int(a or b) for m in messages for a, b in ROUND_IN_TEXT.findall(m)]
    assert said and set(said) == {1, 2}, [m for m in messages if ROUND_IN_TEXT.search(m)]
    assert "[ROUND 1/2]" in messages and "[ROUND 2/2]" in messages
    assert any(m.startswith("\t├──> round 1: open→") for m in messages)  # lensemble's line

    # Flower's server-round is the round the instruction opens
    opened = [m.content["config"] for batch in grid.pushes for m in batch]
    assert sorted({(c["server-round"], c["lensemble.round"]) for c in opened}) == [(1, 1), (2, 2)]

    # the ledger, its store names, the checkpoints it names, the manifest
    store = Store(tmp_path / "run")
    records = verify_run(store)
    assert [r.round for r in records] == sorted(result.train_metrics_clientapp) == [1, 2]
    assert store.bound(LEDGER) == ["ledger/00000001", "ledger/00000002"]
    assert [decode_checkpoint(store.get(r.checkpoint)).round for r in records] == [1, 2]
    manifest = RunManifest.load(store)
    assert [(e.round, e.attempt, e.state) for e in manifest.rounds] == [
        (1, 1, RoundState.CLOSED),
        (2, 1, RoundState.CLOSED),
    ]
    assert store.bound(MANIFEST_ROUNDS) == [
        "manifest/rounds/00000001-0001",
        "manifest/rounds/00000002-0001",
    ]
    assert strategy.coordinator is not None
    assert strategy.coordinator.global_state().round == 2  # θ_2: two rounds closed
    assert strategy.coordinator.global_state().next_round == 3

    # what `lensemble-flwr show` prints, as JSON and as a table
    assert cli_main(["show", str(tmp_path / "run"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [a["round"] for a in shown["attempts"]] == [1, 2]
    assert cli_main(["show", str(tmp_path / "run")]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = [line.split("│")[1].strip() for line in table if line.startswith("│")]
    assert rows == ["1", "2"], table
    assert audit_run(tmp_path / "run").ok


def test_an_aborted_attempt_is_logged_and_recorded_with_its_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy, grid = stock_loop_federation(tmp_path)
    arrays = arrays_to_record(initial_params())
    with caplog.at_level(logging.INFO):
        messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
        strategy.aggregate_train(1, grid.send_and_receive(messages[:2]))  # quorum is 3
    aborted = [r.getMessage() for r in caplog.records if "ABORTED" in r.getMessage()]
    assert aborted and all(m.startswith("round 1 attempt 1 ABORTED") for m in aborted)
    (entry,) = RunManifest.load(Store(tmp_path / "run")).rounds
    assert (entry.round, entry.attempt, entry.state) == (1, 1, RoundState.ABORTED)


def test_a_round_numbered_from_0_is_refused_where_it_could_be_written() -> None:
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        RoundEntry(round=0, attempt=1, state=RoundState.CLOSED, round_seed=0, prior_global_hash="")
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        RoundOpen.model_validate({"run_id": "r", "round": 0, "sender": "c"})
    with pytest.raises(ValueError, match="no sitting 1 of round 0"):
        SittingKey(0, 1)
    with pytest.raises(ValueError, match="numbered from 1"):
        FaultPlan().drop("p00", round=0, at=RoundState.OPEN)
