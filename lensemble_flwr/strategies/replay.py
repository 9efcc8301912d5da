"""ReplayTransport, re-exported where the Flower strategy has always imported it from.

It lives in :mod:`lensemble_flwr.federation.replay` because it is Flower-free and the
shared-folder runner, below the Flower layer, uses it too.
"""

from lensemble_flwr.federation.replay import ReplayTransport

__all__ = ["ReplayTransport"]
