"""A stored response's conversation as the router keeps it (router.index.stored_chain):
bounded per response and over all of them, and read from Redis as untrusted bytes."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from router.fleet.workers import Worker
from router.index.prefix import chain_seed, prefix_key
from router.index.stored_chain import MAX_CHAIN_BLOCKS, MAX_ENCODED_BYTES, StoredChain
from router.routing.response_owners import CHAIN_OVERHEAD_BYTES, Owner, ResponseOwners

BLOCK_BYTES = 64
CONTEXT = 0xC0FFEE


def chain_of(text: bytes, max_blocks: int = MAX_CHAIN_BLOCKS) -> StoredChain:
    key = prefix_key(text, BLOCK_BYTES, chain_seed("m"))
    return StoredChain.of(key, "text", BLOCK_BYTES, CONTEXT, max_blocks=max_blocks)


def test_a_chain_round_trips_through_its_encoding() -> None:
    chain = chain_of(b"x" * 1000)
    assert chain.whole and chain.blocks == 1000 // BLOCK_BYTES and len(chain.tail) == 1000 % 64
    assert StoredChain.decode(chain.encode()) == chain
    assert chain.key() == prefix_key(b"x" * 1000, BLOCK_BYTES, chain_seed("m"))
    tokens = StoredChain.of(chain.key(), "tokens", BLOCK_BYTES, CONTEXT)
    assert StoredChain.decode(tokens.encode()) == tokens


def test_a_long_conversation_keeps_its_first_blocks_and_is_cut() -> None:
    text = b"".join(b"%08d" % i for i in range(100))  # 800 bytes: 12 blocks and a tail
    whole = chain_of(text)
    cut = chain_of(text, max_blocks=5)
    assert not cut.whole and cut.tail == b"" and cut.blocks == 5
    assert cut.key().hashes == whole.key().hashes[:5]
    assert cut.total_bytes == len(text)  # its size still the conversation's
    assert StoredChain.decode(cut.encode()) == cut
    assert chain_of(text, max_blocks=12).whole  # at the bound, whole


def test_what_no_router_wrote_is_not_a_chain() -> None:
    encoded = chain_of(b"y" * 200).encode()
    for end in range(len(encoded)):  # every piece of one
        assert StoredChain.decode(encoded[:end]) is None
    header = struct.Struct("<2sBBBIQQQII")
    fields = list(header.unpack_from(encoded))
    body = encoded[header.size :]
    wrong = {
        0: b"xx",  # magic
        1: 2,  # a version this router does not know
        2: 2,  # keyed by neither text nor tokens
        3: 2,  # whole neither true nor false
        4: 0,  # no block size
        7: 10**6,  # a length its blocks do not make
        8: MAX_CHAIN_BLOCKS + 1,  # more blocks than kept
        9: BLOCK_BYTES,  # a tail of a whole block
    }
    for index, value in wrong.items():
        changed = [*fields]
        changed[index] = value
        assert StoredChain.decode(header.pack(*changed) + body) is None, index
    assert StoredChain.decode(encoded + b"\0") is None
    oversized = encoded + b"\0" * MAX_ENCODED_BYTES
    assert StoredChain.decode(oversized) is None


@given(st.binary(max_size=300))
def test_any_bytes_decode_to_a_chain_or_none(raw: bytes) -> None:
    chain = StoredChain.decode(raw)
    assert chain is None or StoredChain.decode(chain.encode()) == chain


def test_chains_are_bounded_by_their_bytes_and_go_before_their_owners() -> None:
    owner = Owner.of(Worker("w0", "http://127.0.0.1:1", 1000))
    chain = chain_of(b"z" * 6400)  # 100 blocks
    charge = chain.size_bytes + CHAIN_OVERHEAD_BYTES
    owners = ResponseOwners(max_entries=10, max_chain_bytes=3 * charge)
    for i in range(5):
        owners.remember(f"resp_{i}", owner, chain)
        assert owners.chain_bytes <= 3 * charge
    assert [owners.chain(f"resp_{i}") is not None for i in range(5)] == [False] * 2 + [True] * 3
    assert all(owners.get(f"resp_{i}") == owner for i in range(5))  # every owner kept
    owners.remember("resp_4", owner, chain)  # the same again: charged once
    assert owners.chain_bytes == 3 * charge
    owners.chain("resp_2")  # read: the youngest
    owners.remember("resp_5", owner, chain)
    assert owners.chain("resp_3") is None and owners.chain("resp_2") is not None
    # An owner dropped by the bound on entries takes its chain with it.
    small = ResponseOwners(max_entries=2)
    for i in range(3):
        small.remember(f"resp_{i}", owner, chain)
    assert small.chain("resp_0") is None and small.chain_bytes == 2 * charge
