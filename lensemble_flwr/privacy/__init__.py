"""Differential privacy on the participant's side: a persistent budget and CSPRNG noise."""
