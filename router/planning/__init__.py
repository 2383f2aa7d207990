"""Capacity in resident tokens: a model's bytes per token, a GPU's room for them, and what
one worker's failure costs (``kvrouter capacity``; the simulator sizes its engines with
it)."""
