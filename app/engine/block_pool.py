"""The pool of KV blocks: ref counts, an LRU free queue, the prefix cache, KV events. Pure Python.

A block is free when no running request holds it (ref_cnt 0). A free block may still be cached
(it keeps its hash and tokens) until it is handed out again: allocation takes the least recently
freed block first and, if it was cached, evicts it from the prefix cache (BlockRemoved).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from app.kv_events.block_hash import BlockHash
from app.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is in the prefix cache
    token_ids: tuple[int, ...] | None = None  # the tokens it caches; a hit compares them


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # LRU order: the first entry is evicted (reused) first.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._subscribers: list[Callable[[KVEvent], None]] = []

    # -- events --------------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[KVEvent], None]) -> None:
        """Call `callback(event)` for every KV event from now on."""
        self._subscribers.append(callback)

    def _emit(self, event: KVEvent) -> None:
        for callback in self._subscribers:
            callback(event)

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (first = reused first)."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    # -- allocation ----------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n free blocks (LRU first), evicting any cached content; each gets ref_cnt 1."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        taken = []
        evicted: list[BlockHash] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = block.token_ids = None
            block.ref_cnt = 1
            taken.append(block)
        if evicted:
            self._emit(BlockRemoved(evicted))
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit on a free block takes it off the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; blocks reaching 0 join the free queue's tail in the given order."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    # -- prefix cache --------------------------------------------------------------------------
    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[BlockHash],
        token_chunks: Sequence[Sequence[int]],
        parent_hash: BlockHash | None,
    ) -> None:
        """Enter consecutive full blocks of one sequence into the prefix cache.

        A block whose hash is already cached (the same content computed twice, e.g. after an
        eviction broke a chain) stays uncached; the cached twin keeps serving hits.
        """
        if not self.enable_prefix_caching:
            return
        run_hashes: list[BlockHash] = []
        run_tokens: list[int] = []
        run_parent = parent_hash
        for block, block_hash, tokens in zip(blocks, block_hashes, token_chunks, strict=True):
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            if block_hash in self._cached:
                self._emit_stored(run_hashes, run_parent, run_tokens)
                run_hashes, run_tokens, run_parent = [], [], block_hash
                continue
            block.block_hash = block_hash
            block.token_ids = tuple(tokens)
            self._cached[block_hash] = block
            run_hashes.append(block_hash)
            run_tokens.extend(tokens)
        self._emit_stored(run_hashes, run_parent, run_tokens)

    def _emit_stored(self, hashes: list[BlockHash], parent: BlockHash | None, tokens: list[int]) -> None:
        if hashes:
            self._emit(BlockStored(hashes, parent, tokens, self.block_size))

    def snapshot_events(self) -> list[KVEvent]:
        """The prefix cache as events: AllBlocksCleared, then one BlockStored per cached block (its
        parent is not kept, so None): replayed by a consumer, they give exactly the cached set."""
        return [AllBlocksCleared()] + [BlockStored([b.block_hash], None, list(b.token_ids), self.block_size)
                                       for b in self._cached.values()]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible while no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = block.token_ids = None
        self._cached.clear()
        self._emit(AllBlocksCleared())
        return True
