"""The application's KV index on the Serve side: the `KVIndex` deployment that owns the index actor,
and the stats every replica reports there for /metrics.

- `KVIndex` (a Serve deployment of the application, one replica, no CPUs): creates the actor and
  owns it, so the index is created with the application, gets the current config's settings on
  every redeploy that changes them (Serve replaces this replica, and the actor dies with its
  owner), and is gone when the application is deleted. Its health check recreates an actor that
  died for good; `max_restarts` restarts it in place otherwise.
- `KVIndexWithStats`: the actor it creates, the router's KVIndexActor (app/router/index_actor.py)
  plus each LLMServer replica's latest engine stats (the one stats path: /metrics of every ingress
  and the benchmarks read them here). One actor for both because a replica's stats report, once
  per routing-stats period, is also its heartbeat to the index.
"""

from __future__ import annotations

import logging
import time

import ray

from app.config import ServerConfig
from app.router.index_actor import INDEX_NAMESPACE, KVIndexActor, index_actor_name

logger = logging.getLogger("ray.serve")

INDEX_DEPLOYMENT_NAME = "KVIndex"


class KVIndexWithStats(KVIndexActor):
    """The application's index actor as the KVIndex deployment creates it: the prefix index and
    change log of KVIndexActor, and every replica's latest engine stats."""

    def __init__(self, max_blocks: int = 1_000_000, predicted_ttl_s: float = 30.0) -> None:
        super().__init__(max_blocks=max_blocks, predicted_ttl_s=predicted_ttl_s)
        self._replica_stats: dict[str, dict] = {}  # latest engine stats each replica reported

    def report_stats(self, replica_id: str, stats: dict) -> None:
        """A replica's latest engine stats (for /metrics of every ingress and for benchmarks)."""
        self._heard_from(replica_id)
        self._replica_stats[replica_id] = {**stats, "reported_at": time.time()}
        self._check_silent()

    def replica_stats(self) -> dict[str, dict]:
        self._check_silent()
        return dict(self._replica_stats)

    def remove_replica(self, replica_id: str) -> None:
        super().remove_replica(replica_id)
        self._replica_stats.pop(replica_id, None)


class KVIndex:
    """Serve deployment (name KVIndex) that owns the application's index actor (a KVIndexWithStats);
    see the module docstring. It serves no requests: its constructor and health check keep the
    actor there."""

    PING_TIMEOUT_S = 10.0  # below Serve's health_check_timeout_s (30 s by default)
    UNRESPONSIVE_LIMIT_S = 120.0

    def __init__(self, config) -> None:
        from ray import serve

        router = ServerConfig.model_validate(config).router
        self._name = index_actor_name(serve.get_replica_context().app_name)
        self._options = {"max_blocks": router.index_max_blocks, "predicted_ttl_s": router.predicted_ttl_s}
        self.actor = self._create(timeout_s=60.0)
        self._unresponsive_since: float | None = None

    def _create(self, timeout_s: float):
        """A new actor under the application's name. The name frees only once a previous actor
        (of a replica this one replaces) is dead, so retry until then."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                actor = ray.remote(KVIndexWithStats).options(
                    name=self._name, namespace=INDEX_NAMESPACE, num_cpus=0, max_restarts=-1,
                    max_task_retries=0, scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=None),
                ).remote(**self._options)
                ray.get(actor.ping.remote(), timeout=30)
                logger.info("KV index %s created: %s", self._name, self._options)
                return actor
            except ValueError:  # the name is still taken by the actor being replaced
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def check_health(self) -> None:
        """An actor killed for good (no restart left) is replaced here. One that Ray is restarting
        (max_restarts=-1), or that answers slowly on a loaded node, is waited for: failing the
        health check then would make Serve replace this replica, whose destructor kills the actor
        for good, and the application would have no index until the new replica creates one.
        Only an actor unresponsive for UNRESPONSIVE_LIMIT_S fails the check."""
        try:
            ray.get(self.actor.ping.remote(), timeout=self.PING_TIMEOUT_S)
            self._unresponsive_since = None
        except ray.exceptions.ActorDiedError:
            logger.warning("KV index %s died; creating a new one", self._name)
            self.actor = self._create(timeout_s=30.0)
            self._unresponsive_since = None
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as e:
            now = time.monotonic()
            if self._unresponsive_since is None:
                self._unresponsive_since = now
            waited = now - self._unresponsive_since
            logger.warning("KV index %s unresponsive for %.0f s (%s); waiting for Ray to restart it",
                           self._name, waited, type(e).__name__)
            if waited > self.UNRESPONSIVE_LIMIT_S:
                raise RuntimeError(f"KV index {self._name} unresponsive for {waited:.0f} s") from e

    def __del__(self) -> None:
        actor = getattr(self, "actor", None)
        if actor is not None and ray.is_initialized():  # ray.kill would start a new Ray otherwise
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
