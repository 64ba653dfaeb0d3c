"""Block pool and KV cache manager, step by step with exact block ids and events."""

import pytest

from app.engine.block_pool import BlockPool, NoFreeBlocksError
from app.engine.kv_cache_manager import KVCacheManager
from app.engine.sampling_params import SamplingParams
from app.engine.sequence import Sequence
from app.kv_events.block_hash import hash_request_tokens
from app.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored, event_from_dict, event_to_dict


def seq(rid, tokens):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def test_free_queue_lru_order_and_ref_counts():
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(2)
    assert [x.block_id for x in a + b] == [0, 1, 2, 3]
    assert pool.free_block_ids() == [4]
    pool.free_blocks(reversed(b))  # tail first
    assert pool.free_block_ids() == [4, 3, 2]
    pool.touch([b[0]])  # a hit on a free block takes it off the queue
    assert b[0].ref_cnt == 1 and pool.free_block_ids() == [4, 3]
    pool.touch([a[0]])
    assert a[0].ref_cnt == 2
    pool.free_blocks([a[0]])
    assert pool.free_block_ids() == [4, 3]  # still referenced once
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(3)


def test_cache_hit_compares_tokens_and_eviction_emits_removed():
    pool = BlockPool(num_blocks=3, block_size=2)
    events = []
    pool.subscribe(events.append)
    blocks = pool.get_new_blocks(2)
    hashes = hash_request_tokens([7, 8, 9, 10], 2)
    pool.cache_full_blocks(blocks, hashes, [[7, 8], [9, 10]], None)
    assert events == [BlockStored(hashes, None, [7, 8, 9, 10], 2)]
    assert pool.get_cached_block(hashes[0], [7, 8]) is blocks[0]
    assert pool.get_cached_block(hashes[0], [7, 9]) is None  # same hash, other tokens: no hit
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [2, 1, 0]
    # Cached-but-free blocks are evicted LRU: block 2 (never cached) first, then 1, then 0.
    pool.get_new_blocks(2)
    assert events[1:] == [BlockRemoved([hashes[1]])]
    assert pool.get_cached_block(hashes[1], [9, 10]) is None
    assert pool.get_cached_block(hashes[0], [7, 8]) is blocks[0]


def test_duplicate_content_stays_uncached_and_events_split():
    pool = BlockPool(num_blocks=6, block_size=1)
    events = []
    pool.subscribe(events.append)
    h = hash_request_tokens([1, 2, 3], 1)
    first = pool.get_new_blocks(1)
    pool.cache_full_blocks(first, h[1:2], [[2]], h[0])
    events.clear()
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, h, [[1], [2], [3]], None)
    assert blocks[1].block_hash is None  # its twin `first` keeps serving hits
    assert events == [BlockStored([h[0]], None, [1], 1), BlockStored([h[2]], h[1], [3], 1)]


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(num_blocks=2, block_size=1)
    events = []
    pool.subscribe(events.append)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [123], [[5]], None)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert events[-1] == AllBlocksCleared() and pool.num_cached_blocks == 0


def test_event_dict_round_trip():
    for e in [BlockStored([1, 2], None, [3, 4], 1), BlockRemoved([9]), AllBlocksCleared()]:
        assert event_from_dict(event_to_dict(e)) == e
    with pytest.raises(ValueError, match="unknown KV event type"):
        event_from_dict({"type": "Nope"})


def test_manager_prefix_hit_is_capped_one_token_short():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = seq("a", range(8))
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 8) == [0, 1]
    assert a.block_table == [0, 1]
    assert kv.pool.num_cached_blocks == 0  # nothing is cached before its K/V is written
    a.num_computed_tokens = 8  # the step ran
    kv.cache_computed_blocks(a)
    # Same 8 tokens: only the first block may hit, so the last token is still computed.
    b = seq("b", range(8))
    hits, n = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [0] and n == 4
    b.num_computed_tokens = 0
    assert kv.allocate_slots(b, 4, hits) == [2]
    assert b.block_table == [0, 2]
    assert kv.pool.blocks[0].ref_cnt == 2
    # A longer prompt sharing 8 tokens hits both blocks.
    c = seq("c", list(range(8)) + [99])
    hits, n = kv.get_computed_blocks(c)
    assert [x.block_id for x in hits] == [0, 1] and n == 8


def test_manager_allocation_failure_changes_nothing_and_free_order():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = seq("a", range(5))
    assert kv.allocate_slots(a, 5) == [0, 1, 2]
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    b = seq("b", [50, 51])
    assert kv.allocate_slots(b, 2) is None
    assert b.block_table == [] and kv.num_free_blocks == 0
    kv.free(a)
    assert a.block_table == [] and kv.pool.free_block_ids() == [2, 1, 0]
    # a's full blocks stay cached; a freed block that is a hit counts against the free queue.
    a2 = seq("a2", range(5))
    hits, n = kv.get_computed_blocks(a2)
    assert [x.block_id for x in hits] == [0, 1] and n == 4
    assert kv.allocate_slots(a2, 1, hits) == [2]
    assert a2.block_table == [0, 1, 2] and kv.num_free_blocks == 0
