"""Transports: the protocol every party speaks, and the in-process network."""
