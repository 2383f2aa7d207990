"""What each worker's cache holds: prompts as chained block hashes, the approximate
per-worker LRU, and the exact residency a worker's KV events announce (their types and
chains here; ``router.kv_events`` subscribes to them)."""
