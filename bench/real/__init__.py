"""``kvrouter bench real``: routers compared in front of real vLLM engines (CPU build)."""
