"""Flower ClientApps whose participants are lensemble Participants."""

from lensemble_flwr.clients.app import make_client_app
from lensemble_flwr.clients.numpy_client import NumPyClientTraining, wrap_numpy_client

__all__ = ["NumPyClientTraining", "make_client_app", "wrap_numpy_client"]
