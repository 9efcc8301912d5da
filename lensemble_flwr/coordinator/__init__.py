"""The coordinator: the phase loop, message admission, round modes, commit, recovery."""
