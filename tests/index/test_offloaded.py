"""A worker's CPU tier as its engine announces it: stores with their tokens or by hash
alone, removals from either tier leaving the other's copy, the continuation a request
whose GPU match stops short would load back, and the index's exact residency kept whole
through a purge."""

from __future__ import annotations

from router.index.events import AllBlocksCleared, BlockRemoved, BlockStored
from router.index.exact import ExactResidency
from router.index.residency import LocalPrefixIndex, Residency
from tests.kv_publisher import BLOCK, router_hashes, tokens

CAPACITY = 1000


def on(medium: str, ids: list[int], first: int, parent: int | None = None) -> BlockStored:
    """Blocks of ``ids`` with engine hashes ``first``, ``first + 1``, ... on ``medium``."""
    count = len(ids) // BLOCK
    return BlockStored(tuple(range(first, first + count)), parent, tuple(ids), BLOCK, None, medium)


def chunks(
    ids: list[int], first: int, blocks: int = 1, parent: int | None = None
) -> list[BlockStored]:
    """``ids`` stored to the CPU tier as the connector announces it: one event a chunk of
    ``blocks`` blocks, each with its parent (the first chunk's: ``parent``)."""
    size = blocks * BLOCK
    return [
        BlockStored(
            tuple(range(first + i // BLOCK, first + (i + size) // BLOCK)),
            first + i // BLOCK - 1 if i else parent,
            tuple(ids[i : i + size]),
            BLOCK,
            None,
            "CPU",
        )
        for i in range(0, len(ids), size)
    ]


def by_hash(*engine_hashes: int) -> BlockStored:
    """The offloading connector's default CPU store: the hash alone."""
    return BlockStored(engine_hashes, None, (), 0, None, "CPU")


def both(residency: ExactResidency, ids: list[int]) -> tuple[int, int]:
    """The GPU's match of ``ids``, and the CPU tier's continuation of it."""
    hashes = router_hashes(ids)
    gpu = residency.longest_prefix(hashes, {})
    return gpu, residency.offloaded.continuation(hashes, gpu)


def test_a_block_evicted_from_the_gpu_is_still_on_the_cpu_until_the_tier_drops_it() -> None:
    residency = ExactResidency(CAPACITY, "m", ttl_s=5.0)
    a = tokens(1, 4)
    residency.apply(0, [on("GPU", a, 10), *chunks(a, 10)])
    assert both(residency, a) == (4, 0)
    residency.apply(0, [BlockRemoved((12, 13), "GPU")])
    assert both(residency, a) == (2, 2)
    assert len(residency) == 2 and len(residency.offloaded) == 4
    residency.apply(0, [BlockRemoved((13,), "CPU")])
    assert both(residency, a) == (2, 1)
    residency.apply(0, [BlockRemoved((10, 11), "CPU")])  # the GPU's copies stay
    assert both(residency, a) == (2, 1)


def test_placeholders_are_named_as_the_gpu_named_their_blocks() -> None:
    residency = ExactResidency(CAPACITY, "m", ttl_s=5.0)
    a = tokens(1, 3)
    residency.apply(0, [on("GPU", a, 10), by_hash(10, 11, 12)])
    residency.apply(0, [BlockRemoved((10, 11, 12), "GPU")])
    assert both(residency, a) == (0, 3)
    assert (residency.offloaded.stores, residency.offloaded.described) == (1, 0)
    residency.apply(0, [by_hash(99)])  # a block the GPU never announced
    assert residency.offloaded.unnamed == 1
    assert len(residency.offloaded) == 3


def test_a_store_whose_parent_only_the_other_tier_holds_is_named() -> None:
    residency = ExactResidency(CAPACITY, "m", ttl_s=5.0)
    a = tokens(1, 4)
    head, tail = a[: 2 * BLOCK], a[2 * BLOCK :]
    residency.apply(0, [on("GPU", head, 10), *chunks(head, 10)])
    residency.apply(0, [BlockRemoved((10, 11), "GPU")])
    # The head is read back from CPU and the tail computed: the GPU announces the tail
    # with the head's last block as parent, which only the CPU tier's chains still name.
    residency.apply(0, [on("GPU", tail, 12, parent=11)])
    hashes = router_hashes(a)
    assert residency.longest_prefix(hashes, {}) == 0  # its head is not on the GPU
    assert hashes[2] in residency and hashes[3] in residency
    # And a CPU store whose parent only the GPU names:
    b = tokens(2, 2)
    residency.apply(0, [on("GPU", b[:BLOCK], 30), *chunks(b[BLOCK:], 31, parent=30)])
    assert router_hashes(b)[1] in residency.offloaded


def test_a_reset_of_the_gpu_cache_keeps_the_cpu_tier_and_a_lost_stream_loses_both() -> None:
    residency = ExactResidency(CAPACITY, "m", ttl_s=5.0)
    a = tokens(1, 2)
    residency.apply(0, [on("GPU", a, 10), *chunks(a, 10)])
    residency.apply(0, [AllBlocksCleared()])
    assert both(residency, a) == (0, 2)
    residency.clear_rank(0)
    assert both(residency, a) == (0, 0)


def test_the_index_answers_for_the_cpu_tier_of_exact_workers_only() -> None:
    index = LocalPrefixIndex()
    index.add_worker("w", CAPACITY)
    a = tokens(1, 3)
    hashes = router_hashes(a)
    index.touch("w", hashes)
    assert index.offloaded_continuation("w", hashes, 0) == 0
    assert index.offloaded_tier("w") is None
    index.make_exact("w", "m", 5.0)
    index.apply_events("w", 0, [on("GPU", a, 10), *chunks(a, 10), BlockRemoved((12,), "GPU")])
    assert index.match("w", hashes) == 2
    assert index.offloaded_continuation("w", hashes, 2) == 1
    assert index.offloaded_blocks("w") == 3
    index.purge("w")
    assert index.offloaded_continuation("w", hashes, 0) == 0


def test_a_purged_exact_worker_keeps_the_routers_block_size() -> None:
    """Before, a purge (an engine restart) rebuilt the residency without the router's
    block size: an engine of 32-token blocks was then named by one hash a block, which
    no request's 16-token key matched, for as long as the router ran."""
    index = LocalPrefixIndex()
    index.add_worker("w", CAPACITY)
    index.make_exact("w", "m", 5.0, block_tokens=BLOCK)
    a = tokens(1, 4)
    index.purge("w", started_at=1.0)
    index.apply_events("w", 0, [_two_block(a)])
    assert index.match("w", router_hashes(a)) == 4


def _two_block(ids: list[int]) -> BlockStored:
    """``ids`` as an engine of twice the router's block size announces them."""
    return BlockStored((10, 11), None, tuple(ids), 2 * BLOCK, None, "GPU")


def test_an_approximate_workers_tier_is_modelled_written_through_and_lru() -> None:
    residency = Residency(4, offload_blocks=10)
    a, b, c = router_hashes(tokens(1, 4)), router_hashes(tokens(2, 4)), router_hashes(tokens(3, 4))
    residency.touch(a)
    residency.touch(b)  # a leaves the modelled GPU, not the tier
    assert residency.longest_prefix(a) == 0
    assert residency.offloaded is not None
    assert residency.offloaded.continuation(a, 0) == 4
    residency.touch(c)  # 12 blocks for a tier of 10: a's tail goes first
    assert residency.offloaded.continuation(a, 0) == 2
    residency.forget(c)
    assert residency.offloaded.continuation(c, 0) == 0
    assert Residency(4).offloaded is None


def test_the_index_keeps_a_workers_modelled_tier_through_a_purge_and_exact_mode() -> None:
    index = LocalPrefixIndex()
    index.add_worker("w", 4, offload_blocks=10)
    a, b = router_hashes(tokens(1, 4)), router_hashes(tokens(2, 4))
    index.touch("w", a)
    index.touch("w", b)
    assert (index.match("w", a), index.offloaded_continuation("w", a, 0)) == (0, 4)
    assert index.offloaded_modelled("w") and index.offloaded_blocks("w") == 8
    index.purge("w")
    assert index.offloaded_blocks("w") == 0 and index.offloaded_modelled("w")
    index.make_exact("w", "m", 5.0)
    assert not index.offloaded_modelled("w")  # the engine announces its own now
    index.make_approximate("w")
    assert index.offloaded_modelled("w")


def test_a_chunk_of_several_blocks_is_loaded_whole_or_not_at_all() -> None:
    """Offloaded in chunks of two blocks, a prefix is read back from the chunk holding the
    GPU hit's end, whole chunks only: a chunk missing a block, or cut by the prompt's
    end, is not."""
    residency = ExactResidency(CAPACITY, "m", ttl_s=5.0)
    a = tokens(1, 6)
    residency.apply(0, [on("GPU", a, 10), *chunks(a, 10, blocks=2)])
    assert residency.offloaded.chunk_blocks == 2
    residency.apply(0, [BlockRemoved((11, 12, 13, 14, 15), "GPU")])
    hashes = router_hashes(a)
    assert residency.longest_prefix(hashes, {}) == 1
    # From the chunk [0, 2) holding block 1: all three chunks, to block 6.
    assert residency.offloaded.continuation(hashes, 1) == 5
    assert residency.offloaded.continuation(hashes[:5], 1) == 3  # [4, 6) cut by the end
    residency.apply(0, [BlockRemoved((13,), "CPU")])  # chunk [2, 4) loses a block
    assert residency.offloaded.continuation(hashes, 1) == 0  # one block: less than a chunk
    assert residency.offloaded.continuation(hashes, 0) == 2
