"""``kvrouter bench fuzz``: hostile requests from clients (``run``), and hostile
engines and Redis writes beside normal traffic (``sides``)."""
