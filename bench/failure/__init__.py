"""``kvrouter bench failure`` and ``kvrouter bench kill``: what a worker's failure costs the
sessions it held, and how the router routes around it."""
