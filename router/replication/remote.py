"""What other replicas wrote to Redis, read as untrusted input.

Anything in Redis may have been written by another version of kvrouter, by hand, or by
something that is not kvrouter at all. A value that does not parse, or parses to a
number no replica could have sent (negative, not finite, absurdly large), is skipped and
counted (``kvrouter_redis_bad_entries_total{kind}``); the first of each kind is logged.
One bad entry never costs the others.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter

from router.replication.keys import MEMBER_BYTES, block_hash

log = logging.getLogger(__name__)

BAD_ENTRY_KINDS = ("load", "rate", "stream", "residency", "replica", "owner", "chain", "type")
# Far beyond any real figure (a worker's outstanding tokens, a prefill rate), far below
# what would overflow a sum of them.
MAX_COUNT = 1 << 48
MAX_TOKENS_PER_S = 1e9
LOAD_FIELDS = 4  # requests, tokens, recent demand, queued prefill
MIN_LOAD_FIELDS = 2  # a replica of an older version sends the first two only


class BadEntries:
    """Counts and logs (once a kind) what other replicas wrote that could not be used."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter(
            "kvrouter_redis_bad_entries",
            "Entries in Redis skipped because they could not be read as another replica "
            "would have written them, by kind: load, rate, stream (an index change), "
            "residency (a block of a worker's shared set), replica (a name in the register "
            "of live replicas), chain (a stored response's conversation), type (a key "
            "holding another type than kvrouter keeps there: deleted).",
            ["kind"],
            registry=registry,
        )
        for kind in BAD_ENTRY_KINDS:
            self.counter.labels(kind)
        self._logged: set[str] = set()

    def skipped(self, kind: str, what: object, count: int = 1) -> None:
        self.counter.labels(kind).inc(count)
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(
                "skipped a %s entry in Redis that no replica could have written: %.200r "
                "(further ones are only counted: kvrouter_redis_bad_entries_total)",
                kind,
                what,
            )


def parse_load(value: bytes) -> tuple[int, int, int, int] | None:
    """A replica's load on one worker: requests, tokens, demand, queued prefill."""
    try:  # a newer replica may send more fields after these
        parts = [int(x) for x in value.split(b",", LOAD_FIELDS)[:LOAD_FIELDS]]
    except ValueError:
        return None
    if not MIN_LOAD_FIELDS <= len(parts) <= LOAD_FIELDS:
        return None
    if any(not 0 <= part <= MAX_COUNT for part in parts):
        return None
    requests, tokens, demand, queued = (*parts, 0, 0)[:LOAD_FIELDS]
    return requests, tokens, demand, queued


def parse_rate(value: bytes) -> tuple[float, int] | None:
    """A replica's learned prefill rate (tokens/s) and the samples behind it."""
    try:
        rate_text, samples_text = value.split(b",")
        rate, samples = float(rate_text), int(samples_text)
    except ValueError:
        return None
    if not (math.isfinite(rate) and 0 < rate <= MAX_TOKENS_PER_S and 0 <= samples <= MAX_COUNT):
        return None
    return rate, samples


def block_hashes(members: Iterable[bytes], bad: BadEntries) -> list[int]:
    """The block hashes of a worker's shared residency set; members that are not one
    are counted and left out."""
    hashes: list[int] = []
    wrong: list[bytes] = []
    for member in members:
        if len(member) == MEMBER_BYTES:
            hashes.append(block_hash(member))
        else:
            wrong.append(member)
    if wrong:
        bad.skipped("residency", wrong[0], len(wrong))
    return hashes
