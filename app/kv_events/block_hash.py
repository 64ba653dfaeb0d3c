"""Chained hashes of full KV blocks. Pure Python; shared by the engine and the router.

hash(block i) = H(hash(block i-1), token ids of block i, extra keys), with a fixed root for the
first block. SHA-256 over a canonical byte encoding makes the value the same in every process
and on every machine (no Python hash(), no random seed), so a router can compute the hashes of a
prompt and look them up among the blocks a replica reported. Values are 64-bit unsigned ints:
they fit JSON, msgpack and vLLM's KV event schema; a prefix-cache hit in the engine also compares
the stored tokens, so a collision can never return wrong KV.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

BlockHash = int

_U64 = struct.Struct("<Q")

# The parent of a sequence's first block.
ROOT_BLOCK_HASH: BlockHash = int.from_bytes(hashlib.sha256(b"app.kv.block-hash.v1").digest()[:8], "little")


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[str | int] | None = None,
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256()
    h.update(struct.pack("<Q", ROOT_BLOCK_HASH if parent_hash is None else parent_hash))
    h.update(struct.pack("<I", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        for key in extra_keys:
            data = str(key).encode()
            h.update(b"s" if isinstance(key, str) else b"i")
            h.update(struct.pack("<I", len(data)))
            h.update(data)
    return int.from_bytes(h.digest()[:8], "little")


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str | int] | None = None,
    parent_hash: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block is not hashed)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    if not extra_keys:  # the same bytes as hash_block_tokens, packed once: 0.55 -> 0.3 ms for 3k tokens
        n = len(token_ids) // block_size * block_size
        data = array("q", token_ids[:n]).tobytes()
        length, step = struct.pack("<I", block_size), 8 * block_size
        parent = ROOT_BLOCK_HASH if parent_hash is None else parent_hash
        hashes = []
        for offset in range(0, 8 * n, step):
            h = hashlib.sha256(_U64.pack(parent))
            h.update(length)
            h.update(data[offset : offset + step])
            parent = int.from_bytes(h.digest()[:8], "little")
            hashes.append(parent)
        return hashes
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent_hash)
    return hashes
