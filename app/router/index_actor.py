"""The application's shared KV index as a Ray actor, which every replica publishes to and every
router follows.

`KVIndexActor` (one per application, named `kv_index::<app>`): the PrefixIndex fed by every
LLMServer replica's KV event batches (msgpack, vLLM layout) and by routing history. Everything it
applies also goes into a numbered change log, which routers follow (app/router/index_follower.py).
It also tracks when it last heard from each replica (a batch, a status poll, a stats report), so a
router with a stale replica list never makes it drop a live replica. A restarted actor has a new
epoch; replicas notice it on their next status poll and resync.

The Serve side lives in app/deployments/kv_index.py: the `KVIndex` deployment creates and owns the
actor (a subclass that also keeps each replica's engine stats for /metrics). Replicas and routers
reach the actor by name (`get_index`; actor calls keep each caller's batches in order, handle calls
would not).
"""

from __future__ import annotations

import collections
import logging
import time
import uuid

import ray

from app.kv_events.block_hash import BlockHash
from app.kv_events.schema import AllBlocksCleared
from app.kv_events.wire import decode_batch
from app.router.index import PrefixIndex

logger = logging.getLogger("ray.serve")

INDEX_NAMESPACE = "serve"
RETAIN_GRACE_S = 10.0  # a replica absent from a router's list is dropped only after this much silence
CHANGE_LOG_LEN = 100_000  # changes kept for routers that follow; one further behind reloads a dump

# change log entries: (version, kind, replica, data)
#   "events":  data = one msgpack batch of the replica (as published)
#   "routed":  data = block hashes a router sent to the replica (predicted entries)
#   "remove":  data = None (the replica left, or its batches had a gap)


def index_actor_name(app_name: str) -> str:
    return f"kv_index::{app_name}"


class KVIndexActor:
    """The application's prefix index, as a Ray actor (methods run one at a time)."""

    def __init__(self, max_blocks: int = 1_000_000, predicted_ttl_s: float = 30.0) -> None:
        self.settings = {"max_blocks": max_blocks, "predicted_ttl_s": predicted_ttl_s}
        self.index = PrefixIndex(max_blocks=max_blocks, predicted_ttl_s=predicted_ttl_s)
        self.epoch = uuid.uuid4().hex  # new after every (re)start: replicas resync when it changes
        self.version = 0  # of the latest change-log entry
        self._log: collections.deque[tuple[int, str, str, object]] = collections.deque(maxlen=CHANGE_LOG_LEN)
        self._last_seq: dict[str, int] = {}
        self._last_seen: dict[str, float] = {}  # replica -> time.monotonic() of its last batch or report
        self._resync: set[str] = set()  # replicas whose full block set this index needs
        self._listed: set[str] | None = None  # the replicas of the latest retain() call
        self._checked_at = 0.0
        self.num_batches = 0
        self.num_gaps = 0

    def ping(self) -> str:
        return self.epoch

    def _append(self, kind: str, replica_id: str, data) -> None:
        self.version += 1
        self._log.append((self.version, kind, replica_id, data))

    # -- what replicas send ----------------------------------------------------------------------
    def _heard_from(self, replica_id: str) -> None:
        self._last_seen[replica_id] = time.monotonic()

    def publish(self, replica_id: str, seq: int, payload: bytes) -> None:
        """One KV event batch of a replica. A gap in its numbering (lost batches), or a first batch
        that is not the replica's first (this index restarted), means what the index knows of the
        replica may be wrong or incomplete: a gap drops it, and either asks the replica for its full
        block set (`status`), which arrives as a batch opening with AllBlocksCleared."""
        self._heard_from(replica_id)
        last = self._last_seq.get(replica_id)
        _, events = decode_batch(payload)
        snapshot = bool(events) and isinstance(events[0], AllBlocksCleared)
        if last is not None and seq != last + 1:
            self.num_gaps += 1
            logger.warning("KV events of replica %s jumped from batch %d to %d; re-learning it", replica_id,
                           last, seq)
            self.index.remove_replica(replica_id)
            self._append("remove", replica_id, None)
            self._resync.add(replica_id)
        elif last is None and seq > 1:
            self._resync.add(replica_id)
        if snapshot:
            self._resync.discard(replica_id)
        self._last_seq[replica_id] = seq
        self.index.apply_all(replica_id, events)
        self._append("events", replica_id, payload)
        self.num_batches += 1

    def status(self, replica_id: str) -> tuple[str, bool]:
        """(this index's epoch, whether it needs the replica's full block set); replicas poll it."""
        self._heard_from(replica_id)
        return self.epoch, replica_id in self._resync

    # -- what routers send and read ---------------------------------------------------------------
    def match(self, block_hashes: list[int]) -> dict[str, int]:
        """Leading blocks of a prompt each replica holds (routers match on their own copy; this is
        for tools and tests)."""
        self._check_silent()
        return self.index.match(block_hashes)

    def record_routed(self, replica_id: str, block_hashes: list[int]) -> None:
        self.index.record_routed(replica_id, block_hashes)
        self._append("routed", replica_id, block_hashes)

    def record_routed_many(self, routed: list[tuple[str, list[int]]]) -> None:
        """record_routed for each (replica, block hashes): a router's decisions since its last
        poll, in one call."""
        for replica_id, block_hashes in routed:
            self.record_routed(replica_id, block_hashes)

    def changes(self, epoch: str | None, after: int) -> tuple[str, int, list | None]:
        """(epoch, version, the change-log entries numbered above `after`), for a router's copy
        that has applied this index's entries up to `after` (epoch None: a copy that never synced).
        The entries are None when the copy must reload `dump()` instead: it follows another
        epoch whose log it cannot continue, or it fell more than CHANGE_LOG_LEN entries behind."""
        self._check_silent()
        first = self._log[0][0] if self._log else self.version + 1
        if epoch != self.epoch:
            # a copy from before a restart keeps what it knows and applies the new log from its
            # start, unless the log no longer starts at 1
            after = 0 if epoch is not None else -1
        if after < first - 1 or after > self.version:
            return self.epoch, self.version, None
        out = []
        for entry in reversed(self._log):
            if entry[0] <= after:
                break
            out.append(entry)
        out.reverse()
        return self.epoch, self.version, out

    def dump(self) -> tuple[str, int, dict, dict[str, list[BlockHash]]]:
        """(epoch, version, settings, replica -> the blocks its events confirmed): a whole copy."""
        return self.epoch, self.version, self.settings, self.index.confirmed_blocks()

    def remove_replica(self, replica_id: str) -> None:
        self.index.remove_replica(replica_id)
        self._append("remove", replica_id, None)
        for d in (self._last_seq, self._last_seen):
            d.pop(replica_id, None)
        self._resync.discard(replica_id)

    def retain(self, replica_ids: list[str], grace_s: float = RETAIN_GRACE_S) -> list[str]:
        """A router's current replica list. Replicas not in the latest list are forgotten once they
        have also been silent (no batch, report or status call) for grace_s, now or on a later call
        of this actor: a router with a stale list cannot drop a live replica, which reports every
        second. Replicas that died are removed at once by `remove_replica`. Returns the ones removed."""
        self._listed = set(replica_ids)
        return self._drop_silent(grace_s)

    def _check_silent(self) -> None:
        """At most once a second (on the calls that come often): forget replicas that left the
        routers' list and went silent since."""
        if time.monotonic() - self._checked_at > 1.0:
            self._drop_silent()

    def _drop_silent(self, grace_s: float = RETAIN_GRACE_S) -> list[str]:
        if self._listed is None:
            return []
        now = self._checked_at = time.monotonic()
        gone = [r for r in {*self.index.replicas, *self._last_seq, *self._last_seen}
                if r not in self._listed and now - self._last_seen.get(r, float("-inf")) > grace_s]
        for r in gone:
            self.remove_replica(r)
        return gone

    def stats(self) -> dict:
        return {
            "epoch": self.epoch,
            "version": self.version,
            "num_blocks": self.index.num_blocks,
            "replicas": {r: self.index.num_blocks_of(r) for r in self.index.replicas},
            "num_batches": self.num_batches,
            "num_gaps": self.num_gaps,
        }


def get_index(app_name: str):
    """The application's index actor, or None while there is none (not created yet, restarting)."""
    try:
        return ray.get_actor(index_actor_name(app_name), namespace=INDEX_NAMESPACE)
    except ValueError:
        return None
