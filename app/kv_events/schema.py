"""KV cache events a replica publishes so a router can index which blocks it holds.

Field names follow vLLM's BlockStored / BlockRemoved / AllBlocksCleared so consumers of that
schema can read them. Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from app.kv_events.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became cached, in chain order; parent_block_hash is None for a first block."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    # Per block, what else its hash covers (vLLM: LoRA name, multimodal ids, cache salt); None: nothing.
    extra_keys: list | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted to make room)."""

    block_hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_to_dict(event: KVEvent) -> dict:
    return {"type": type(event).__name__, **asdict(event)}


def event_from_dict(data: dict) -> KVEvent:
    kinds = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
    fields = {k: v for k, v in data.items() if k != "type"}
    try:
        return kinds[data["type"]](**fields)
    except KeyError:
        raise ValueError(f"unknown KV event type {data.get('type')!r}; expected one of {sorted(kinds)}") from None
