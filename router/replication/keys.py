"""What the shared state's keys are called and how a block hash is stored in them: the
one place both the sync loops and the request path read them from.

Every key of a namespace shares the hash tag ``{namespace}``, so a Redis Cluster keeps
them in one slot and the scripts may touch several at once.
"""

from __future__ import annotations

from collections.abc import Sequence


class Keys:
    def __init__(self, namespace: str) -> None:
        ns = f"kvr:{{{namespace}}}"
        self.stream = f"{ns}:events"
        self.replicas = f"{ns}:replicas"
        self.restarts = f"{ns}:restarts"
        self.load_prefix = f"{ns}:load:"
        self.rate_prefix = f"{ns}:rate:"
        self._residency = f"{ns}:res:"
        self._reserved = f"{ns}:rsv:"
        self._binding = f"{ns}:bind:"
        self._response = f"{ns}:resp:"
        self._response_chain = f"{ns}:rchain:"
        self.policy = f"{ns}:policy"
        self.admission = f"{ns}:admission"  # the router's queue settings, as the policy
        # What Redis type each key holds, by prefix (the longest first: "res:" and "resp:").
        self._types = sorted(
            (
                (self.stream, b"stream"),
                (self.replicas, b"zset"),
                (self.restarts, b"hash"),
                (self.policy, b"hash"),
                (self.admission, b"hash"),
                (self.load_prefix, b"hash"),
                (self.rate_prefix, b"string"),
                (self._residency, b"zset"),
                (self._reserved, b"zset"),
                (self._binding, b"string"),
                (self._response, b"string"),
                (self._response_chain, b"string"),
            ),
            key=lambda pair: -len(pair[0]),
        )

    def residency(self, worker: str) -> str:
        """The blocks the worker holds: a sorted set scored by last touch (ms)."""
        return self._residency + worker

    def reserved(self, worker: str) -> str:
        """Blocks of prompts dispatched to the worker and not yet computed, scored by
        when the reservation lapses (ms)."""
        return self._reserved + worker

    def binding(self, session_key: str | None) -> str:
        """The worker a session's last turn was served by (a plain string, with a TTL);
        for a request with no session key, a key nobody writes."""
        return self._binding + (session_key or "")

    def response(self, response_id: str) -> str:
        """The worker that stored a Responses response (``router.routing.response_owners``)."""
        return self._response + response_id

    def response_chain(self, response_id: str) -> str:
        """A stored response's conversation (``router.index.stored_chain``, encoded),
        written with its owner; a key of its own, so that a router that knows no chains
        reads the owner as before."""
        return self._response_chain + response_id

    def kept_type(self, key: str | bytes) -> bytes | None:
        """The Redis type kvrouter keeps at ``key`` (as TYPE names it); None for a key
        that is not one of the namespace's."""
        name = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        return next((kind for prefix, kind in self._types if name.startswith(prefix)), None)


MEMBER_BYTES = 8  # a block hash in a residency set: 8 bytes, big-endian


def member(block_hash: int) -> bytes:
    return block_hash.to_bytes(MEMBER_BYTES, "big")


def block_hash(member_bytes: bytes) -> int:
    return int.from_bytes(member_bytes, "big")


def touch_scores(hashes: Sequence[int], now_ms: float) -> dict[bytes, float]:
    """A prefix touched now: the head blocks get the newest scores, so that trimming a
    full set drops a prefix's tail first, as the engine's LRU frees it."""
    n = len(hashes)
    return {member(h): now_ms + (n - i) * 1e-3 for i, h in enumerate(hashes)}
