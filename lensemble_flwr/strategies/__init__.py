"""The coordinator as a Flower Strategy (Message API)."""

from lensemble_flwr.strategies.grid_transport import GridTransport
from lensemble_flwr.strategies.lensemble import LensembleResult, LensembleStrategy

__all__ = ["GridTransport", "LensembleResult", "LensembleStrategy"]
