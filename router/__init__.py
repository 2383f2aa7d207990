"""kvrouter: a cache-aware load-balancing router for vLLM / SGLang fleets."""

__version__ = "0.1.0"
