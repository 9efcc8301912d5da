"""Existing NumPyClient code as a lensemble participant.

``wrap_numpy_client(client_fn)`` returns a ClientApp in which the user's unmodified
``NumPyClient.fit`` is the inner loop: the participant gives it the global arrays (as the
ordered list a NumPyClient expects), takes the arrays it returns as the local weights,
and forms the delta and the release from them. Without ``records_fn`` the participant
cannot commit to its data and its updates are unbound; with it, they are bound to the
Merkle root of those records.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import Context
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod

from lensemble_flwr.clients.app import config_from_context, make_client_app
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.participant.local_training import PortableState


def ordered_names(names: Iterable[str]) -> list[str]:
    """Names in the order of the list a NumPyClient works with: ``"0", "1", ..., "10"``
    numerically (how Flower names a list of arrays), anything else as given sorted."""
    names = list(names)
    if all(n.isdigit() for n in names):
        return sorted(names, key=int)
    return sorted(names)


class NumPyClientTraining:
    """LocalTraining whose inner loop is ``client.fit``.

    Args:
        client: the user's NumPyClient.
        records: the records its data commits to, or None (unbound updates).
        fit_config: extra config passed to every ``fit`` (under the user's train config
            of the round, and ``lensemble.local-steps`` and ``lensemble.seed``, which come
            from the round).
    """

    def __init__(
        self,
        client: NumPyClient,
        *,
        records: Iterable[bytes] | None = None,
        fit_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.client = client
        self._records = list(records) if records is not None else None
        self.fit_config = dict(fit_config or {})
        self._num_examples = len(self._records) if self._records is not None else 1
        self.last_loss: float | None = None
        self.last_metrics: dict[str, float] = {}
        self._as_sent: dict[str, np.ndarray] = {}
        self._instruction_config: dict[str, Any] = {}

    def use_instruction_config(self, config: Mapping[str, Any]) -> None:
        """The user's train config of this instruction (what ``start(train_config=...)``
        sent, and ``server-round``): ``fit`` gets it as FedAvg's clients do."""
        self._instruction_config = dict(config)

    def use_instruction_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The instruction's arrays as the server sent them: every name (integer buffers
        such as BatchNorm's ``num_batches_tracked`` included) in the model's own order,
        which is the list ``fit`` and ``evaluate`` get (a ``zip(state_dict().keys(),
        parameters)`` setter needs exactly that)."""
        self._as_sent = dict(arrays)

    def _as_list(self, params: Mapping[str, np.ndarray]) -> tuple[list[str], list[np.ndarray]]:
        """The arrays ``fit``/``evaluate`` get: the server's names in the server's order
        (``params`` over the carried arrays), else the order of :func:`ordered_names`."""
        if self._as_sent and set(params) <= set(self._as_sent):
            names = list(self._as_sent)
            return names, [np.array(params.get(n, self._as_sent[n])) for n in names]
        names = ordered_names(params)
        return names, [np.array(params[n]) for n in names]

    def num_examples(self) -> int:
        """The records' count when bound, else what ``fit`` last reported."""
        return self._num_examples

    def dataset_records(self) -> Iterable[bytes] | None:
        """The records the commitment covers (None: unbound updates)."""
        return self._records

    def fit(self, global_params: Mapping[str, np.ndarray], *, steps: int, seed: int) -> NamedArrays:
        """Call ``client.fit`` on the server's list of arrays with the user's train config
        (plus ``lensemble.local-steps`` and ``lensemble.seed``) and return the federated
        arrays it gives back."""
        names, arrays = self._as_list(global_params)
        config = {
            **self.fit_config,
            **self._instruction_config,
            "lensemble.local-steps": steps,
            "lensemble.seed": seed,
        }
        params, count, metrics = self.client.fit(arrays, config)
        if len(params) != len(names):
            raise ValueError(f"fit returned {len(params)} arrays for {len(names)} parameters")
        if self._records is None:  # unbound: the example count is what fit reports
            self._num_examples = max(1, int(count))
        loss = (metrics or {}).get("loss", (metrics or {}).get("train-loss"))
        self.last_loss = float(loss) if isinstance(loss, (int, float)) else None
        self.last_metrics = {  # fit's own numeric metrics, sent when metrics are released
            str(k): float(v)
            for k, v in (metrics or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        returned = dict(zip(names, params, strict=True))
        return {n: np.asarray(returned[n]) for n in global_params}  # carried ones stay here

    def forget(self) -> None:
        """A NumPyClient keeps no state the participant could discard."""

    def export_state(self) -> PortableState:
        """The reported example count (a NumPyClient keeps its own model)."""
        return PortableState(meta={"num_examples": self._num_examples})

    def import_state(self, state: PortableState) -> None:
        """Restore the reported example count of an unbound client."""
        if self._records is None and "num_examples" in state.meta:
            self._num_examples = int(state.meta["num_examples"])

    def evaluate(self, params: NamedArrays, config: Mapping[str, Any]) -> dict[str, float]:
        """``client.evaluate`` on the server's list of arrays: its metrics, ``loss`` and
        ``num-examples``."""
        self.use_instruction_arrays(params)  # an evaluate instruction's arrays, as sent
        _, arrays = self._as_list(params)
        loss, count, metrics = self.client.evaluate(arrays, dict(config))
        out = {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float))}
        return {**out, "loss": float(loss), "num-examples": int(count)}


def _numpy_client(client: Any) -> NumPyClient:
    """The NumPyClient of what a client_fn returns (a NumPyClient or its ``to_client()``)."""
    inner = getattr(client, "numpy_client", client)
    if not isinstance(inner, NumPyClient):
        raise TypeError(f"client_fn must return a NumPyClient, got {type(client).__name__}")
    return inner


def wrap_numpy_client(
    client_fn: Callable[[Context], Any],
    *,
    records_fn: Callable[[Context], Iterable[bytes]] | None = None,
    config_fn: Callable[[Context], LensembleConfig] = config_from_context,
    mods: list[Mod] | None = None,
) -> ClientApp:
    """A lensemble ClientApp around an existing ``client_fn`` returning a NumPyClient;
    ``mods`` are Flower mods around its handlers (see :func:`.app.make_client_app`)."""

    def trainer_fn(context: Context) -> NumPyClientTraining:
        records = records_fn(context) if records_fn is not None else None
        return NumPyClientTraining(_numpy_client(client_fn(context)), records=records)

    def evaluate(training: Any, params: NamedArrays, config: Mapping[str, Any]) -> dict[str, float]:
        return training.evaluate(params, config)

    return make_client_app(trainer_fn, config_fn=config_fn, evaluate_fn=evaluate, mods=mods)
