"""Secure aggregation primitives: pairwise and self masks over Z_{2^64}, a ChaCha20 PRG,
Shamir sharing of mask secrets, and authenticated encryption of shares.

Sans-I/O and Flower-free. ``protocol`` composes them into the participant's and the
aggregator's roles; wiring them into the round (an unmask exchange in AGGREGATING) is
not done yet.
"""
