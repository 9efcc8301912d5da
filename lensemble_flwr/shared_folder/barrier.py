"""A round barrier in a folder that every participant process mounts, with nobody in charge.

Each participant process deposits its record for a round; whoever then finds the round
complete claims the decision, and because a claim is an ``os.link`` that either takes the
name or finds it taken (:meth:`Store.claim`), exactly one process decides. It publishes
what it decided; everybody else waits for that and leaves with it. Nobody has to stay
alive between rounds, and one participant does a little more work than the others once a
round.

A round is gathered in *sittings*: sitting 1 is the first go, and a round that has to be
tried again (the decider says so) gets sitting 2, with names of its own, so two sittings
never mix. One sitting, in the run's :class:`Store`::

    barrier/<round>.<sitting>/record/<participant>   what it deposited   (claimed: once)
    barrier/<round>.<sitting>/decision               who decides         (claimed: one)
    barrier/<round>.<sitting>/outcome                what was decided    (claimed: once)

and the run's start, which works the same way::

    barrier/start     who creates the run     (claimed: one)
    barrier/genesis   what it published       (claimed: once)

Two deadlines, and two different errors, because they are different failures:

* the sitting is not complete by ``round_timeout`` after this process started waiting:
  somebody never came. This process then claims the decision itself and hands its
  decider the *missing* participants; whether to go on without them is the decider's
  policy, not the barrier's (:class:`Snapshot`).
* the decision was claimed but nothing was published ``publish_timeout`` after this
  process first saw the claim: the claimant died holding it, and nobody else will
  decide: :class:`~lensemble_flwr.errors.ClaimantDied`, naming it.

The barrier moves bytes; what a record or an outcome means is the caller's business
(:mod:`lensemble_flwr.shared_folder.runner`, and the decider's
:mod:`lensemble_flwr.shared_folder.decision`). What it may be made to suffer on purpose, a
test's business, is a :class:`BarrierFaults` (also :mod:`lensemble_flwr.testing`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import ClaimantDied, RoundError, StoreError

log = logging.getLogger(__name__)

PREFIX = "barrier"
START, GENESIS = f"{PREFIX}/start", f"{PREFIX}/genesis"


@dataclasses.dataclass(frozen=True, order=True)
class SittingKey:
    """Sitting ``sitting`` (from 1) of round ``round`` (from 1, Flower's numbering)."""

    round: int
    sitting: int

    def __post_init__(self) -> None:
        if self.round < 1 or self.sitting < 1:
            raise ValueError(f"no sitting {self.sitting} of round {self.round}")

    @property
    def name(self) -> str:
        return f"{PREFIX}/{self.round:08d}.{self.sitting:03d}"

    def __str__(self) -> str:
        return f"round {self.round} sitting {self.sitting}"


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What the decider sees once it holds the decision: the records deposited by then
    (participant → bytes) and the expected participants that deposited nothing."""

    key: SittingKey
    records: Mapping[str, bytes]
    missing: tuple[str, ...]


Decide = Callable[[Snapshot], bytes]


@dataclasses.dataclass(frozen=True)
class BarrierFaults:
    """What a barrier is made to suffer on purpose, in tests and drills (by default,
    nothing). Set it with ``FolderBarrier(..., faults=...)`` or on ``barrier.faults``.

    Attributes:
        on_claim: called with the name of every claim this process wins
            (``barrier/start``, ``barrier/<round>.<sitting>/decision``) before it acts on
            it; a test ends the process here to leave a claim nobody will publish under.
        lose: whether this process's publication under a name (``barrier/genesis``,
            ``barrier/<round>.<sitting>/outcome``) is lost: the process goes on with what
            it meant to publish, and nobody else ever sees it.
    """

    on_claim: Callable[[str], None] | None = None
    lose: Callable[[str], bool] | None = None


class FolderBarrier:
    """One participant process's view of the barriers of a run.

    Args:
        store: the run's store (one per run: two runs sharing a folder are two stores).
        identity: who this process is, written into every claim it makes, so that an
            error about a dead claimant can name it.
        round_timeout: seconds a sitting may take to complete, counted from when this
            process starts waiting on it.
        publish_timeout: seconds a claimant may take to publish, counted from when this
            process first sees the claim.
        poll_interval: seconds between looks at the folder.
        clock: monotonic seconds (injectable for tests).
        sleep: how to wait ``poll_interval`` (injectable for tests).
        faults: what the barrier is made to suffer (tests); kept as ``faults``.
    """

    def __init__(
        self,
        store: Store,
        *,
        identity: str,
        round_timeout: float,
        publish_timeout: float,
        poll_interval: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        faults: BarrierFaults | None = None,
    ) -> None:
        for what, value in (
            ("round_timeout", round_timeout),
            ("publish_timeout", publish_timeout),
            ("poll_interval", poll_interval),
        ):
            if not value > 0:
                raise ValueError(f"{what} must be positive, got {value!r}")
        self.store = store
        self.identity = identity
        self.round_timeout = round_timeout
        self.publish_timeout = publish_timeout
        self.poll_interval = poll_interval
        self._clock = clock
        self._sleep = sleep
        self.faults = faults or BarrierFaults()
        self._me = store.put(identity.encode("utf-8"))
        self._claims_seen: dict[str, float] = {}  # claim name -> when this process saw it

    # -- the run's start ---------------------------------------------------------------
    def start(self, create: Callable[[], bytes]) -> bytes:
        """The run's genesis: created by whoever claims the start, waited for by the rest.

        Args:
            create: called by the one process that wins the start; it creates the run and
                returns what everybody should read (published under ``barrier/genesis``).

        Raises:
            ClaimantDied: the start was claimed and nothing was published in time.
        """
        published = self._published(GENESIS)
        if published is not None:
            return published
        if self._claim(START):
            log.info("%s creates the run", self.identity)
            return self._publish(GENESIS, create())
        while True:
            published = self._await_publication(GENESIS, START, "the run's start")
            if published is not None:
                return published
            self._sleep(self.poll_interval)

    # -- a sitting ---------------------------------------------------------------------
    def deposit(self, key: SittingKey, participant: str, data: bytes) -> bool:
        """Deposit ``participant``'s record for sitting ``key``, once.

        Returns:
            True if this call deposited it, False if these very bytes were already there
            (a restarted process depositing again).

        Raises:
            RoundError: ``participant`` already deposited something else: a record is
                never replaced, whoever wrote first stands.
        """
        name = self.record_name(key, participant)
        digest = self.store.put(data)
        if self.store.claim(name, digest):
            return True
        if self.store.resolve(name) != digest:
            raise RoundError(
                f"{key}: {participant} already deposited a different record (two processes "
                "with one participant id?); the first one stands"
            )
        return False

    def deposited(self, key: SittingKey) -> list[str]:
        """The participants that deposited a record for sitting ``key``, sorted."""
        prefix = f"{key.name}/record"
        return [name.rsplit("/", 1)[-1] for name in self.store.bound(prefix)]

    def has_deposited(self, key: SittingKey, participant: str) -> bool:
        """Whether ``participant`` deposited a record for sitting ``key`` (one name is
        looked up; the sitting's other records are not listed)."""
        return bool(self.store.bound(self.record_name(key, participant)))

    def outcome(self, key: SittingKey) -> bytes | None:
        """The published outcome of sitting ``key``, or None if there is none yet."""
        return self._published(f"{key.name}/outcome")

    def gather(self, key: SittingKey, expected: Sequence[str], decide: Decide) -> bytes:
        """Wait until sitting ``key`` has an outcome, deciding it if this process claims it.

        The sitting is decided when every participant in ``expected`` deposited, or when
        ``round_timeout`` passed (the decider is then told who is missing). A process that
        finds the outcome already published returns it without waiting.

        Returns:
            The outcome, as the decider published it (the same bytes for everybody).

        Raises:
            ClaimantDied: the decision was claimed and nothing was published in time.
        """
        expected_set = set(expected)
        deadline = self._clock() + self.round_timeout
        outcome_name, decision_name = f"{key.name}/outcome", f"{key.name}/decision"
        while True:
            # an outcome is only ever published under a claimed decision: until somebody
            # claims it there is nothing to read, only deposits to count
            if not self.store.bound(decision_name):
                complete = expected_set <= set(self.deposited(key))
                if not (complete or self._clock() >= deadline):
                    self._sleep(self.poll_interval)
                    continue
                if self._claim(decision_name):
                    return self._decide(key, expected, decide)
            published = self._await_publication(outcome_name, decision_name, str(key))
            if published is not None:
                return published
            self._sleep(self.poll_interval)

    # -- internals ---------------------------------------------------------------------
    def _decide(self, key: SittingKey, expected: Sequence[str], decide: Decide) -> bytes:
        # the snapshot is taken after the claim: a record that lands later is not in it,
        # exactly as an update after the collect deadline is not in a coordinator's sum
        records = {
            participant: self.store.get(self.store.resolve(self.record_name(key, participant)))
            for participant in self.deposited(key)
        }
        missing = tuple(sorted(set(expected) - set(records)))
        log.info("%s decides %s (missing: %s)", self.identity, key, ", ".join(missing) or "none")
        return self._publish(f"{key.name}/outcome", decide(Snapshot(key, records, missing)))

    def _claim(self, name: str) -> bool:
        if not self.store.claim(name, self._me):
            return False
        if self.faults.on_claim is not None:
            self.faults.on_claim(name)
        return True

    def _publish(self, name: str, data: bytes) -> bytes:
        if self.faults.lose is not None and self.faults.lose(name):
            log.warning("fault: %s loses its publication of %s", self.identity, name)
            return data
        if not self.store.claim(name, self.store.put(data)):
            # only the claimant publishes, and it publishes once
            raise StoreError(f"{name} was published by somebody who did not hold the claim")
        return data

    def _published(self, name: str) -> bytes | None:
        if not self.store.bound(name):
            return None
        return self.store.get(self.store.resolve(name))

    def _await_publication(self, name: str, claim_name: str, what: str) -> bytes | None:
        """One look for ``name``, whose claim ``claim_name`` somebody holds; ClaimantDied
        once the holder took too long."""
        published = self._published(name)
        if published is not None:
            return published
        now = self._clock()
        first_seen = self._claims_seen.setdefault(claim_name, now)
        if now - first_seen < self.publish_timeout:
            return None
        published = self._published(name)  # it may have landed while we looked at the clock
        if published is not None:
            return published
        claimant = self.store.get(self.store.resolve(claim_name)).decode("utf-8", "replace")
        raise ClaimantDied(
            f"{what}: {claimant} claimed it and published nothing within "
            f"{self.publish_timeout:g}s; it died holding the claim, and nobody else takes "
            "a claim over",
            claimant=claimant,
        )

    @staticmethod
    def record_name(key: SittingKey, participant: str) -> str:
        """The store name of ``participant``'s record for sitting ``key``."""
        return f"{key.name}/record/{participant}"
