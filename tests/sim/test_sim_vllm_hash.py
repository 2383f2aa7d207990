"""The simulated engine's block hashes are vLLM 0.33's: the vectors below were computed by
vLLM 0.33.0's own ``vllm/utils/hashing.py`` (loaded from its wheel) for the same inputs."""

from __future__ import annotations

import pytest

from bench.sim.vllm_hash import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    block_extra_keys,
    event_extra_keys,
    external_hash,
    none_hash_seed,
)

VECTORS = {
    "sha256": (
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798",
        "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629",
        "255b152c89e763273cf1498dce0dfd4efdf44000fe683cd2af1845b5b8426a35",
        "9df30c50cfdda25489f10aa1baec90f7d8e28f077a4831a28b13cc4e07959a73",
        "8f995978c48967714d1c4b239d0d87996a2b087980037bef700ead42eecc754c",
    ),
    "sha256_cbor": (
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
        "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
        "4e31e1ced73eb044a95997f0109d0ddab3d9145878214f1a0ee37c048b397859",
        "8ace60b7a0cfd3631aca19fbadcec6f5f9e11fd42452a0f314626d2d23c47b5f",
        "7292412b7aee6c72390673c639cb26bbadd61da0cb7af52fea097bf4c7b340b2",
    ),
}


@pytest.mark.parametrize("algorithm", sorted(VECTORS))
def test_block_hashes_are_vllm_033s(algorithm: str) -> None:
    none, first, second, salted, lora_salted, seeded = VECTORS[algorithm]
    hasher = BlockHasher(algorithm, DEFAULT_NONE_HASH_SEED)
    assert hasher.none_hash.hex() == none
    b0 = hasher.block(None, range(16))
    assert b0.hex() == first
    assert hasher.block(b0, range(16, 32)).hex() == second
    assert hasher.block(None, range(16), block_extra_keys(0, "tenant-a")).hex() == salted
    keys = block_extra_keys(0, "t", ("sql", "/adapters/sql"))
    assert hasher.block(None, range(16), keys).hex() == lora_salted
    assert BlockHasher(algorithm, "12345").none_hash.hex() == seeded


@pytest.mark.parametrize(
    ("algorithm", "seed_hash", "block"),
    [
        ("xxhash", "dc45d051a0062f6dfadd06f4455350e5", "9321d365bdf43daa6b3c31f3c605afa6"),
        ("xxhash_cbor", "590402640c85269766fbb87c28a2165c", "cf93bbbc66aee840802ded3fad67499c"),
    ],
)
def test_xxhash_algorithms_are_vllm_033s(algorithm: str, seed_hash: str, block: str) -> None:
    hasher = BlockHasher(algorithm, "7")
    assert hasher.none_hash.hex() == seed_hash
    assert hasher.block(None, [1, 2, 3, 4]).hex() == block


def test_the_seed_is_pythonhashseed_else_fixed_for_sha256_and_random_for_xxhash() -> None:
    assert none_hash_seed("sha256", {"PYTHONHASHSEED": "0"}) == "0"
    assert none_hash_seed("sha256_cbor", {}) == DEFAULT_NONE_HASH_SEED
    assert none_hash_seed("xxhash", {}) != none_hash_seed("xxhash", {})
    assert none_hash_seed("xxhash_cbor", {"PYTHONHASHSEED": "3"}) == "3"


def test_the_salt_keys_only_the_first_block_and_events_carry_it_untagged() -> None:
    assert block_extra_keys(1, "tenant-a") is None
    assert block_extra_keys(0, None) is None
    keys = block_extra_keys(0, "t", ("sql", "/a"))
    assert event_extra_keys(keys) == ("sql", "t")
    assert event_extra_keys(None) is None


def test_events_carry_bytes_or_their_low_64_bits() -> None:
    digest = bytes(range(32))
    assert external_hash(digest) == digest
    assert external_hash(digest, as_int=True) == int.from_bytes(digest[-8:], "big")


def test_an_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="md5"):
        BlockHasher("md5")
