"""The workers: who they are (configuration, discovery, the admin API's changes), whether
they are healthy (probes, scrapes, circuit breakers) and how loaded."""
