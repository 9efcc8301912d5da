"""A participant's cumulative privacy budget, kept on the participant and refused in advance.

Every noised release is one Gaussian mechanism on the participant's data. The budget
records them in an Opacus accountant (RDP by default, PRV selectable) and answers, before
the release, whether it would take the spent epsilon past the budget; if so the release
does not happen. What was spent is written to disk (atomically) *before* the noised update
leaves, so a crash between the two can only over-count, never under-count.

The record is keyed by the participant's stable identity, not by its data or the run: new
data, a new run and a restart all continue the same budget. It lives in a directory of
the participant's own (``dp-state-dir``), never in the coordinator's run directory.

The accounting, in the terms of docs/privacy.md: the release is clip(Δ) + N(0, σ²C²I);
neighbouring datasets are any two versions of this participant's dataset (they may
differ in any number of records, the participant's whole dataset included). The clipped
update of either lies in the ball of radius C, so the L2 sensitivity is 2C and each
release is a Gaussian mechanism with effective noise multiplier σ/2. That is the default
``dp-adjacency = "substitution"``. With ``"zero-out"`` the neighbour is the same run
with the participant's update replaced by zero, so the sensitivity is C, as for adding or
removing one update (Opacus's add/remove accounting), and the effective multiplier σ.
A budget is kept under one adjacency: its file records which, and a participant
configured with the other is refused (the two epsilons do not compose). The participant
knows when it releases, so there is no sampling amplification: sample rate 1,
one step per release.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal

from lensemble_flwr.atomic_write import write_atomically
from lensemble_flwr.config import Adjacency
from lensemble_flwr.errors import (
    ConfigError,
    PrivacyBudgetExceeded,
    PrivacyBudgetRolledBack,
    PrivacyBudgetUnreadable,
)

if TYPE_CHECKING:
    from opacus.accountants import PRVAccountant, RDPAccountant


Mechanism = Literal["rdp", "prv"]
MECHANISMS: tuple[Mechanism, ...] = ("rdp", "prv")
"""The accountants lensemble offers: Opacus's RDP (default) and PRV."""


_OPACUS_IMPORT = threading.Lock()


def import_opacus(module: str) -> ModuleType:
    """Import the opacus module ``module`` without the side effect of importing opacus:
    one of its modules calls ``logging.basicConfig``, which gives the root logger a
    handler (every Flower log line then prints twice). Importing or using this package
    must not change the user's logging, so the root logger is put back as it was. Every
    opacus import of the package goes through here, one thread at a time (a thread that
    looked at the root logger while another imported could put the handler back).

    Opacus is imported on first use, not with this module: it takes seconds (its
    accountants import its training engine and ``torch.distributed``), which a run
    without DP, or a SuperNode process that handles one message, should not pay.
    """
    with _OPACUS_IMPORT:
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        try:
            return importlib.import_module(module)
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)


@functools.cache
def accountant_class(mechanism: Mechanism) -> type[RDPAccountant | PRVAccountant]:
    """Opacus's accountant class for ``mechanism``, imported on first use
    (:func:`import_opacus`).

    Raises:
        ConfigError: not one of :data:`MECHANISMS`.
    """
    if mechanism not in MECHANISMS:
        raise ConfigError("dp-accountant", f"unknown accountant {mechanism!r}")
    accountants = import_opacus("opacus.accountants")
    return accountants.RDPAccountant if mechanism == "rdp" else accountants.PRVAccountant


SENSITIVITY_FACTORS: dict[str, float] = {"substitution": 2.0, "zero-out": 1.0}
"""A release's L2 sensitivity in clip norms, by adjacency: 2 when the participant's
dataset is replaced by any other, 1 when its update is replaced by zero."""
SENSITIVITY_FACTOR = SENSITIVITY_FACTORS["substitution"]
"""The default adjacency's sensitivity in clip norms (substitution)."""


def sensitivity_factor(adjacency: str) -> float:
    """The L2 sensitivity, in clip norms, of a release under ``adjacency``.

    Raises:
        ConfigError: not an adjacency lensemble accounts.
    """
    try:
        return SENSITIVITY_FACTORS[adjacency]
    except KeyError:
        raise ConfigError(
            "dp-adjacency",
            f"unknown adjacency {adjacency!r}: choose one of {sorted(SENSITIVITY_FACTORS)}",
        ) from None


def noise_stage_name(base: str, adjacency: str) -> str:
    """The name a noise stage declares in an update's ``transforms``: ``base`` under
    substitution (the names updates always had), ``base@zero-out`` under zero-out, so that
    the coordinator can refuse a release accounted under another adjacency than the
    federation's (its epsilon would be in other units than the ledger's label says)."""
    sensitivity_factor(adjacency)  # a known adjacency
    return base if adjacency == "substitution" else f"{base}@{adjacency}"


class PrivacyBudget:
    """The (epsilon, delta) budget of one participant's dataset.

    Args:
        state_dir: the participant's own directory for budgets.
        key: what the budget belongs to (the participant's stable identity, as
            ``release_chain.budget_name`` names it).
        epsilon, delta: the budget.
        accountant: "rdp" (default) or "prv".
        adjacency: "substitution" (default; sensitivity 2C) or "zero-out" (C).
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        key: str,
        *,
        epsilon: float,
        delta: float,
        accountant: Mechanism = "rdp",
        adjacency: Adjacency = "substitution",
    ) -> None:
        self.sensitivity_factor = sensitivity_factor(adjacency)
        self.adjacency: Adjacency = adjacency
        if accountant not in MECHANISMS:
            raise ConfigError("dp-accountant", f"unknown accountant {accountant!r}")
        if not (epsilon > 0 and 0 < delta < 1):
            raise ConfigError("dp-epsilon", "the budget needs epsilon > 0 and 0 < delta < 1")
        self.path = Path(state_dir) / f"{key}.json"
        self.epsilon_budget = epsilon
        self.delta = delta
        self.mechanism: Mechanism = accountant
        self.history: list[tuple[float, float, int]] = self._load()

    def _load(self) -> list[tuple[float, float, int]]:
        if not self.path.exists():
            return []
        try:
            data = json.loads(self.path.read_text())
            history = [(float(s), float(q), int(n)) for s, q, n in data["history"]]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise PrivacyBudgetUnreadable(
                f"{self.path} is not a readable privacy budget ({type(exc).__name__}: {exc}); "
                "what was spent is unknown, so nothing is released: restore the file"
            ) from None
        if data.get("accountant") != self.mechanism:
            raise ConfigError(
                "dp-accountant",
                f"{self.path} was accounted with {data.get('accountant')!r}, "
                f"not {self.mechanism!r}",
            )
        recorded = data.get("adjacency", "substitution")  # files from before the choice
        if recorded != self.adjacency:
            raise ConfigError(
                "dp-adjacency",
                f"{self.path} was accounted under {recorded!r} adjacency, not "
                f"{self.adjacency!r}: the two epsilons do not compose into one budget",
            )
        return history

    def _accountant(self, history: list[tuple[float, float, int]]) -> RDPAccountant | PRVAccountant:
        accountant = accountant_class(self.mechanism)()
        accountant.history = [tuple(h) for h in history]
        return accountant

    def spent(self) -> float:
        """Epsilon spent so far (at this budget's delta)."""
        return self._epsilon(self.history)

    def _epsilon(self, history: list[tuple[float, float, int]]) -> float:
        if not history:
            return 0.0
        return float(self._accountant(history).get_epsilon(delta=self.delta))

    def releases(self) -> int:
        """How many releases the budget has recorded."""
        return sum(steps for _, _, steps in self.history)

    def would_spend(
        self, noise_multiplier: float, *, sensitivity_factor: float | None = None
    ) -> float:
        """The epsilon one more release (as :meth:`charge` counts it) would bring the
        file's total to, re-read now; nothing is recorded.

        Raises:
            PrivacyBudgetUnreadable: the file cannot be read.
        """
        factor = self.sensitivity_factor if sensitivity_factor is None else sensitivity_factor
        self.history = self._load()
        return self._epsilon(_merged(self.history, (noise_multiplier / factor, 1.0)))

    def charge(
        self,
        noise_multiplier: float,
        *,
        sensitivity_factor: float | None = None,
        at_least: tuple[int, float] | None = None,
    ) -> float:
        """Record one release with noise multiplier ``noise_multiplier`` (std / clip norm),
        whose sensitivity is ``sensitivity_factor`` clip norms (default: the budget's
        adjacency's, 2 for substitution and 1 for zero-out; 1 also for a multiplier already
        relative to the sensitivity, as the distributed mechanism's equivalent one is).

        ``at_least``: (releases, epsilon) the caller knows were already recorded here (its
        last charge); a file that holds fewer was deleted, replaced or rolled back since.

        Returns:
            The epsilon spent after this release.

        Raises:
            PrivacyBudgetExceeded: this release would take the spent epsilon past the
                budget; nothing is recorded and nothing may be released.
            PrivacyBudgetRolledBack: the file holds less than ``at_least``; nothing is
                recorded and nothing may be released.
        """
        factor = self.sensitivity_factor if sensitivity_factor is None else sensitivity_factor
        step = (noise_multiplier / factor, 1.0)
        with self._locked():  # another process (or budget object) may have charged since
            self.history = self._load()
            if at_least is not None:
                self._check_holds(*at_least)
            history = _merged(self.history, step)
            after = self._epsilon(history)
            if after > self.epsilon_budget:
                raise PrivacyBudgetExceeded(
                    f"this release would spend epsilon {after:.4g} > budget "
                    f"{self.epsilon_budget:.4g} (delta {self.delta:g}; spent {self.spent():.4g})"
                )
            self._save(history)
            self.history = history
        return after

    def _check_holds(self, releases: int, epsilon: float) -> None:
        """Refuse a file that records fewer releases, or less epsilon, than were charged.

        Raises:
            PrivacyBudgetRolledBack: it does.
        """
        held, spent = self.releases(), self.spent()
        if held < releases or spent < epsilon * (1 - 1e-9) - 1e-12:
            raise PrivacyBudgetRolledBack(
                f"{self.path} records {held} releases (epsilon {spent:.4g}), but this "
                f"participant charged {releases} (epsilon {epsilon:.4g}): the budget file "
                "was deleted, replaced or rolled back; nothing is released until it is restored"
            )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold an exclusive lock on this budget (a ``.lock`` file beside it) while a charge
        reads, checks and writes it, so two charges never both start from the same history
        and one of them is lost."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _save(self, history: list[tuple[float, float, int]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record: dict[str, object] = {"accountant": self.mechanism, "history": history}
        if self.adjacency != "substitution":  # files of the default stay as they were
            record["adjacency"] = self.adjacency
        # always durable: what is spent must be on disk before the noised update leaves
        write_atomically(self.path, json.dumps(record).encode(), sync=True)


def _merged(
    history: list[tuple[float, float, int]], step: tuple[float, float]
) -> list[tuple[float, float, int]]:
    """``history`` plus one step, merged into the last entry when it has the same mechanism
    (what Opacus's own ``step`` does)."""
    if history and history[-1][:2] == step:
        return [*history[:-1], (step[0], step[1], history[-1][2] + 1)]
    return [*history, (step[0], step[1], 1)]
