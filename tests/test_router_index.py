"""Prefix index and KV event wire format: exact expectations, no Ray."""

import msgpack
import pytest

from app.engine.engine import LLMEngine
from app.engine.sampling_params import SamplingParams
from app.kv_events.block_hash import hash_request_tokens
from app.kv_events.wire import (
    AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, encode_batch, event_from_wire,
)
from app.router.index import PrefixIndex


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def stored(*hashes, parent=None):
    return BlockStored(list(hashes), parent, [0] * (2 * len(hashes)), 2)


def test_match_counts_leading_blocks_per_replica():
    idx = PrefixIndex()
    idx.apply("a", stored(1, 2, 3))
    idx.apply("b", stored(1, 2))
    idx.apply("c", stored(2, 3))  # holds later blocks but not the first: no prefix
    assert idx.match([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert idx.match([1]) == {"a": 1, "b": 1}
    assert idx.match([9, 1]) == {}
    assert idx.match([]) == {}


def test_removed_block_cuts_the_prefix_there():
    idx = PrefixIndex()
    idx.apply("a", stored(1, 2, 3))
    idx.apply("a", BlockRemoved([2]))
    assert idx.match([1, 2, 3]) == {"a": 1}
    idx.apply("a", BlockRemoved([2, 42]))  # removing twice or unknown hashes is harmless
    assert idx.num_blocks_of("a") == 2


def test_cleared_and_removed_replica_leave_nothing():
    idx = PrefixIndex()
    idx.apply("a", stored(1, 2))
    idx.apply("b", stored(1, 2, 3))
    idx.apply("a", AllBlocksCleared())
    assert idx.match([1, 2, 3]) == {"b": 3}
    idx.remove_replica("b")
    assert idx.match([1, 2, 3]) == {}
    assert idx.num_blocks == 0 and idx.replicas == []


def test_eviction_drops_least_recently_used_hashes():
    idx = PrefixIndex(max_blocks=3)
    idx.apply("a", stored(1, 2, 3))
    assert idx.match([1]) == {"a": 1}  # touches 1: now 2 is the oldest
    idx.apply("b", stored(4))
    assert idx.num_blocks == 3
    assert idx.match([1, 2, 3]) == {"a": 1}  # 2 was evicted
    assert idx.match([4]) == {"b": 1}
    assert idx.num_blocks_of("a") == 2


def test_predicted_entries_expire_unless_confirmed():
    clock = Clock()
    idx = PrefixIndex(predicted_ttl_s=10, clock=clock)
    idx.record_routed("a", [1, 2, 3])
    idx.record_routed("b", [1])
    assert idx.match([1, 2, 3]) == {"a": 3, "b": 1}
    idx.apply("a", stored(1, 2))  # the replica's events arrive for the first two blocks
    clock.t = 11
    assert idx.match([1, 2, 3]) == {"a": 2}
    idx.record_routed("a", [1])  # a later prediction never downgrades a confirmed entry
    clock.t = 100
    assert idx.match([1, 2]) == {"a": 2}


def test_wire_format_round_trip_and_vllm_layout():
    events = [BlockStored([11, 12], None, list(range(8)), 4), BlockRemoved([11]), AllBlocksCleared()]
    payload = encode_batch(123.5, events)
    ts, back = decode_batch(payload)
    assert ts == 123.5 and back == events
    # vLLM 0.32's layout: [ts, [{"type": tag, field: value, ...}, ...], data_parallel_rank]
    raw = msgpack.unpackb(payload)
    assert raw == [123.5, [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
                            "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
                            "lora_name": None},
                           {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
                           {"type": "AllBlocksCleared"}], 0]
    # what vLLM 0.32 sends (its extra fields included), and the array layout of earlier versions
    vllm = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [b"\x05" * 32], "parent_block_hash": 4,
                                 "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
                                 "lora_name": None, "extra_keys": [None], "group_idx": 0,
                                 "kv_cache_spec_kind": "full_attention"},
                                {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}], 0])
    assert decode_batch(vllm) == (1.0, [BlockStored([b"\x05" * 32], 4, [1, 2], 2, [None]), BlockRemoved([5])])
    older = msgpack.packb([1.0, [["BlockStored", [5], 4, [1, 2], 2, None, "gpu"], ["BlockRemoved", [5]]]])
    assert decode_batch(older) == (1.0, [BlockStored([5], 4, [1, 2], 2), BlockRemoved([5])])
    with pytest.raises(ValueError, match="unknown or short KV event"):
        event_from_wire(["BlockMoved", [1]])
    with pytest.raises(ValueError, match="lacks a field"):
        event_from_wire({"type": "BlockStored", "block_hashes": [1]})


def _engine_after_one_prompt(stories_paths):
    """An engine (blocks of 4 tokens) that has prefilled one prompt, and the prompt's ids."""
    model, tok = stories_paths
    engine = LLMEngine(model=model, tokenizer=tok, num_kv_blocks=64, block_size=4)
    prompt_ids = engine.tokenize("Once upon a time, there was a little girl named Lily")
    engine.add_request("r", prompt_ids, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return engine, prompt_ids


def test_engine_and_router_hashes_agree(stories_paths):
    """The blocks an engine reports storing are exactly the hashes the ingress computes."""
    engine, prompt_ids = _engine_after_one_prompt(stories_paths)
    idx = PrefixIndex()
    idx.apply_all("replica", engine.take_kv_events())
    expected = hash_request_tokens(prompt_ids, 4)
    assert len(expected) == len(prompt_ids) // 4 >= 3
    assert idx.match(expected) == {"replica": len(expected)}


# -- the index actor's bookkeeping (the class itself; test_router_serve.py runs it as an actor) ------
def _batch(*events):
    return encode_batch(0.0, list(events))


def test_an_index_that_restarted_asks_each_replica_for_its_blocks_once():
    from app.router.index_actor import KVIndexActor

    index = KVIndexActor()
    assert index.status("a") == (index.epoch, False)
    index.publish("a", 7, _batch(stored(1)))  # batch 7 first: batches 1-6 went to a previous index
    assert index.status("a") == (index.epoch, True)
    index.publish("a", 8, _batch(AllBlocksCleared(), stored(1, 2), stored(3)))  # the replica's snapshot
    assert index.status("a")[1] is False
    assert index.match([1, 2]) == {"a": 2} and index.match([3]) == {"a": 1}
    assert KVIndexActor().epoch != index.epoch


def test_a_gap_in_the_batches_drops_the_replica_and_asks_for_a_resync():
    from app.router.index_actor import KVIndexActor

    index = KVIndexActor()
    index.publish("a", 1, _batch(stored(1, 2)))
    index.publish("a", 3, _batch(stored(5)))  # batch 2 was lost
    assert index.num_gaps == 1 and index.match([1, 2]) == {} and index.match([5]) == {"a": 1}
    assert index.status("a")[1] is True


def test_retain_from_a_stale_view_keeps_replicas_that_are_alive():
    from app.deployments.kv_index import KVIndexWithStats  # the actor as deployed: stats reports are heartbeats

    index = KVIndexWithStats()
    index.publish("live", 1, _batch(stored(1)))
    index.report_stats("quiet", {"num_running": 0})
    assert index.retain(["other"], grace_s=60) == []  # both were heard from within the grace period
    assert index.match([1]) == {"live": 1}
    assert sorted(index.retain(["live"], grace_s=-1)) == ["quiet"]  # silent (here: any silence) and not listed
    assert index.match([1]) == {"live": 1}
    # a replica that left is dropped once it has been silent long enough, on any later call
    assert index.retain(["new"]) == []  # "live" left the list but was heard from just now
    index._last_seen["live"] -= 3600  # ... an hour of silence later
    index._checked_at -= 2
    assert index.match([1]) == {}
    index.remove_replica("live")  # a replica that died: at once
    assert index.match([1]) == {}


def test_a_snapshot_of_the_prefix_cache_rebuilds_the_index(stories_paths):
    engine, ids = _engine_after_one_prompt(stories_paths)
    from_events, from_snapshot = PrefixIndex(), PrefixIndex()
    from_events.apply_all("x", engine.take_kv_events())
    from_snapshot.apply("x", stored(999))  # stale knowledge the snapshot must clear
    from_snapshot.apply_all("x", engine.kv_cache_snapshot_events())
    expected = hash_request_tokens(ids, 4)
    assert from_snapshot.match(expected) == from_events.match(expected) == {"x": len(expected)}
    assert from_snapshot.match([999]) == {}
