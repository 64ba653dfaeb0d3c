"""KV-aware request routing in Ray Serve: the shared index actor and the RequestRouter.

- `KVIndexActor` (one per application, a named detached actor): the PrefixIndex fed by every
  LLMServer replica's KV event batches (msgpack, vLLM layout) and by routing history. Every
  router instance (one per DeploymentHandle: each ingress replica's, each Python caller's) asks
  it, so all of them see the same cache map and route alike.
- `KVAwareRouter`: Ray Serve's RequestRouter for the LLMServer deployment. For a
  `generate(GenerateRequest)` call it reads the request's block hashes and session id, asks the
  index which replica holds how many leading blocks, and ranks replicas with
  app/router/policy.py. Other calls (stats, model info) and an unreachable index fall back to
  power of two choices. Replicas that leave are dropped from the index at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import defaultdict

import ray
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from app.deployments.types import GenerateRequest
from app.engine.kv_events import AllBlocksCleared
from app.router.events import decode_batch
from app.router.index import PrefixIndex
from app.router.policy import RoutingPolicy, choose

logger = logging.getLogger("ray.serve")

INDEX_NAMESPACE = "serve"
_INDEX_TIMEOUT_S = 0.5  # a routing decision never waits longer than this for the index
RETAIN_GRACE_S = 10.0  # a replica absent from a router's list is dropped only after this much silence


def index_actor_name(app_name: str) -> str:
    return f"kv_index::{app_name}"


class KVIndexActor:
    """The application's prefix index, as a Ray actor (methods run one at a time)."""

    def __init__(self, max_blocks: int = 1_000_000, predicted_ttl_s: float = 30.0) -> None:
        self.index = PrefixIndex(max_blocks=max_blocks, predicted_ttl_s=predicted_ttl_s)
        self.epoch = uuid.uuid4().hex  # new after every (re)start: replicas resync when it changes
        self._last_seq: dict[str, int] = {}
        self._last_seen: dict[str, float] = {}  # replica -> time.monotonic() of its last batch or report
        self._resync: set[str] = set()  # replicas whose full block set this index needs
        self._listed: set[str] | None = None  # the replicas of the latest retain() call
        self._checked_at = 0.0
        self._replica_stats: dict[str, dict] = {}  # latest engine stats each replica reported
        self.num_batches = 0
        self.num_gaps = 0

    def publish(self, replica_id: str, seq: int, payload: bytes) -> None:
        """One KV event batch of a replica. A gap in its numbering (lost batches), or a first batch
        that is not the replica's first (this index restarted), means what the index knows of the
        replica may be wrong or incomplete: a gap drops it, and either asks the replica for its full
        block set (`status`), which arrives as a batch opening with AllBlocksCleared."""
        self._last_seen[replica_id] = time.monotonic()
        last = self._last_seq.get(replica_id)
        _, events = decode_batch(payload)
        snapshot = bool(events) and isinstance(events[0], AllBlocksCleared)
        if last is not None and seq != last + 1:
            self.num_gaps += 1
            logger.warning("KV events of replica %s jumped from batch %d to %d; re-learning it", replica_id,
                           last, seq)
            self.index.remove_replica(replica_id)
            self._resync.add(replica_id)
        elif last is None and seq > 1:
            self._resync.add(replica_id)
        if snapshot:
            self._resync.discard(replica_id)
        self._last_seq[replica_id] = seq
        self.index.apply_all(replica_id, events)
        self.num_batches += 1

    def status(self, replica_id: str) -> tuple[str, bool]:
        """(this index's epoch, whether it needs the replica's full block set); replicas poll it."""
        self._last_seen[replica_id] = time.monotonic()
        return self.epoch, replica_id in self._resync

    def match(self, block_hashes: list[int]) -> dict[str, int]:
        self._check_silent()
        return self.index.match(block_hashes)

    def _check_silent(self) -> None:
        """At most once a second (on the calls that come often: matches, and every live replica's
        report): forget replicas that left the routers' list and went silent since."""
        if time.monotonic() - self._checked_at > 1.0:
            self._drop_silent()

    def record_routed(self, replica_id: str, block_hashes: list[int]) -> None:
        self.index.record_routed(replica_id, block_hashes)

    def remove_replica(self, replica_id: str) -> None:
        self.index.remove_replica(replica_id)
        for d in (self._last_seq, self._last_seen, self._replica_stats):
            d.pop(replica_id, None)
        self._resync.discard(replica_id)

    def report_stats(self, replica_id: str, stats: dict) -> None:
        """A replica's latest engine stats (for /metrics of every ingress and for benchmarks)."""
        self._last_seen[replica_id] = time.monotonic()
        self._replica_stats[replica_id] = stats
        self._check_silent()

    def replica_stats(self) -> dict[str, dict]:
        return dict(self._replica_stats)

    def retain(self, replica_ids: list[str], grace_s: float = RETAIN_GRACE_S) -> list[str]:
        """A router's current replica list. Replicas not in the latest list are forgotten once they
        have also been silent (no batch, report or status call) for grace_s, now or on a later call
        of this actor: a router with a stale list cannot drop a live replica, which reports every
        second. Replicas that died are removed at once by `remove_replica`. Returns the ones removed."""
        self._listed = set(replica_ids)
        return self._drop_silent(grace_s)

    def _drop_silent(self, grace_s: float = RETAIN_GRACE_S) -> list[str]:
        if self._listed is None:
            return []
        now = self._checked_at = time.monotonic()
        gone = [r for r in {*self.index.replicas, *self._last_seq, *self._replica_stats, *self._last_seen}
                if r not in self._listed and now - self._last_seen.get(r, float("-inf")) > grace_s]
        for r in gone:
            self.remove_replica(r)
        return gone

    def stats(self) -> dict:
        return {
            "num_blocks": self.index.num_blocks,
            "replicas": {r: self.index.num_blocks_of(r) for r in self.index.replicas},
            "num_batches": self.num_batches,
            "num_gaps": self.num_gaps,
        }


def get_or_create_index(app_name: str, **kwargs):
    """The application's index actor, created on first use (detached: it outlives any one replica)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return ray.remote(KVIndexActor).options(
        name=index_actor_name(app_name), namespace=INDEX_NAMESPACE, lifetime="detached",
        get_if_exists=True, num_cpus=0, max_restarts=-1,
        # not inside the creating replica's placement group: it must outlive that replica
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=None),
    ).remote(**kwargs)


def get_index(app_name: str):
    """The application's index actor, or None when no replica created it (yet)."""
    try:
        return ray.get_actor(index_actor_name(app_name), namespace=INDEX_NAMESPACE)
    except ValueError:
        return None


class KVAwareRouter(FIFOMixin, RequestRouter):
    """Set on the LLMServer deployment by `request_router_config` (see builder.py)."""

    def initialize_state(self, load_factor: float = 1.25, slack: int = 2, min_match_blocks: int = 1,
                         **kwargs) -> None:
        self.policy = RoutingPolicy(load_factor=load_factor, slack=slack, min_match_blocks=min_match_blocks)
        self._index = None
        self._index_checked_at = 0.0
        self._inflight: dict[ReplicaID, int] = defaultdict(int)
        self._rng = random.Random()
        self.decisions: dict[str, int] = defaultdict(int)  # reason -> count, for logs and tests

    # -- index access --------------------------------------------------------------------------
    def _get_index(self):
        now = time.monotonic()
        if self._index is None and now - self._index_checked_at > 1.0:
            self._index_checked_at = now
            self._index = get_index(self.app_name)
        return self._index

    async def _match(self, block_hashes: list[int]) -> dict[str, int]:
        index = self._get_index()
        if index is None or not block_hashes:
            return {}
        try:
            return await asyncio.wait_for(index.match.remote(block_hashes), _INDEX_TIMEOUT_S)
        except Exception as e:  # the index is down or slow: route by session / load this time
            logger.warning("KV index unavailable (%r); routing without it", e)
            self._index = None
            return {}

    # -- Ray Serve hooks -----------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _generate_request(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {rid: self._load(r) for rid, r in by_id.items()}
        if request is None:
            decision = choose(list(by_id), {}, loads, None, self.policy, self._rng)
        else:
            matches = await self._match(request.block_hashes)
            decision = choose(list(by_id), matches, loads, request.session_id, self.policy, self._rng)
        self.decisions[decision.reason] += 1
        return [[by_id[rid]] for rid in decision.ranking]

    def _load(self, replica: RunningReplica) -> float:
        cached = self._replica_queue_len_cache.get(replica.replica_id)
        return max(self._inflight[replica.replica_id], cached or 0)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._inflight[replica_id] += 1
        request = _generate_request(pending_request)
        index = self._index
        if request is not None and request.block_hashes and index is not None:
            index.record_routed.remote(replica_id.unique_id, list(request.block_hashes))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._inflight.get(replica_id, 0) > 0:
            self._inflight[replica_id] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id for r in replicas}
        for rid in [r for r in self._inflight if r not in current]:
            del self._inflight[rid]
        index = self._get_index()
        if index is not None and replicas:
            index.retain.remote([r.replica_id.unique_id for r in replicas])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._inflight.pop(replica_id, None)
        index = self._get_index()
        if index is not None:
            index.remove_replica.remote(replica_id.unique_id)


def _generate_request(pending_request: PendingRequest | None):
    """The GenerateRequest of a `generate` call, else None."""
    if pending_request is None:
        return None
    for arg in (*pending_request.args, *pending_request.kwargs.values()):
        if isinstance(arg, GenerateRequest):
            return arg
    return None
