"""The router's parts with plain values: prefix hashing, residency, leases, capture."""

from __future__ import annotations

import gc
import itertools
import random
from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from router.apis.capture import ChatCapture, CompletionCapture
from router.apis.request import ClientRequest, parse_request
from router.apis.sessions import SessionSources
from router.cli.serve import GC_YOUNG_THRESHOLD, tune_gc
from router.edge.relay import MAX_HELD_EVENT_BYTES, WholeEvents
from router.fleet.workers import Lease, Worker
from router.index.prefix import (
    CHAT_REPLY_HEADER,
    COMPLETION_REPLY_HEADER,
    ChainExtender,
    chain_seed,
)
from router.index.residency import LocalPrefixIndex, Residency

BLOCK = 16  # small blocks, so short texts span many of them
MODEL = "m"


def chat(messages: list[dict[str, Any]], **extra: Any) -> ClientRequest:
    raw = orjson.dumps({"model": MODEL, "messages": messages, **extra})
    return parse_request("chat", raw, BLOCK)


def completion(prompt: Any, **extra: Any) -> ClientRequest:
    raw = orjson.dumps({"model": MODEL, "prompt": prompt, **extra})
    return parse_request("completion", raw, BLOCK)


def pieces(text: str, sizes: Sequence[int]) -> list[str]:
    """``text`` cut into pieces of the given sizes, cycling through them."""
    out, i, k = [], 0, 0
    while i < len(text):
        out.append(text[i : i + sizes[k % len(sizes)]])
        i += sizes[k % len(sizes)]
        k += 1
    return out


# -- prefix ------------------------------------------------------------------------------

TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful assistant. " * 5},
    {"role": "user", "content": "Explain the roofline model in two sentences."},
    {"role": "assistant", "content": "Step time is the slower of compute and memory."},
    {"role": "user", "content": [{"type": "text", "text": "And for decode?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "content": "bandwidth bound", "tool_call_id": "c1"},
]


def test_appending_a_message_only_appends_hashes() -> None:
    keys = [chat(TURNS[: n + 1]).key for n in range(len(TURNS))]
    for shorter, longer in itertools.pairwise(keys):
        assert len(longer.hashes) > len(shorter.hashes)
        assert longer.hashes[: len(shorter.hashes)] == shorter.hashes
        assert longer.total_bytes > shorter.total_bytes
    # The partial tail is whatever follows the last full block.
    last = keys[-1]
    assert len(last.tail) == last.total_bytes - len(last.hashes) * BLOCK < BLOCK


def test_model_and_cache_salt_change_every_hash() -> None:
    base = chat(TURNS[:2]).key
    salted = chat(TURNS[:2], cache_salt="tenant-a").key
    other_salt = chat(TURNS[:2], cache_salt="tenant-b").key
    other_model = parse_request(
        "chat", orjson.dumps({"model": "m2", "messages": TURNS[:2]}), BLOCK
    ).key
    assert base.seed == chain_seed(MODEL) == chain_seed(MODEL, "")
    keys = [base, salted, other_salt, other_model]
    assert len({k.seed for k in keys}) == 4
    assert all(len(k.hashes) == len(base.hashes) > 3 for k in keys)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            assert not set(a.hashes) & set(b.hashes)


def test_the_session_key_comes_from_the_header_then_the_body() -> None:
    raw = orjson.dumps({"model": MODEL, "messages": TURNS[:2], "user": "u1"})

    def key(header: bytes | None, fields: Sequence[str]) -> str | None:
        sources = SessionSources(("header:x-session-id", *(f"body:{f}" for f in fields)))
        headers = {} if header is None else {b"x-session-id": header}
        return parse_request("chat", raw, BLOCK, headers, sources).session_key

    # Keys are kept as digests: the body's "u1" is the session a header "u1" names.
    assert key(None, ("session_id", "user")) == key(b"u1", ()) is not None
    assert key(b"h1", ("session_id", "user")) == key(b"h1", ()) != key(b"u1", ())
    assert key(None, ("session_id",)) is None


@pytest.mark.parametrize("sizes", [(1,), (3, 7), (5, 16, 1, 31), (1000,)])
def test_chain_extender_matches_the_next_turn(sizes: Sequence[int]) -> None:
    messages: list[dict[str, Any]] = [dict(m) for m in TURNS[:2]]
    reply = "Décodé: the KV cache ✓ grows by one token per step; " * 3
    request = chat(messages)
    extender = ChainExtender(request.key, BLOCK, CHAT_REPLY_HEADER)
    for piece in pieces(reply, sizes):
        extender.feed(piece)
    added = extender.finish()
    after = chat([*messages, {"role": "assistant", "content": reply}]).key
    assert added == list(after.hashes[len(request.key.hashes) :])
    assert len(added) >= len(reply.encode()) // BLOCK - 1
    # The turn after that (a new user message) extends the same chain.
    later = chat(
        [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "thanks, and prefill?"},
        ]
    ).key
    assert later.hashes[: len(request.key.hashes) + len(added)] == (*request.key.hashes, *added)


def test_chain_extender_with_an_empty_reply_adds_only_the_header() -> None:
    request = chat(TURNS[:2])
    extender = ChainExtender(request.key, BLOCK, CHAT_REPLY_HEADER)
    extender.feed("")
    after = chat([*TURNS[:2], {"role": "assistant", "content": ""}]).key
    assert extender.finish() == list(after.hashes[len(request.key.hashes) :])


def test_completion_text_continues_and_token_ids_do_not() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 4
    as_text = completion(text)
    assert as_text.record_reply
    assert completion([text]).key == as_text.key  # a batch of one is the prompt itself
    extender = ChainExtender(as_text.key, BLOCK, COMPLETION_REPLY_HEADER)
    for piece in pieces(" and runs away into the forest.", (2, 9)):
        extender.feed(piece)
    continued = completion(text + " and runs away into the forest.").key
    assert extender.finish() == list(continued.hashes[len(as_text.key.hashes) :])

    ids = list(range(100, 140))
    as_ids = completion(ids)
    assert not as_ids.record_reply
    assert completion([ids]).key == as_ids.key
    assert as_ids.key.total_bytes == 1 + 4 * len(ids)  # marker byte + 4 bytes an id
    changed = completion([*ids[:-1], 141]).key  # the last id ends in the last full block
    assert changed.hashes[:-1] == as_ids.key.hashes[:-1]
    assert changed.hashes[-1] != as_ids.key.hashes[-1]
    # The same characters as text and as ids never share a block.
    digits = completion("".join(chr(i) for i in ids))
    assert not set(digits.key.hashes) & set(as_ids.key.hashes)


# -- residency -----------------------------------------------------------------------------


def linear_prefix(held: Residency, hashes: Sequence[int]) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in held:
        n += 1
    return n


def test_residency_lru_holds_its_capacity_and_keeps_heads() -> None:
    r = Residency(4)
    assert r.touch([1, 2, 3, 4, 5, 6]) == [4, 3, 2, 1]  # only the head fits, tail first
    assert len(r) == 4 and r.longest_prefix([1, 2, 3, 4, 5, 6]) == 4
    assert r.touch([10, 11]) == [11, 10]
    # Blocks 3 and 4 were the least recently used: the prefix's tail goes, its head stays.
    assert len(r) == 4 and r.evictions == 2
    assert r.longest_prefix([1, 2, 3, 4]) == 2
    assert r.longest_prefix([10, 11]) == 2
    assert r.touch([1, 2]) == []  # re-touching refreshes, adds nothing
    r.touch([20])
    assert 11 not in r and 1 in r and 2 in r  # the refreshed head outlived chain 10-11's tail


def test_residency_binary_search_equals_a_linear_scan() -> None:
    rng = random.Random(7)
    for capacity in (3, 17, 64, 1000):
        held = Residency(capacity)
        # A tree of chains: a chain shares a random-length prefix with an earlier one.
        chains: list[list[int]] = [[]]
        next_id = 1
        for _ in range(300):
            parent = rng.choice(chains)
            chain = parent[: rng.randint(0, len(parent))]
            for _ in range(rng.randint(1, 12)):
                chain.append(next_id)
                next_id += 1
            chains.append(chain)
            if rng.random() < 0.7:
                held.touch(chain)
            assert len(held) <= capacity
            for query in rng.sample(chains, min(len(chains), 5)):
                assert held.longest_prefix(query) == linear_prefix(held, query)
    assert held.longest_prefix([]) == 0


def test_residency_forget_and_resize() -> None:
    r = Residency(10)
    r.touch([1, 2, 3, 4, 5])
    r.forget([4, 5, 99])
    assert len(r) == 3 and r.longest_prefix([1, 2, 3, 4, 5]) == 3
    r.touch([7, 8])
    r.resize(3)  # the least recently used go: chain 1-2-3's tail, then its head
    assert len(r) == 3 and r.capacity_blocks == 3 and r.evictions == 2
    assert r.longest_prefix([7, 8]) == 2 and r.longest_prefix([1, 2, 3]) == 1
    r.resize(100)
    assert len(r) == 3
    with pytest.raises(ValueError):
        r.resize(0)
    with pytest.raises(ValueError):
        Residency(0)


def test_local_index_per_worker() -> None:
    index = LocalPrefixIndex()
    index.add_worker("a", 8)
    index.add_worker("b", 2)
    assert index.touch("a", [1, 2, 3]) == [3, 2, 1]
    assert index.touch("b", [1, 2, 3]) == [2, 1]
    assert index.match("a", [1, 2, 3, 4]) == 3 and index.match("b", [1, 2, 3]) == 2
    assert index.match("nobody", [1]) == 0 and index.touch("nobody", [1]) == []
    assert index.size() == 5
    index.resize_worker("a", 1)
    assert index.resident_blocks("a") == 1 and index.match("a", [1, 2]) == 1
    index.forget("b", [1])
    assert index.match("b", [1, 2]) == 0
    index.remove_worker("a")
    assert index.resident_blocks("a") == 0 and index.size() == 1


def test_reserved_blocks_match_but_evict_nothing_until_recorded() -> None:
    index = LocalPrefixIndex()
    index.add_worker("a", 4)
    index.touch("a", [10, 11, 12, 13])
    index.reserve("a", [1, 2, 3, 4, 5, 6])  # a prompt larger than the worker's LRU
    index.reserve("a", [1, 2])  # its sibling, in flight too
    assert index.match("a", [1, 2, 3, 9]) == 3 and index.match("a", [10, 11]) == 2
    assert index.resident_blocks("a") == 4 and index.size() == 4  # nothing pushed out
    index.release("a", [1, 2, 3, 4, 5, 6])  # refused: what it reserved goes
    assert index.match("a", [1, 2, 3]) == 2  # the sibling's reservation stays
    index.release("a", [1, 2])
    assert index.match("a", [1]) == 0 and index.reserved_blocks("a") == 0
    assert index.oldest_first("a") == [13, 12, 11, 10]  # the LRU as it was
    index.reserve("a", [1, 2])
    index.purge("a")  # the worker restarted: its reservations go with its cache
    assert index.match("a", [1]) == 0
    index.release("a", [1, 2])  # the in-flight request ends after the purge
    assert index.reserved_blocks("a") == 0
    index.reserve("nobody", [1])
    assert index.match("nobody", [1]) == 0


# -- lease -------------------------------------------------------------------------------


def test_lease_accounting_is_exact() -> None:
    worker = Worker("w", "http://w", 1000)
    first = Lease(worker, tokens=100, prefill_tokens=60)
    second = Lease(worker, tokens=50, prefill_tokens=50)
    assert (
        worker.outstanding_requests,
        worker.outstanding_tokens,
        worker.queued_prefill_tokens,
    ) == (2, 150, 110)
    first.prefill_done()
    first.prefill_done()
    assert worker.queued_prefill_tokens == 50 and worker.outstanding_requests == 2
    first.release()
    first.release()
    assert first.released
    assert (
        worker.outstanding_requests,
        worker.outstanding_tokens,
        worker.queued_prefill_tokens,
    ) == (1, 50, 50)
    second.release()  # release without a first byte also ends the queued prefill
    second.prefill_done()
    second.release()
    assert (
        worker.outstanding_requests,
        worker.outstanding_tokens,
        worker.queued_prefill_tokens,
    ) == (0, 0, 0)


# -- capture -------------------------------------------------------------------------------


def sse(*events: dict[str, Any]) -> bytes:
    body = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    return body + b"data: [DONE]\n\n"


def delta(text: str) -> dict[str, Any]:
    return {"id": "x", "choices": [{"index": 0, "delta": {"content": text}}]}


USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 3,
    "prompt_tokens_details": {"cached_tokens": 32},
}


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 11, 64, 10_000])
def test_capture_reads_sse_split_anywhere(cut: int) -> None:
    reply = "héllo, wörld ✓ and more"
    events: list[dict[str, Any]] = [
        {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    ]
    events += [delta(p) for p in pieces(reply, (4, 1, 6))]
    events.append({"id": "x", "choices": [], "usage": USAGE})
    body = sse(*events)
    key = chat(TURNS[:2]).key
    capture = ChatCapture(ChainExtender(key, BLOCK))
    for i in range(0, len(body), cut):
        capture.feed_stream(body[i : i + cut])  # cuts through lines and UTF-8 characters
    expected = ChainExtender(key, BLOCK)
    expected.feed(reply)
    assert capture.reply_hashes() == expected.finish() != []
    assert (capture.prompt_tokens, capture.cached_tokens, capture.completion_tokens) == (40, 32, 3)
    assert (capture.prompt_tokens, capture.cached_tokens) == (40, 32)
    assert not capture.errored and not capture.broken


def test_capture_error_event_marks_errored() -> None:
    capture = ChatCapture(ChainExtender(chat(TURNS[:2]).key, BLOCK))
    body = sse(
        delta("partial reply " * 4),
        {"error": {"message": "boom", "type": "server_error", "code": 500}},
    )
    capture.feed_stream(body[:30])
    capture.feed_stream(body[30:])
    assert capture.errored
    assert capture.reply_hashes() == []


def test_capture_whole_responses_and_completions() -> None:
    key = chat(TURNS[:2]).key
    whole = ChatCapture(ChainExtender(key, BLOCK))
    whole.feed_whole(
        orjson.dumps(
            {
                "choices": [{"message": {"role": "assistant", "content": "a full reply"}}],
                "usage": USAGE,
            }
        )
    )
    expected = ChainExtender(key, BLOCK)
    expected.feed("a full reply")
    assert whole.reply_hashes() == expected.finish()
    assert whole.cached_tokens == 32

    text = completion("Once upon a time " * 3).key
    streamed = CompletionCapture(ChainExtender(text, BLOCK, COMPLETION_REPLY_HEADER))
    streamed.feed_stream(
        sse({"choices": [{"text": "there was a "}]}, {"choices": [{"text": "router."}]})
    )
    done = ChainExtender(text, BLOCK, COMPLETION_REPLY_HEADER)
    done.feed("there was a router.")
    assert streamed.reply_hashes() == done.finish()
    assert streamed.prompt_tokens is None and streamed.cached_tokens is None


def test_capture_gives_up_on_garbage_and_tool_calls() -> None:
    key = chat(TURNS[:2]).key
    garbage = ChatCapture(ChainExtender(key, BLOCK))
    garbage.feed_stream(b"data: {not json\n\n")
    assert garbage.broken and garbage.reply_hashes() == []
    tools = ChatCapture(ChainExtender(key, BLOCK))
    tools.feed_stream(sse({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}))
    assert tools.reply_hashes() == [] and tools.broken  # a tool call that never got a name
    no_extender = ChatCapture(None)
    no_extender.feed_stream(sse(delta("x" * 100)))
    assert no_extender.reply_hashes() == []


def test_a_relayed_stream_is_cut_only_at_event_boundaries() -> None:
    stream = b'data: {"a":1}\n\ndata: {"b":2}\r\n\r\n: keep-alive\n\ndata: [DONE]\n\n'
    for size in (1, 2, 3, 7, 16, len(stream)):
        events, sent = WholeEvents(), []
        for start in range(0, len(stream), size):
            whole = events.cut(stream[start : start + size])
            assert whole.endswith((b"\n\n", b"\r\n\r\n")) or not whole, (size, whole)
            sent.append(whole)
        assert b"".join(sent) == stream and events.rest() == b""
    events = WholeEvents()
    assert events.cut(b'data: {"a":1}\n\ndata: {"b"') == b'data: {"a":1}\n\n'
    assert events.rest() == b'data: {"b"'  # a stream the worker closed in mid-event
    endless = b"data: " + b"x" * MAX_HELD_EVENT_BYTES
    assert events.cut(endless[:100]) == b"" and events.cut(endless[100:]) == endless
    assert events.rest() == b""  # an event that never ends is passed on, not held


def test_the_served_router_collects_young_garbage_less_often() -> None:
    saved = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD > saved[0]
        assert gc.get_freeze_count() > 0  # start-up's objects are out of every collection
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)


def test_migrating_onto_a_worker_that_holds_entries_merges_them_within_its_capacity() -> None:
    index = LocalPrefixIndex()
    index.add_worker("dead", 100)
    index.add_worker("restored", 6)
    index.touch("dead", [1, 2, 3, 4, 5])  # a session's chain, as the dead worker held it
    index.touch("restored", [10, 11, 12])  # computed on the target since it came up
    assert index.migrate("dead", "restored") == 5
    # The target's own entries are the newest; of the migrated ones, the oldest (a chain
    # is touched tail first) go to keep it within capacity: the head stays.
    assert index.oldest_first("restored") == [3, 2, 1, 12, 11, 10]
    assert index.match("restored", [1, 2, 3, 4, 5]) == 3
    assert index.match("restored", [10, 11, 12]) == 3
    assert index.oldest_first("dead") == []


def test_what_a_worker_held_at_a_checkpoint_is_what_it_has_held_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter([100.0, 200.0, 300.0, 400.0])
    monkeypatch.setattr("router.index.residency.wall_clock", lambda: next(clock))
    index = LocalPrefixIndex()
    index.add_worker("w", 2)
    index.touch("w", [1, 2])  # at 100
    index.touch("w", [1])  # at 200: touched again, held since 100
    index.touch("w", [3])  # at 300: evicts 2
    index.touch("w", [2])  # at 400: back, evicting 1; not held since 100
    assert index.oldest_first("w") == [3, 2]
    assert index.held_at("w", 150.0) == []
    assert index.held_at("w", 350.0) == [3]
    assert index.held_at("w") == [3, 2]
