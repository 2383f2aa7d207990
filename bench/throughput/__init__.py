"""``kvrouter bench throughput``: the router's own cost, requests/s and CPU per request in
front of stand-in engines that cost nothing."""
