"""An engine's own KV cache events: what it stored and what it removed, block by block."""
