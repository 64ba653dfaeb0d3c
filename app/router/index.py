"""Prefix index: which replica holds which KV block. Pure Python, no Ray.

Block hashes are chained (app/kv_events/block_hash.py): block i's hash covers every token before
it, so "replica r holds hash h_i" means r can serve the prompt's first i+1 blocks from cache
when it also holds h_0..h_{i-1}. `match` returns, per replica, how many leading blocks of a
prompt it holds.

Entries come from two sources:
- KV events (`apply`): what a replica reported it stored / removed / cleared. Authoritative.
- routing history (`record_routed`): the blocks a request sent to a replica will create there.
  Events lag a routed request by its prefill; these entries bridge the gap so a session's next
  turn, or a burst of requests sharing a prefix, find the replica before its events arrive.
  They expire after `predicted_ttl_s` unless an event confirms them.

Memory is bounded: beyond `max_blocks` hashes, the least recently stored or matched are dropped
(the replicas' own LRU would have evicted those first too).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from app.kv_events.block_hash import BlockHash
from app.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

ReplicaId = str


class PrefixIndex:
    def __init__(
        self,
        max_blocks: int = 1_000_000,
        predicted_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1 (got {max_blocks})")
        self.max_blocks = max_blocks
        self.predicted_ttl_s = predicted_ttl_s
        self._clock = clock
        # hash -> {replica: expiry time (float) for predicted entries, None once an event confirmed it}
        self._blocks: OrderedDict[BlockHash, dict[ReplicaId, float | None]] = OrderedDict()
        self._by_replica: dict[ReplicaId, set[BlockHash]] = {}

    # -- updates -------------------------------------------------------------------------------
    def apply(self, replica: ReplicaId, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._add(replica, event.block_hashes, None)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._discard(replica, h)
        elif isinstance(event, AllBlocksCleared):
            self.remove_replica(replica)
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def apply_all(self, replica: ReplicaId, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(replica, event)

    def add_confirmed(self, replica: ReplicaId, block_hashes: Sequence[BlockHash]) -> None:
        """Blocks the replica holds for sure (as a BlockStored event would say), e.g. from a dump."""
        self._add(replica, block_hashes, None)

    def record_routed(self, replica: ReplicaId, block_hashes: Sequence[BlockHash]) -> None:
        """A request with these prompt blocks was sent to `replica` (predicted entries)."""
        self._add(replica, block_hashes, self._clock() + self.predicted_ttl_s)

    def remove_replica(self, replica: ReplicaId) -> None:
        """Forget everything of a replica (it died, restarted or cleared its cache)."""
        for h in self._by_replica.pop(replica, ()):
            holders = self._blocks.get(h)
            if holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del self._blocks[h]

    def _add(self, replica: ReplicaId, hashes: Sequence[BlockHash], expiry: float | None) -> None:
        owned = self._by_replica.setdefault(replica, set())
        for h in hashes:
            holders = self._blocks.get(h)
            if holders is None:
                holders = self._blocks[h] = {}
            else:
                self._blocks.move_to_end(h)
            if expiry is None:
                holders[replica] = None  # confirmed by an event, for good
            elif replica not in holders:
                holders[replica] = expiry
            elif holders[replica] is not None:  # a prediction extends a prediction, never a confirmation
                holders[replica] = max(expiry, holders[replica])
            owned.add(h)
        while len(self._blocks) > self.max_blocks:
            h, holders = self._blocks.popitem(last=False)
            for r in holders:
                self._by_replica[r].discard(h)

    def _discard(self, replica: ReplicaId, h: BlockHash) -> None:
        holders = self._blocks.get(h)
        if holders is None or replica not in holders:
            return
        del holders[replica]
        self._by_replica[replica].discard(h)
        if not holders:
            del self._blocks[h]

    # -- queries -------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, int]:
        """Leading blocks of `block_hashes` each replica holds (replicas holding none are left out)."""
        now = self._clock()
        blocks = self._blocks
        result: dict[ReplicaId, int] = {}
        alive: set[ReplicaId] = set()
        for i, h in enumerate(block_hashes):
            holders = blocks.get(h)
            if holders is None:
                break
            blocks.move_to_end(h)
            if i == 0:
                alive = {r for r, exp in holders.items() if exp is None or exp > now}
            else:
                # a replica drops out where it lacks the block or only predicted it and that expired
                dropped = [r for r in alive if (exp := holders.get(r, 0.0)) is not None and exp <= now]
                for r in dropped:
                    alive.discard(r)
                    result[r] = i
            if not alive:
                break
        else:
            i = len(block_hashes)
        for r in alive:
            result[r] = i
        return result

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def replicas(self) -> list[ReplicaId]:
        return [r for r, hs in self._by_replica.items() if hs]

    def confirmed_blocks(self) -> dict[ReplicaId, list[BlockHash]]:
        """Replica -> the blocks events confirmed it holds, least recently used first (a dump)."""
        out: dict[ReplicaId, list[BlockHash]] = {}
        for h, holders in self._blocks.items():
            for r, expiry in holders.items():
                if expiry is None:
                    out.setdefault(r, []).append(h)
        return out

    def num_blocks_of(self, replica: ReplicaId) -> int:
        return len(self._by_replica.get(replica, ()))

