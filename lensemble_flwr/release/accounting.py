"""The privacy charge as a value: the noise stage's state, saved and loaded like an
Opacus accountant's ``state_dict()`` / ``load_state_dict()``.

A :class:`PrivacyState` is the accountant's history after this participant's latest
charge — Opacus's plain ``(noise_multiplier, sample_rate, steps)`` tuples, relative to
the sensitivity — with the epsilon it spends at the budget's delta, the accountant and
the adjacency it was charged under. The participant's budget file
(:class:`~lensemble_flwr.privacy.budget.PrivacyBudget`) stays the durable store: the
noise stage reads its state from the budget when the chain starts, and each charge is
written there (under its lock, before anything is released) and returned as the stage's
new state. :meth:`PrivacyState.state_dict` copies; :meth:`PrivacyState.load_state_dict`
validates before it builds anything, and a bad dict raises :class:`RoundError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from lensemble_flwr.errors import RoundError
from lensemble_flwr.privacy.budget import MECHANISMS, SENSITIVITY_FACTORS, PrivacyBudget

HistoryEntry = tuple[float, float, int]
"""One Opacus history entry: (noise multiplier, sample rate, steps)."""

_KEYS = frozenset({"accountant", "adjacency", "history", "epsilon"})


class PrivacyState(NamedTuple):
    """What this participant's budget has been charged, as of its latest release."""

    accountant: str
    adjacency: str
    history: tuple[HistoryEntry, ...]
    epsilon: float

    @classmethod
    def of(cls, budget: PrivacyBudget) -> PrivacyState:
        """The state the durable store ``budget`` holds now."""
        return cls(
            accountant=budget.mechanism,
            adjacency=budget.adjacency,
            history=tuple((float(s), float(q), int(n)) for s, q, n in budget.history),
            epsilon=budget.spent(),
        )

    def state_dict(self) -> dict[str, Any]:
        """A JSON-able copy (the history as lists, as Opacus's own ``state_dict`` holds it)."""
        return {
            "accountant": self.accountant,
            "adjacency": self.adjacency,
            "history": [list(entry) for entry in self.history],
            "epsilon": self.epsilon,
        }

    @classmethod
    def load_state_dict(cls, data: Any) -> PrivacyState:
        """The state ``data`` describes, validated before anything is built.

        Raises:
            RoundError: ``data`` is not a dict of exactly the four keys; an unknown
                accountant or adjacency; a history entry that is not a positive finite
                noise multiplier, a sample rate in (0, 1] and a positive step count; an
                epsilon that is negative or not finite, or that is positive for an empty
                history.
        """
        if not isinstance(data, Mapping) or set(data) != _KEYS:
            raise RoundError(f"privacy state: not a dict of {sorted(_KEYS)}")
        accountant, adjacency = data["accountant"], data["adjacency"]
        if accountant not in MECHANISMS:
            raise RoundError(f"privacy state: unknown accountant {accountant!r}")
        if adjacency not in SENSITIVITY_FACTORS:
            raise RoundError(f"privacy state: unknown adjacency {adjacency!r}")
        history = data["history"]
        if not isinstance(history, list | tuple):
            raise RoundError("privacy state: the history is not a list")
        entries = tuple(_entry(item, i) for i, item in enumerate(history))
        epsilon = data["epsilon"]
        if type(epsilon) not in (int, float) or not (math.isfinite(epsilon) and epsilon >= 0):
            raise RoundError(f"privacy state: epsilon {epsilon!r} is not a finite value >= 0")
        if epsilon > 0 and not entries:
            raise RoundError("privacy state: epsilon spent without a history")
        return cls(str(accountant), str(adjacency), entries, float(epsilon))


def _entry(item: Any, index: int) -> HistoryEntry:
    """One history entry, checked (:meth:`PrivacyState.load_state_dict`)."""
    if not isinstance(item, list | tuple) or len(item) != 3:
        raise RoundError(f"privacy state: history entry {index} is not three values")
    sigma, rate, steps = item
    numbers = all(type(x) in (int, float) for x in (sigma, rate))
    if not (numbers and math.isfinite(sigma) and sigma > 0 and 0 < rate <= 1):
        raise RoundError(
            f"privacy state: history entry {index} needs a positive finite noise "
            f"multiplier and a sample rate in (0, 1], not {sigma!r}, {rate!r}"
        )
    if type(steps) is not int or steps < 1:
        raise RoundError(f"privacy state: history entry {index} has {steps!r} steps")
    return (float(sigma), float(rate), steps)


def check_restored(state: Any, budget: PrivacyBudget) -> PrivacyState | None:
    """A noise stage's state restored from an export, checked against ``budget``.

    The budget file must hold at least what the state says was spent: a state that
    records more releases (or more epsilon) than ``budget`` was saved against a budget
    that has since been lost, replaced or rolled back, and restoring it would let the
    participant spend again what it already released.

    Raises:
        RoundError: not a :class:`PrivacyState` (see :meth:`PrivacyState.load_state_dict`),
            one charged under another accountant or adjacency than ``budget``'s, or one
            that spent more than ``budget`` records.
    """
    if state is None:
        return None
    if type(state) is not PrivacyState:
        raise RoundError("privacy state: the noise stage's state is not a PrivacyState")
    loaded = PrivacyState.load_state_dict(state.state_dict())
    if (loaded.accountant, loaded.adjacency) != (budget.mechanism, budget.adjacency):
        raise RoundError(
            f"privacy state: charged with {loaded.accountant!r} under {loaded.adjacency!r}, "
            f"this stage's budget is {budget.mechanism!r} under {budget.adjacency!r}"
        )
    held = PrivacyState.of(budget)
    released, recorded = _releases(loaded.history), _releases(held.history)
    if released > recorded or loaded.epsilon > held.epsilon * (1 + 1e-9) + 1e-12:
        raise RoundError(
            f"privacy state: {released} releases (epsilon {loaded.epsilon:.4g}) were charged, "
            f"but the budget at {budget.path} records {recorded} (epsilon "
            f"{held.epsilon:.4g}): it was lost, replaced or rolled back; restore that file "
            "rather than spend the released budget again"
        )
    return loaded


def _releases(history: tuple[HistoryEntry, ...]) -> int:
    """How many charges a history holds (consecutive equal ones are merged into steps)."""
    return sum(steps for _, _, steps in history)
