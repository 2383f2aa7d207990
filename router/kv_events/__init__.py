"""Subscriptions to the engines' own KV cache events (ZeroMQ, as vLLM and SGLang publish
them): what each stored and removed, applied to the exact residency in
``router.index.residency.exact``."""
