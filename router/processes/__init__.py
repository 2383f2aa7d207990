"""``kvrouter serve --processes N``: N router processes on one port that route as one.

``supervisor`` is the parent (it holds the port, starts the shared state store when no
``state.url`` is configured, starts, restarts and stops the processes); ``store`` finds
and runs that store; ``slot`` is what a process knows of its place in the group;
``siblings`` is the processes' side (one /metrics for the group, admin changes to every
process); ``exposition`` merges the processes' metrics.
"""
