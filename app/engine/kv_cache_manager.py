"""Blocks of each request: prefix-cache lookups, slot allocation, freeing. Pure Python.

The scheduler talks to this class only; the block pool's internals stay behind it.
"""

from __future__ import annotations

from app.engine.block_pool import BlockPool, KVBlock
from app.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self._num_cached_blocks: dict[str, int] = {}  # request id -> leading blocks already cached

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """Longest run of cached leading blocks and the number of tokens they hold.

        Capped one token short of the sequence, so the last token is always computed and yields
        the logits to sample from.
        """
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        bs = self.block_size
        hashes = seq.update_block_hashes(bs)
        max_hit_blocks = min(len(hashes), (seq.num_tokens - 1) // bs)
        hits: list[KVBlock] = []
        for i in range(max_hit_blocks):
            block = self.pool.get_cached_block(hashes[i], seq.token_slice(i * bs, (i + 1) * bs))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Give seq the blocks for num_new_tokens more tokens (after any prefix hits).

        Returns the newly allocated block ids, or None (changing nothing) if too few are free.
        """
        computed_blocks = computed_blocks or []
        bs = self.block_size
        num_computed = seq.num_scheduled_tokens + len(computed_blocks) * bs
        num_required = cdiv(num_computed + num_new_tokens, bs)
        num_new_blocks = max(0, num_required - len(seq.block_table) - len(computed_blocks))
        # Hits on free blocks take them off the free queue, so they count against it too.
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        seq.block_table.extend(b.block_id for b in computed_blocks)
        seq.block_table.extend(b.block_id for b in new_blocks)
        rid = seq.request_id
        self._num_cached_blocks[rid] = self._num_cached_blocks.get(rid, 0) + len(computed_blocks)
        return [b.block_id for b in new_blocks]

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Enter seq's full blocks whose K/V is written (its num_computed_tokens) into the prefix cache.

        Called after a step has run, never at allocation: a step that fails must not leave blocks
        in the cache (and announced to routers) that hold no K/V.
        """
        if not self.enable_prefix_caching:
            return
        num_tokens = seq.num_computed_tokens
        bs = self.block_size
        start = self._num_cached_blocks[seq.request_id]
        end = num_tokens // bs
        if end <= start:
            return
        hashes = seq.update_block_hashes(bs)
        blocks = [self.pool.blocks[i] for i in seq.block_table[start:end]]
        chunks = [seq.token_slice(i * bs, (i + 1) * bs) for i in range(start, end)]
        parent = hashes[start - 1] if start > 0 else None
        self.pool.cache_full_blocks(blocks, hashes[start:end], chunks, parent)
        self._num_cached_blocks[seq.request_id] = end

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks; its tail goes first in the free queue (evicted before its head)."""
        blocks = [self.pool.blocks[i] for i in reversed(seq.block_table)]
        self.pool.free_blocks(blocks)
        seq.block_table = []
        self._num_cached_blocks.pop(seq.request_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
