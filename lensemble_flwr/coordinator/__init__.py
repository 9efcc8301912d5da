"""The coordinator: a round core on values and a driver that owns every transport call,
one round table per mode, sampling, the commit sequence, and building or resuming a run;
the ``Coordinator`` facade composes them."""
