"""Fault plans: what goes wrong, scripted.

:class:`FaultPlan` (defined in :mod:`lensemble_flwr.transports.faults`, where the
in-process network reads it) scripts the faults of an in-process federation;
:class:`BarrierFaults` (defined with the barrier it acts on) those of a shared-folder
barrier. Both are re-exported here, the one import path for tests and users.
"""

from __future__ import annotations

from lensemble_flwr.shared_folder.barrier import BarrierFaults
from lensemble_flwr.transports.faults import FaultPlan

__all__ = ["BarrierFaults", "FaultPlan"]
