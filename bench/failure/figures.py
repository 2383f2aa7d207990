"""What a worker failure cost, read from a replay's records (pure; ``bench/failure/run.py``).

All times are simulated seconds since the replay started, as in the records. ``at`` is
the moment the worker was killed (in the run without a failure: the moment it would
have been).

- *Affected sessions*: those whose last request started before ``at`` was served by the
  killed worker (a request that started before ``at`` and failed with it counts: it was
  on that worker).
- *Next turns*: an affected session's first ``count`` requests that start at or after
  ``at``; their TTFT percentiles are taken over the successful ones.
- *Hit rate over a window*: cached over prompt tokens of the successful requests that
  start inside it (token-weighted, as ``bench.replay.result.summarize``).
- *Re-prefilled tokens*: over the affected sessions' successful requests that start at
  or after ``at``, the prefilled tokens (prompt minus cached) less those of the same
  (session, turn) in the run without a failure; pairs that failed in either run are
  left out. The turn that was in flight at the kill fails and is left out of its
  conversation, so the next turn's prompt is that much shorter than the baseline's.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from bench.replay.result import RequestRecord, percentile


def prefilled(record: RequestRecord) -> int:
    """Tokens the engine computed for this prompt: prompt minus cached."""
    return max(0, record.prompt_tokens - record.cached_tokens)


def affected_sessions(records: Sequence[RequestRecord], worker: str, at: float) -> frozenset[str]:
    """Sessions whose last request started before ``at`` (naming a worker) went to
    ``worker``."""
    last: dict[str, RequestRecord] = {}
    for record in records:
        if record.start >= at or record.worker is None:
            continue
        seen = last.get(record.session)
        if seen is None or (record.start, record.turn) > (seen.start, seen.turn):
            last[record.session] = record
    return frozenset(s for s, r in last.items() if r.worker == worker)


def turns_after(
    records: Sequence[RequestRecord],
    sessions: Collection[str],
    at: float,
    count: int | None = None,
) -> list[RequestRecord]:
    """Each of ``sessions``' first ``count`` (None: all) requests that start at or after
    ``at``, by start time."""
    by_session: dict[str, list[RequestRecord]] = {}
    for record in sorted(records, key=lambda r: (r.start, r.turn)):
        if record.session in sessions and record.start >= at:
            by_session.setdefault(record.session, []).append(record)
    chosen = [r for rs in by_session.values() for r in (rs if count is None else rs[:count])]
    return sorted(chosen, key=lambda r: (r.start, r.session, r.turn))


@dataclass(frozen=True, slots=True)
class TtftSpread:
    p50: float | None
    p99: float | None
    requests: int  # successful requests with a TTFT


def ttft_of(records: Sequence[RequestRecord]) -> TtftSpread:
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    return TtftSpread(percentile(ttfts, 50), percentile(ttfts, 99), len(ttfts))


def next_turns_ttft(
    records: Sequence[RequestRecord], sessions: Collection[str], at: float, count: int = 3
) -> TtftSpread:
    """TTFT p50/p99 of ``sessions``' next ``count`` turns from ``at``."""
    return ttft_of(turns_after(records, sessions, at, count))


def hit_rate_between(records: Sequence[RequestRecord], start: float, end: float) -> float | None:
    """Token-weighted hit rate of the successful requests starting in [start, end);
    None: none did."""
    ok = [r for r in records if r.ok and start <= r.start < end]
    prompt = sum(r.prompt_tokens for r in ok)
    return sum(r.cached_tokens for r in ok) / prompt if prompt else None


@dataclass(frozen=True, slots=True)
class Reprefill:
    tokens: int  # prefilled in this run less in the baseline, over the pairs
    pairs: int  # (session, turn) pairs counted


def reprefilled_tokens(
    records: Sequence[RequestRecord],
    baseline: Sequence[RequestRecord],
    sessions: Collection[str],
    at: float,
) -> Reprefill:
    """Tokens ``sessions`` prefilled after ``at`` beyond what the same turns prefilled
    in ``baseline`` (the run without a failure)."""
    base = {(r.session, r.turn): r for r in baseline if r.ok}
    tokens = pairs = 0
    for record in turns_after(records, sessions, at):
        other = base.get((record.session, record.turn))
        if not record.ok or other is None:
            continue
        tokens += prefilled(record) - prefilled(other)
        pairs += 1
    return Reprefill(tokens, pairs)


def hit_rate_buckets(
    records: Sequence[RequestRecord], width: float, origin: float = 0.0
) -> list[tuple[float, float | None]]:
    """(bucket start, hit rate) for ``width``-second buckets, one starting at
    ``origin`` (e.g. the kill), that cover 0 to the last request's start; None where
    no request succeeded."""
    if not records:
        return []
    end = max(r.start for r in records)
    first = origin % width - (width if origin % width else 0.0)
    count = math.floor((end - first) / width) + 1
    starts = [first + i * width for i in range(count)]
    return [(t, hit_rate_between(records, t, t + width)) for t in starts]
