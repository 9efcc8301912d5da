"""The participant: local training, the release chain, and the protocol side of a node."""
