"""KV events on the wire: msgpack in the layout of vLLM's KV event schema.

vLLM publishes `KVEventBatch(ts, events, data_parallel_rank)` (msgspec: the batch array_like,
each event a struct tagged with its class name), so on the wire (vLLM 0.32) a batch is
`[ts, [event, ...], rank]` and each event a map:

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None, "token_ids": [...],
     "block_size": n, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [...], ...}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", ...}
    {"type": "AllBlocksCleared"}

We write the same maps (medium "GPU", the optional fields left out, as msgspec omits defaults)
and read them with or without the optional fields, and also the array layout of earlier vLLM
versions (`["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium]`), so
the router's index consumes a vLLM replica's events and a vLLM consumer ours. A batch's sequence
number travels beside it (a separate ZMQ frame, or the index's publish call); `encode_batch`
returns the payload only. The event classes are in app/kv_events/schema.py.
"""

from __future__ import annotations

import msgpack

from app.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "decode_batch", "encode_batch",
           "event_to_wire", "event_from_wire"]


def event_to_wire(event: KVEvent) -> dict:
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": None, "medium": "GPU", "lora_name": None}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": "GPU"}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


_ARRAY_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
                 "BlockRemoved": ("block_hashes",), "AllBlocksCleared": ()}


def event_from_wire(data: dict | list) -> KVEvent:
    if isinstance(data, (list, tuple)) and data:  # the array layout of earlier vLLM versions
        tag, names = data[0], _ARRAY_FIELDS.get(data[0])
        if names is None or len(data) - 1 < len(names):
            raise ValueError(f"unknown or short KV event {tag!r} with {len(data) - 1} fields; expected "
                             "BlockStored, BlockRemoved or AllBlocksCleared")
        data = {"type": tag, **dict(zip(names, data[1:]))}
    if not isinstance(data, dict):
        raise ValueError(f"a KV event is a map or a non-empty array (got {data!r:.100})")
    tag = data.get("type")
    try:
        if tag == "BlockStored":
            extra = data.get("extra_keys")
            return BlockStored(list(data["block_hashes"]), data["parent_block_hash"], list(data["token_ids"]),
                               int(data["block_size"]), None if extra is None else list(extra))
        if tag == "BlockRemoved":
            return BlockRemoved(list(data["block_hashes"]))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    except (KeyError, TypeError) as e:
        raise ValueError(f"KV event {tag!r} lacks a field or has a wrong one ({e!r})") from None
    raise ValueError(f"unknown KV event type {tag!r}; expected BlockStored, BlockRemoved or AllBlocksCleared")


def encode_batch(ts: float, events: list[KVEvent]) -> bytes:
    """msgpack of `[ts, [events], 0]`, vLLM's KVEventBatch layout (data-parallel rank 0)."""
    return msgpack.packb([float(ts), [event_to_wire(e) for e in events], 0], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """(ts, events) of an encoded batch (with or without the trailing data_parallel_rank)."""
    data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(data, list) or len(data) < 2:
        raise ValueError("a KV event batch is an array [ts, events, ...]")
    return float(data[0]), [event_from_wire(e) for e in data[1]]
