"""Seams for scripting faults: what the project's tests use, and what users who want to
script faults in their own tests use, instead of reaching into private state.

* :class:`FaultPlan` scripts what goes wrong on an
  :class:`~lensemble_flwr.transports.inprocess.InProcessNetwork`: drops, delays,
  corruptions, duplicates, rejoins (:mod:`.faults`). The network itself takes a raw
  payload with ``inject``, loses a party with ``take_offline`` / ``bring_online``, runs
  an action at a simulated time with ``call_at``, and reports deliveries to ``on_deliver``.
* :class:`DeliveryLog` keeps what the network delivers, to assert on (:mod:`.recording`).
* :class:`BarrierFaults` is what a shared-folder barrier is made to suffer: a claimant
  that dies holding its claim, a publication that is lost (:mod:`.faults`).
* :class:`ManualClock` is a clock (and a ``sleep``) that only moves when told, for the
  parts that take an injected clock (:mod:`.clock`).

In the layering this package sits above transports, coordinator, participant and
shared_folder (it may import them; they never import it). It imports neither flwr nor
torch.
"""

from __future__ import annotations

from lensemble_flwr.testing.clock import ManualClock
from lensemble_flwr.testing.faults import BarrierFaults, FaultPlan
from lensemble_flwr.testing.recording import Delivery, DeliveryLog

__all__ = ["BarrierFaults", "Delivery", "DeliveryLog", "FaultPlan", "ManualClock"]
