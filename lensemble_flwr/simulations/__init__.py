"""Runnable examples: the Flower Apps (the world model, the digits classifier), the
in-process federation, the shared-folder demo and the crash drill, and their tasks."""
