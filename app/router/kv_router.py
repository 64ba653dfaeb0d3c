"""KV-aware request routing in Ray Serve: the RequestRouter of the LLMServer deployment.

`KVAwareRouter` (one per DeploymentHandle: each ingress replica's, each Python caller's) keeps a
local copy of the application's shared KV index (app/router/index_follower.py: every replica's KV
events and every router's routing history, pulled in the background). For a
`generate(GenerateRequest)` call it reads the request's block hashes and session id, looks up
in that copy which replica holds how many leading blocks, and ranks replicas with
app/router/policy.py. A decision never waits on the index actor: while it is down the copy is
stale, not missing. Other calls (model info, health) go by power of two choices. Replicas that
leave are dropped from the index at once.
"""

from __future__ import annotations

import logging
import random
import weakref
from collections import defaultdict

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from app.router.index_follower import IndexFollower
from app.router.policy import RoutingPolicy, choose
from app.serving_types import GenerateRequest

logger = logging.getLogger("ray.serve")


class KVAwareRouter(FIFOMixin, RequestRouter):
    """Set on the LLMServer deployment by `request_router_config` (see builder.py)."""

    def initialize_state(self, **settings) -> None:
        """`settings`: request_router_kwargs, RouterConfig's fields (the builder passes `args.router`;
        a `request_router_config` under `deployments:` may give some, the rest take their defaults)."""
        self.policy = RoutingPolicy.from_config(settings)
        self._inflight: dict[ReplicaID, int] = defaultdict(int)
        self._rng = random.Random()
        self.decisions: dict[str, int] = defaultdict(int)  # reason -> count, for logs and tests
        self.follower = IndexFollower(self.app_name)
        weakref.finalize(self, self.follower.close)

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
            matches = self.follower.match(request.block_hashes) if request.block_hashes else {}
            decision = choose(list(by_id), matches, loads, request.session_id, self.policy, self._rng)
        self.decisions[decision.reason] += 1
        return [[by_id[rid]] for rid in decision.ranking]

    def _load(self, replica: RunningReplica) -> float:
        cached = self._replica_queue_len_cache.get(replica.replica_id)
        return max(self._inflight[replica.replica_id], cached or 0)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._inflight[replica_id] += 1
        request = _generate_request(pending_request)
        if request is not None and request.block_hashes:
            self.follower.record_routed(replica_id.unique_id, list(request.block_hashes))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._inflight.get(replica_id, 0) > 0:
            self._inflight[replica_id] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id for r in replicas}
        for rid in [r for r in self._inflight if r not in current]:
            del self._inflight[rid]
        ids = {r.replica_id.unique_id for r in replicas}
        self.follower.keep_only(ids)
        index = self.follower.actor
        if index is not None and replicas:
            index.retain.remote(sorted(ids))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._inflight.pop(replica_id, None)
        self.follower.forget(replica_id.unique_id)
        index = self.follower.actor
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
