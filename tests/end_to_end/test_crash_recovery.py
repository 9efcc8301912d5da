"""A coordinator killed with SIGKILL at any point of a round resumes from the last CLOSED one.

Every case runs the crash drill (``lensemble_flwr.simulations.crash_drill``) as a real
process that kills itself at the chosen point, inspects what it left in the run
directory, then restarts it with ``--resume`` and checks the finished run. The processes
are forked from a helper that imported the drill once (``crash_drill_zygote.py``): a
fork is a real process and dies of a real SIGKILL, without 3-7 s of imports each time.
One test starts the drill with ``python -m`` as an operator would.

tests/coordinator/test_recovery.py holds the in-process checks of ``Coordinator.resume``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lensemble_flwr.aggregation.fixed_point import FixedPointAggregator
from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.coordinator import durable
from lensemble_flwr.coordinator.coordinator import INTERRUPTED, WRITES_PREPARED
from lensemble_flwr.errors import CheckpointIntegrityError, LedgerError
from lensemble_flwr.identity import registry_store
from lensemble_flwr.protocol.round import RoundMachine, RoundState
from lensemble_flwr.provenance.ledger import RunManifest
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.secagg.aggregator import SecureAggregator
from lensemble_flwr.simulations import crash_drill
from lensemble_flwr.simulations.kill_points import KILL_POINTS, KILL_POINTS_BY_NAME

ROUNDS = 4
SIGKILLED = -9
ZYGOTE = Path(__file__).resolve().parents[1] / "helpers" / "crash_drill_zygote.py"


@dataclasses.dataclass(frozen=True)
class Case:
    """One drill: where the first process dies, and how the federation is set up."""

    point: str
    round: int
    secagg_threshold: int = 0
    drops: tuple[str, ...] = ()  # --drop PID:ROUND:STATE of the killed process

    @property
    def id(self) -> str:
        masked = "-masked" if self.secagg_threshold else ""
        return f"{self.point}@{self.round}{masked}"

    def options(self) -> list[str]:
        return ["--secagg-threshold", str(self.secagg_threshold)]


# Round 2 or 3 of 4 for every kill point, and a few places that are special: round 1
# (nobody is bound yet), and a masked round whose dropped member's key was revealed.
CASES = [
    Case("open", 2),
    Case("collecting", 3),
    Case("mid-collecting", 2),
    Case("aggregating", 2),
    Case("aligning", 3),
    Case("committing", 2),
    Case("checkpoint-write", 3),
    Case("closed", 2),
    Case("closed", 4),  # the last round: the restart has nothing left to run
    Case("aborted", 2, drops=("p01:2:open", "p02:2:open")),
    Case("collecting", 1),
    Case("aligning", 2, secagg_threshold=3, drops=("p03:2:collecting",)),
    Case("closed", 3, secagg_threshold=3),
]


@dataclasses.dataclass
class Drill:
    """A drill's run directory, and the evidence gathered before and after the restart."""

    case: Case
    run_dir: Path
    killed: dict[str, Any]
    ledger_at_kill: dict[str, bytes]
    registry_at_kill: tuple[dict[str, Any], dict[str, Any]]
    verify_at_kill: Exception | int
    tmp_at_kill: list[Path]
    blobs_at_kill: set[str]
    visible_at_kill: list[str]
    resumed: dict[str, Any]


Runner = Callable[..., int | None]


@pytest.fixture(scope="module")
def run_drill() -> Iterator[Runner]:
    """Run the drill in a fresh process; returns its exit status (-9: SIGKILL)."""
    zygote = subprocess.Popen(
        [sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert zygote.stdin is not None and zygote.stdout is not None

    def run(run_dir: Path, *args: str, report: Path, log: Path, timeout: float = 120) -> int | None:
        argv = ["--run-dir", str(run_dir), "--rounds", str(ROUNDS), "--report", str(report)]
        request = {"argv": [*argv, *args], "log": str(log), "timeout": timeout}
        zygote.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        zygote.stdin.flush()  # type: ignore[union-attr]
        answer = zygote.stdout.readline()  # type: ignore[union-attr]
        assert answer, f"the drill helper died (exit {zygote.poll()})"
        return json.loads(answer)["returncode"]

    yield run
    zygote.stdin.close()
    try:
        zygote.wait(timeout=30)
    except subprocess.TimeoutExpired:
        zygote.kill()
        zygote.wait()


@pytest.fixture(scope="module")
def straight(run_drill: Runner, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same federation without a crash (plaintext): what a resumed run is compared to."""
    base = tmp_path_factory.mktemp("straight")
    code = run_drill(base / "run", report=base / "report.json", log=base / "log")
    assert code == 0, (base / "log").read_text()
    return {
        "report": json.loads((base / "report.json").read_text()),
        "manifest": RunManifest.load(Store(base / "run")),
    }


@pytest.fixture(scope="module")
def drill(run_drill: Runner, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Case], Drill]:
    """Kill, inspect, resume, once per case (several tests look at the same drill)."""
    drills: dict[Case, Drill] = {}

    def get(case: Case) -> Drill:
        if case not in drills:
            drills[case] = _run_case(run_drill, tmp_path_factory.mktemp(case.id), case)
        return drills[case]

    return get


def _run_case(run_drill: Runner, base: Path, case: Case) -> Drill:
    run_dir = base / "run"
    drops = [arg for spec in case.drops for arg in ("--drop", spec)]
    kill = ["--kill-at", f"{case.round}:{case.point}"]
    code = run_drill(
        run_dir, *case.options(), *drops, *kill, report=base / "kill.json", log=base / "kill.log"
    )
    assert code == SIGKILLED, f"exit {code}: {(base / 'kill.log').read_text()}"
    store = Store(run_dir)
    try:
        verified: Exception | int = len(verify(store))
    except LedgerError as exc:
        verified = exc
    commitments, membership = registry_store.load_registry(store)
    evidence = {
        "killed": json.loads((base / "kill.json").read_text()),
        "ledger_at_kill": ledger_bytes(store),
        "registry_at_kill": (
            {p: c.model_dump() for p, c in commitments.items()},
            membership.snapshot(),
        ),
        "verify_at_kill": verified,
        "tmp_at_kill": sorted((run_dir / "tmp").iterdir()),
        "blobs_at_kill": {p.name for p in (run_dir / "blobs").rglob("*") if p.is_file()},
        "visible_at_kill": partial_files(run_dir),
    }
    code = run_drill(
        run_dir, *case.options(), "--resume", report=base / "resume.json", log=base / "resume.log"
    )
    assert code == 0, f"exit {code}: {(base / 'resume.log').read_text()}"
    resumed = json.loads((base / "resume.json").read_text())
    return Drill(case=case, run_dir=run_dir, resumed=resumed, **evidence)


def ledger_bytes(store: Store) -> dict[str, bytes]:
    """Every ledger name with the bytes of the record it names."""
    return {name: store.get(store.resolve(name)) for name in store.bound("ledger")}


def partial_files(run_dir: Path) -> list[str]:
    """Files under blobs/ or names/ that are not a complete, published write."""
    bad = []
    for path in (run_dir / "blobs").rglob("*"):
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if path.name != digest or path.parent.name != digest[:2]:
                bad.append(str(path))
    for path in (run_dir / "names").rglob("*"):
        if path.is_file():
            text = path.read_text("ascii", errors="replace")
            blob = run_dir / "blobs" / text[:2] / text.strip()
            if not re.fullmatch(r"[0-9a-f]{64}\n", text) or not blob.is_file():
                bad.append(str(path))
    return bad


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_killed_coordinator_resumes_from_the_last_closed_round(
    case: Case, drill: Callable[[Case], Drill]
) -> None:
    d = drill(case)
    point, t = KILL_POINTS_BY_NAME[case.point], case.round
    assert (d.killed["round"], d.killed["point"], d.killed["attempt"]) == (t, case.point, 1)

    # at the kill: the committed rounds, and the killed round only if its record was claimed
    committed = list(range(1, t + 1 if point.committed else t))  # rounds from 1
    assert [json.loads(b)["round"] for b in d.ledger_at_kill.values()] == committed
    assert d.visible_at_kill == []  # nothing half-written under blobs/ or names/
    if point.committed:  # the commit is complete in the ledger, the manifest lags behind
        assert isinstance(d.verify_at_kill, LedgerError)
        assert str(d.verify_at_kill) == (
            f"manifest closed rounds {list(range(1, t))} differ from ledger rounds {committed}"
        )
    else:
        assert d.verify_at_kill == t - 1, d.verify_at_kill  # rounds 1 … t - 1
    # besides what a write cut short left, tmp/ holds only the empty temp files the
    # coordinator had made ahead of its next writes (Store.prepare_writes)
    written = [p for p in d.tmp_at_kill if p.stat().st_size > 0]
    assert len(d.tmp_at_kill) - len(written) <= WRITES_PREPARED
    if case.point == "checkpoint-write":  # the kill came mid-write: half a checkpoint in tmp/
        (partial,) = written
        assert partial.stat().st_size == d.killed["written"] == d.killed["size"] // 2
        with pytest.raises(CheckpointIntegrityError):
            decode_checkpoint(partial.read_bytes())
        assert d.killed["blob"] not in d.blobs_at_kill  # the checkpoint was never published
    else:
        assert written == []

    # after the restart: every round CLOSED, nothing committed before the kill lost
    store = Store(d.run_dir)
    records = verify(store)
    assert [r.round for r in records] == list(range(1, ROUNDS + 1))
    after = ledger_bytes(store)
    assert {name: after[name] for name in d.ledger_at_kill} == d.ledger_at_kill
    assert partial_files(d.run_dir) == []
    manifest = RunManifest.load(store)
    assert [(e.round, e.attempt) for e in manifest.rounds if e.state is RoundState.CLOSED] == [
        (r.round, r.attempt) for r in records
    ]
    killed_round = [(e.attempt, e.state, e.reason) for e in manifest.rounds if e.round == t]
    if point.committed:  # completed from the ledger record, not run again
        assert killed_round == [(1, RoundState.CLOSED, None)]
        assert durable.started_attempts(store, t) == [1]
    else:  # recorded as interrupted, retried under the next attempt number
        assert killed_round == [(1, RoundState.ABORTED, INTERRUPTED), (2, RoundState.CLOSED, None)]
        assert durable.started_attempts(store, t) == [1, 2]
    others = [e for e in manifest.rounds if e.round != t]
    assert all(e.state is RoundState.CLOSED and e.attempt == 1 for e in others)
    assert d.resumed["closed_rounds"] == ROUNDS
    assert d.resumed["global_hash"] == records[-1].new_global_hash


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.point in ("open", "closed") and not c.secagg_threshold],
    ids=lambda c: c.id,
)
def test_a_restart_before_any_update_changes_nothing_the_run_computes(
    case: Case, drill: Callable[[Case], Drill], straight: dict[str, Any]
) -> None:
    """Killed before a participant trained in the attempt (open) or after the commit
    (closed), the resumed run ends in exactly the uninterrupted run's global state."""
    d = drill(case)
    assert d.resumed["global_hash"] == straight["report"]["global_hash"]


def test_participants_keys_and_the_spent_keys_survive_a_kill_in_a_masked_round(
    drill: Callable[[Case], Drill],
) -> None:
    """Round 2 of a masked run: p03 drops mid-round, the survivors are unmasked around it
    (they disclose their round-2 seeds with it), and the coordinator dies at ALIGNING.
    The restarted coordinator still knows every commitment and the next mask keys the
    survivors announced with their updates; p03's key was spent when it was listed, so
    it commits a fresh one before it is a member again; every key masks once."""
    case = next(c for c in CASES if c.secagg_threshold and c.point == "aligning")
    d = drill(case)
    commitments, membership = d.registry_at_kill
    assert sorted(commitments) == ["p00", "p01", "p02", "p03"]
    assert all(c["mask_key"] and c["enc_key"] for c in commitments.values())
    assert sorted(membership["mask_keys"]) == ["p00", "p01", "p02"]  # p03's is spent

    store = Store(d.run_dir)
    now, membership_now = registry_store.load_registry(store)
    for pid in ("p00", "p01", "p02"):  # never committed again: they announced with updates
        assert now[pid].model_dump() == commitments[pid]
    assert now["p03"].mask_key != commitments["p03"]["mask_key"]  # a fresh commitment
    assert not set(membership_now.mask_keys.values()) & set(membership["mask_keys"].values())
    closed = [e for e in RunManifest.load(store).rounds if e.state is RoundState.CLOSED]
    assert all(e.secure_sum for e in closed[1:])
    assert [e.count for e in closed] == [4, 4, 4, 4]  # p03 is back, with its new key


def test_a_coordinator_killed_twice_in_one_round_resumes_twice(
    run_drill: Runner, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"

    def run(*args: str) -> int | None:
        return run_drill(run_dir, *args, report=tmp_path / "r.json", log=tmp_path / "log")

    assert run("--kill-at", "2:aggregating") == SIGKILLED
    assert run("--resume", "--kill-at", "2:committing") == SIGKILLED
    killed = json.loads((tmp_path / "r.json").read_text())
    assert (killed["attempt"], killed["point"]) == (2, "committing")
    assert run("--resume") == 0
    store = Store(run_dir)
    assert [r.round for r in verify(store)] == [1, 2, 3, 4]
    assert [
        (e.attempt, e.state, e.reason) for e in RunManifest.load(store).rounds if e.round == 2
    ] == [
        (1, RoundState.ABORTED, INTERRUPTED),
        (2, RoundState.ABORTED, INTERRUPTED),
        (3, RoundState.CLOSED, None),
    ]


def test_the_drill_reports_a_kill_point_it_never_reached(run_drill: Runner, tmp_path: Path) -> None:
    """No abort happens in a round without faults: asking to die at ABORTED is reported,
    not silently passed."""
    code = run_drill(
        tmp_path / "run", "--kill-at", "2:aborted", report=tmp_path / "r.json", log=tmp_path / "log"
    )
    assert code == crash_drill.NOT_REACHED
    assert json.loads((tmp_path / "r.json").read_text())["outcome"] == "kill point not reached"


def test_resume_refuses_a_config_the_run_was_not_started_with(
    run_drill: Runner, tmp_path: Path
) -> None:
    def run(*args: str) -> int | None:
        return run_drill(tmp_path / "run", *args, report=tmp_path / "r.json", log=tmp_path / "log")

    assert run("--kill-at", "2:collecting") == SIGKILLED
    assert run("--resume", "--secagg-threshold", "3") == 2
    assert "ConfigError" in (tmp_path / "log").read_text()
    assert [r.round for r in verify(Store(tmp_path / "run"))] == [1]  # untouched


@pytest.mark.parametrize(
    "argv",
    [
        ["--kill-at", "1:nowhere"],
        ["--kill-at", "one:open"],
        ["--kill-at", "5:open"],  # not one of rounds 1 … 4
        ["--kill-at", "0:open"],  # rounds are numbered from 1
        ["--drop", "p01:2:aggregating"],
        ["--rejoin", "p01"],
        ["--participants", "0"],
    ],
)
def test_the_drill_refuses_malformed_options(argv: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        crash_drill.main(["--run-dir", str(run_dir), "--rounds", "4", *argv])
    assert exc.value.code == 2
    assert not any(tmp_path.iterdir())  # neither the run nor the participants' folder


def test_an_unknown_kill_point_is_refused_before_anything_is_hooked(tmp_path: Path) -> None:
    def hooks() -> tuple[object, ...]:
        admits = (FixedPointAggregator.admit, SecureAggregator.admit)
        return (RoundMachine.__init__, RoundMachine.fire, *admits)

    before = hooks()
    with pytest.raises(ValueError, match="unknown kill point 'nowhere'"):
        crash_drill.install_kill(tmp_path, 0, "nowhere")
    assert hooks() == before
    assert not any(tmp_path.iterdir())  # nor is anything written


def test_the_drill_runs_as_python_dash_m(run_drill: Runner, tmp_path: Path) -> None:
    """The operator's way in: ``python -m`` dies of SIGKILL and the run resumes."""
    run_dir = tmp_path / "run"
    killed = subprocess.run(
        [
            sys.executable,
            "-m",
            "lensemble_flwr.simulations.crash_drill",
            "--run-dir",
            str(run_dir),
            "--rounds",
            str(ROUNDS),
            "--kill-at",
            "3:checkpoint-write",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert killed.returncode == SIGKILLED, killed.stderr
    assert "SIGKILL in round 3 attempt 1 at checkpoint-write" in killed.stderr
    assert run_drill(run_dir, "--resume", report=tmp_path / "r.json", log=tmp_path / "log") == 0
    assert [r.round for r in verify(Store(run_dir))] == [1, 2, 3, 4]


def test_every_kill_point_is_drilled() -> None:
    assert {c.point for c in CASES} == {p.name for p in KILL_POINTS}


@pytest.mark.parametrize("case", [c for c in CASES if c.point == "closed"], ids=lambda c: c.id)
def test_a_completed_commit_is_recorded_as_the_uninterrupted_run_records_it(
    case: Case, drill: Callable[[Case], Drill], straight: dict[str, Any]
) -> None:
    d = drill(case)
    (entry,) = (e for e in RunManifest.load(Store(d.run_dir)).rounds if e.round == case.round)
    if case.secagg_threshold:  # the keys are random: compare what does not depend on them
        assert entry.secure_sum
        assert set(entry.diagnostics) == {"mean_delta_l2"}
    else:
        (expected,) = (e for e in straight["manifest"].rounds if e.round == case.round)
        assert entry == expected


def test_a_member_may_drop_out_of_the_retry_of_an_attempt_the_coordinator_died_in(
    run_drill: Runner, tmp_path: Path
) -> None:
    """Masked round 1: every member masks; the coordinator dies as the second update
    (p01's) is admitted. In the retried attempt (fresh keys: the first attempt's were
    spent) p01 drops out mid-round, which a masked round with threshold 3 of 4 tolerates."""

    def run(*args: str) -> int | None:
        masked = ("--secagg-threshold", "3")
        return run_drill(
            tmp_path / "run", *masked, *args, report=tmp_path / "r.json", log=tmp_path / "log"
        )

    assert run("--kill-at", "1:mid-collecting") == SIGKILLED
    assert run("--resume", "--drop", "p01:1:collecting") == 0
    manifest = RunManifest.load(Store(tmp_path / "run"))
    assert [(e.attempt, e.state, e.reason) for e in manifest.rounds if e.round == 1] == [
        (1, RoundState.ABORTED, INTERRUPTED),
        (2, RoundState.CLOSED, None),
    ]
