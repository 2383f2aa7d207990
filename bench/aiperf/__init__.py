"""aiperf (NVIDIA's benchmarking client) as an outside client of the router.

aiperf lives in a virtual environment of its own (``scripts/install-aiperf.sh``:
``environment``) and runs as a process. Its multi-turn mode sends each conversation's
turns with the history so far, under one ``X-Correlation-ID`` and the same value in
``X-Session-Affinity``, which the router reads as the session key. ``sessions`` writes
such conversations, ``hf_cache`` gives aiperf a tokenizer it loads offline, ``client``
runs it and ``export`` reads what it measured; ``kvrouter bench aiperf`` (``run``) puts
them together in front of a simulated fleet or a running router.
"""
