"""KV events on the wire: msgpack in the layout of vLLM's KV event schema.

vLLM publishes `KVEventBatch(ts, events)` (msgspec structs with array_like=True, tag=True), so
on the wire a batch is `[ts, [event, ...]]` and each event an array whose first element is its
type name:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

We write lora_id and medium as None (we have neither) and read events with or without them, so
the router's index can consume a vLLM replica's events and vice versa. A batch's sequence number
travels beside it (vLLM sends it as a separate ZMQ frame); `encode_batch` returns the payload
only. The event classes are the engine's (app/engine/kv_events.py): one definition.
"""

from __future__ import annotations

import msgpack

from app.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "decode_batch", "encode_batch",
           "event_to_wire", "event_from_wire"]


def event_to_wire(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                event.block_size, None, None]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), None]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def event_from_wire(data: list) -> KVEvent:
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError(f"a KV event is a non-empty array (got {data!r})")
    tag, fields = data[0], data[1:]
    if tag == "BlockStored" and len(fields) >= 4:
        hashes, parent, tokens, block_size = fields[:4]
        return BlockStored(list(hashes), parent, list(tokens), int(block_size))
    if tag == "BlockRemoved" and len(fields) >= 1:
        return BlockRemoved(list(fields[0]))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown or short KV event {tag!r} with {len(fields)} fields; expected BlockStored, "
                     "BlockRemoved or AllBlocksCleared")


def encode_batch(ts: float, events: list[KVEvent]) -> bytes:
    """msgpack of `[ts, [events]]`, vLLM's KVEventBatch layout."""
    return msgpack.packb([float(ts), [event_to_wire(e) for e in events]], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """(ts, events) of an encoded batch; also accepts vLLM's with a trailing data_parallel_rank."""
    data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(data, list) or len(data) < 2:
        raise ValueError("a KV event batch is an array [ts, events, ...]")
    return float(data[0]), [event_from_wire(e) for e in data[1]]
