"""The protocol layer: wire messages, the global state, the pseudo-gradient, the round table.

It imports nothing above the package's base modules; everything else builds on it.
"""
