"""Secure aggregation primitives: pairwise and self masks over Z_{2^64}, an AES-CTR PRG,
Shamir sharing of mask secrets, and authenticated encryption of shares.

Sans-I/O and Flower-free. ``protocol`` composes them into the participant's and the
aggregator's roles; the coordinator's masked round mode
(:mod:`lensemble_flwr.coordinator.modes`) runs them in the round, with an unmask exchange
in AGGREGATING.
"""
