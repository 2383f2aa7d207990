"""What the router shows operators: its Prometheus metrics, the request log, the event
loop's health, and warnings rate-limited per cause."""
