"""The capacity reference: the hit rate perfect affinity gets with the memory the fleet has.

The oracle (``bench.replay.oracle``) is an upper bound no fleet reaches: every block any
request ever computed stays cached forever, and anywhere. This reference keeps the
routing perfect but the memory real:

* **Affinity.** Every session is pinned to one worker for its whole life, so a later
  turn never misses because it was sent elsewhere.
* **Placement.** With hindsight (``capacity_reference``'s default): sessions spread so
  their peak contexts balance across workers (``hindsight_placement``), which no router
  can know when a session starts. Causally (``CapacityReference`` without a placement):
  a session's first request goes to the worker that has been sent the fewest prompt
  tokens so far (ties: the lowest index), and the session stays there. A router that
  moves a session once it has outgrown its worker can beat the causal placement: on
  the demo's agent workload ``ttft`` did, by a fifth. "Least resident" would not do:
  freed blocks keep their contents until evicted, so after warm-up every pool is full
  and all workers tie.
* **Memory.** Each worker is a ``BlockPool`` (``bench.sim.kv_cache``, the simulated
  engine's own pool) of ``kv_tokens // block_tokens`` blocks: full blocks cached under
  chained hashes; a hit is the longest cached run of leading full blocks within
  ``prompt_tokens - 1`` tokens; a finished request's blocks go to the LRU tail, last
  block first, so a prefix's tail is evicted before its head; allocation evicts from the
  LRU head. The request's KV covers its prompt and reply except the last generated
  token, which never had its KV computed (as ``PrefixOracle.observe_completion``).
* **Order and concurrency.** Requests are replayed one at a time in the order the run
  started them (or, asked, the trace's nominal order; see ``capacity_reference``); each
  occupies its blocks only momentarily (touch the hit, allocate the rest, register the
  full blocks, release). Requests in flight together in a real engine pin
  each other's blocks and can force extra evictions or preemptions; that is a
  second-order effect this reference leaves out. A request whose KV exceeds a worker's
  whole pool (an engine would reject it) caches only its first blocks.

Two ways in. ``CapacityReference.observe`` takes the prompt and reply bytes a replay
builds, in start order. ``capacity_reference`` needs no rerun: it rebuilds every prompt
from the trace plus a run's records (completion lengths, which turns failed, and start
order where asked), with synthetic replies of the recorded lengths. Hits depend only on which
prefixes requests share, and replies (engine-generated, different for every request)
are shared by no other session either way, so both give the same numbers. A failed
turn counts as never sent: it is left out of the totals, as in ``summarize``, and out of
the later prompts, as in ``Conversation``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from bench.replay.conversation import Conversation, tokenize_prompt, tokenize_reply
from bench.replay.result import RequestRecord
from bench.sim.kv_cache import BlockPool
from bench.textgen import generated_text
from bench.tokenizer import num_tokens
from bench.workloads.trace import Turn, group_sessions
from router.wire.blocks import DEFAULT_BLOCK_TOKENS, TOKEN_BYTES, token_block_hashes

RequestKey = tuple[str, int]  # (session, turn)


@dataclass(frozen=True, slots=True)
class ReferenceParams:
    """The fleet the reference models: ``workers`` engines of ``kv_tokens`` KV each."""

    workers: int
    kv_tokens: int  # per worker, as the engine's --kv-tokens
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if self.kv_tokens < self.block_tokens:
            raise ValueError("kv_tokens must hold at least one block")

    @property
    def num_blocks(self) -> int:
        """Blocks per worker, rounded down as the engine rounds them."""
        return self.kv_tokens // self.block_tokens


@dataclass(frozen=True, slots=True)
class ReferenceResult:
    params: ReferenceParams
    prompt_tokens: int
    hit_tokens: int
    hits: Mapping[RequestKey, int] = field(repr=False)  # cached tokens per request
    placement: Mapping[str, int] = field(repr=False)  # session -> worker index

    @property
    def hit_rate(self) -> float:
        """Token-weighted, like ``Summary.hit_rate``."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class CapacityReference:
    """Feed it every successful request in start order; read ``result()`` at the end."""

    __slots__ = ("_hits", "_load", "_placement", "_pools", "_prompt_tokens", "params")

    def __init__(self, params: ReferenceParams, placement: Mapping[str, int] | None = None) -> None:
        """``placement`` fixes sessions' workers in advance (see ``hindsight_placement``);
        sessions it does not name are placed as they arrive."""
        self.params = params
        self._pools = [
            BlockPool(params.num_blocks, params.block_tokens) for _ in range(params.workers)
        ]
        self._load = [0] * params.workers  # prompt tokens sent to each worker so far
        self._placement: dict[str, int] = dict(placement or {})
        self._hits: dict[RequestKey, int] = {}
        self._prompt_tokens = 0

    def worker_of(self, session: str) -> int:
        """The session's worker, placing it now if it is new."""
        worker = self._placement.get(session)
        if worker is None:
            worker = min(range(len(self._load)), key=self._load.__getitem__)
            self._placement[session] = worker
        return worker

    def observe(self, session: str, turn: int, prompt: bytes, reply: bytes) -> int:
        """Serve one finished request on its session's worker; returns its hit tokens.

        ``prompt`` is the tokenized prompt and ``reply`` the generated tokens (for the
        simulator, ``tokenize_prompt`` and ``tokenize_reply`` of what the replay sent and
        received).
        """
        worker = self.worker_of(session)
        prompt_tokens = num_tokens(prompt)
        hit = _serve(self._pools[worker], prompt, reply)
        self._load[worker] += prompt_tokens
        self._prompt_tokens += prompt_tokens
        self._hits[(session, turn)] = hit
        return hit

    def result(self) -> ReferenceResult:
        return ReferenceResult(
            params=self.params,
            prompt_tokens=self._prompt_tokens,
            hit_tokens=sum(self._hits.values()),
            hits=dict(self._hits),
            placement=dict(self._placement),
        )


def _serve(pool: BlockPool, prompt: bytes, reply: bytes) -> int:
    """One request on ``pool``, start to finish with nothing else running."""
    block_tokens = pool.block_tokens
    computed = (prompt + reply)[:-TOKEN_BYTES] if reply else prompt
    hashes = token_block_hashes(computed, block_tokens)
    hit = pool.cached_prefix(hashes, max(num_tokens(prompt) - 1, 0) // block_tokens)
    # Every block is free between requests, so the pool's size is the only limit.
    wanted = min(-(-num_tokens(computed) // block_tokens), pool.num_blocks)
    pool.touch(hit)
    blocks = hit + pool.allocate(wanted - len(hit))
    for index in range(len(hit), min(len(hashes), len(blocks))):
        pool.register(blocks[index], hashes[index])
    pool.release(blocks)
    return len(hit) * block_tokens


def synthetic_reply(session: str, turn: int, tokens: int) -> str:
    """A stand-in reply: ``tokens`` engine-like tokens, distinct per session and turn."""
    return generated_text(random.Random(f"kvrouter.reference/{session}/{turn}"), tokens)


def hindsight_placement(records: Iterable[RequestRecord], workers: int) -> dict[str, int]:
    """Sessions spread over ``workers`` knowing how large each grows: largest first, each
    to the worker with the fewest tokens placed so far (LPT), a session's size being its
    peak context (prompt + reply of its largest request). A router cannot know this when
    a session starts; placing by it makes the reference a limit rather than one more
    policy.
    """
    peak: dict[str, int] = {}
    for record in records:
        if record.ok:
            size = record.prompt_tokens + record.completion_tokens
            peak[record.session] = max(peak.get(record.session, 0), size)
    placed = [0] * workers
    placement: dict[str, int] = {}
    for session in sorted(peak, key=lambda s: (-peak[s], s)):
        worker = min(range(workers), key=placed.__getitem__)
        placement[session] = worker
        placed[worker] += peak[session]
    return placement


def capacity_reference(
    turns: Sequence[Turn],
    records: Iterable[RequestRecord],
    params: ReferenceParams,
    hindsight: bool = True,
    order: Literal["run", "trace"] = "run",
) -> ReferenceResult:
    """The reference for a finished run, from its trace and its records (no rerun);
    sessions placed by ``hindsight_placement``, or as they arrive without ``hindsight``.

    Successful records are served in the run's order (``order="run"``: start order) or
    in the trace's (``"trace"``: each turn at its nominal arrival, as an infinitely fast
    fleet would see them); ties by session, turn. Within a session both are turn order.
    The run's order is the default: on a closed-loop replay the fleet's latency sets how
    many sessions overlap (on the agent workload about three times as many as at zero
    latency), and that overlap is the cache pressure any placement meets. The trace's
    order is one yardstick for every router on a trace but, under load, a limit no
    fleet with real latency approaches. (The run's order has its own bias: a router
    that leaves sessions waiting in queues interleaves them less and raises its own
    reference; on the overloaded mix, cache_aware's was 32.2% against ttft's 24.7%.)
    """
    records = list(records)
    by_key = {(t.session, t.turn): t for t in turns}
    for record in records:
        if (record.session, record.turn) not in by_key:
            raise ValueError(f"record {record.session!r} turn {record.turn} is not in the trace")
    conversations = {s.id: Conversation(s.turns[0].system) for s in group_sessions(turns)}
    placement = hindsight_placement(records, params.workers) if hindsight else None
    reference = CapacityReference(params, placement)

    def when(record: RequestRecord) -> float:
        return by_key[(record.session, record.turn)].arrival if order == "trace" else record.start

    done = sorted((r for r in records if r.ok), key=lambda r: (when(r), r.session, r.turn))
    for record in done:
        turn = by_key[(record.session, record.turn)]
        conversation = conversations[record.session]
        messages = conversation.request(turn)
        reply = synthetic_reply(record.session, record.turn, record.completion_tokens)
        conversation.commit(messages, reply)
        reference.observe(
            record.session, record.turn, tokenize_prompt(messages), tokenize_reply(reply)
        )
    return reference.result()
