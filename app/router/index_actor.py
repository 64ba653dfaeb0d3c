"""The application's shared KV index: the actor every replica publishes to, the Serve deployment
that owns it, and the follower that keeps a copy of it inside every router.

- `KVIndexActor` (one per application, named `kv_index::<app>`): the PrefixIndex fed by every
  LLMServer replica's KV event batches (msgpack, vLLM layout) and by routing history, plus each
  replica's latest engine stats (the one stats path: /metrics and benchmarks read them here).
  Everything it applies also goes into a numbered change log, which routers follow.
- `KVIndex` (a Serve deployment of the application, one replica, no CPUs): creates the actor and
  owns it, so the index is created with the application, gets the current config's settings on
  every redeploy that changes them (Serve replaces this replica, and the actor dies with its
  owner), and is gone when the application is deleted. Its health check recreates an actor that
  died for good; `max_restarts` restarts it in place otherwise. Replicas and routers reach the
  actor by name (actor calls keep each caller's batches in order; handle calls would not).
- `IndexFollower` (one per router): a background thread that pulls the actor's change log every
  `poll_s` into a router-local PrefixIndex. Routing decisions read only that copy, so a slow,
  restarting or dead index never delays a request; the copy goes stale at worst, and catches up
  when the index is back (each replica re-publishes its whole prefix cache to a new index, as a
  batch opening with AllBlocksCleared, which replaces what the copy knew of that replica).

A restarted actor has a new epoch; replicas notice it on their next status poll and resync.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Sequence

import ray

from app.engine.block_hash import BlockHash
from app.engine.kv_events import AllBlocksCleared
from app.router.events import decode_batch
from app.router.index import PrefixIndex

logger = logging.getLogger("ray.serve")

INDEX_NAMESPACE = "serve"
INDEX_DEPLOYMENT_NAME = "KVIndex"
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
        self._replica_stats: dict[str, dict] = {}  # latest engine stats each replica reported
        self.num_batches = 0
        self.num_gaps = 0

    def ping(self) -> str:
        return self.epoch

    def _append(self, kind: str, replica_id: str, data) -> None:
        self.version += 1
        self._log.append((self.version, kind, replica_id, data))

    # -- what replicas send ----------------------------------------------------------------------
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
        self._last_seen[replica_id] = time.monotonic()
        return self.epoch, replica_id in self._resync

    def report_stats(self, replica_id: str, stats: dict) -> None:
        """A replica's latest engine stats (for /metrics of every ingress and for benchmarks)."""
        self._last_seen[replica_id] = time.monotonic()
        self._replica_stats[replica_id] = {**stats, "reported_at": time.time()}
        self._check_silent()

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
        for d in (self._last_seq, self._last_seen, self._replica_stats):
            d.pop(replica_id, None)
        self._resync.discard(replica_id)

    def replica_stats(self) -> dict[str, dict]:
        self._check_silent()
        return dict(self._replica_stats)

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
        gone = [r for r in {*self.index.replicas, *self._last_seq, *self._replica_stats, *self._last_seen}
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


class KVIndex:
    """Serve deployment (name KVIndex) that owns the application's index actor; see the module
    docstring. It serves no requests: its constructor and health check keep the actor there."""

    PING_TIMEOUT_S = 10.0  # below Serve's health_check_timeout_s (30 s by default)
    UNRESPONSIVE_LIMIT_S = 120.0

    def __init__(self, config) -> None:
        from app.config import ServerConfig

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
                actor = ray.remote(KVIndexActor).options(
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


class IndexFollower:
    """A router-local copy of the application's index, refreshed by a daemon thread every `poll_s`
    (see the module docstring). `match` and `record_routed` never block on the actor."""

    MAX_PENDING_ROUTED = 10_000

    def __init__(self, app_name: str, poll_s: float = 0.1, call_timeout_s: float = 2.0) -> None:
        self.app_name = app_name
        self.poll_s = poll_s
        self.call_timeout_s = call_timeout_s
        self.index = PrefixIndex()  # replaced by one with the actor's settings on the first dump
        self.epoch: str | None = None
        self.version = 0
        self.synced_at: float | None = None  # time.monotonic() of the last successful pull
        self.num_errors = 0
        self._actor = None
        self._routed: list[tuple[str, list[BlockHash]]] = []  # decisions not yet sent to the actor
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-index-follower-{app_name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    @property
    def actor(self):
        return self._actor

    # -- reads and local writes (router threads) -------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        with self._lock:
            return self.index.match(block_hashes)

    def record_routed(self, replica_id: str, block_hashes: list[BlockHash]) -> None:
        """Applied to the local copy at once, and sent to the actor (so that other routers learn
        it) by the refresh thread, with every other decision since its last poll, in one call:
        one actor call per poll instead of one per request (at 250 requests a second, 2-3% of an
        ingress's CPU)."""
        with self._lock:
            self.index.record_routed(replica_id, block_hashes)
            if len(self._routed) < self.MAX_PENDING_ROUTED:  # an index down for long: drop the rest
                self._routed.append((replica_id, block_hashes))

    def keep_only(self, replica_ids: set[str]) -> None:
        """Forget, in the local copy, replicas this router no longer routes to."""
        with self._lock:
            for r in [r for r in self.index.replicas if r not in replica_ids]:
                self.index.remove_replica(r)

    def forget(self, replica_id: str) -> None:
        with self._lock:
            self.index.remove_replica(replica_id)

    # -- the refresh thread ----------------------------------------------------------------------
    def _run(self) -> None:
        warned_at = float("-inf")
        while not self._stop.is_set():
            # Never call into Ray once this process has shut it down: ray.get_actor would start or
            # join a cluster again (auto-init), e.g. in a driver whose handle made this router.
            if not ray.is_initialized():
                return
            try:
                self.sync_once()
            except Exception as e:  # the index is down, restarting or slow: keep the copy, retry
                self.num_errors += 1
                self._actor = None
                if time.monotonic() - warned_at > 30:
                    warned_at = time.monotonic()
                    logger.warning("KV index of app %r unreachable (%r); routing on the local copy",
                                   self.app_name, e)
            self._stop.wait(self.poll_s)

    def sync_once(self) -> None:
        if self._actor is None:
            self._actor = get_index(self.app_name)
            if self._actor is None:
                raise LookupError(f"no actor named {index_actor_name(self.app_name)} (yet)")
        with self._lock:
            routed, self._routed = self._routed, []
        if routed:
            self._actor.record_routed_many.remote(routed)
        epoch, version, entries = ray.get(self._actor.changes.remote(self.epoch, self.version),
                                          timeout=self.call_timeout_s)
        if entries is None:
            self._load_dump()
            return
        with self._lock:
            for _, kind, replica, data in entries:
                if kind == "events":
                    self.index.apply_all(replica, decode_batch(data)[1])
                elif kind == "routed":
                    self.index.record_routed(replica, data)
                else:
                    self.index.remove_replica(replica)
            if epoch != self.epoch:
                logger.info("router follows KV index epoch %s (from %s)", epoch[:8], (self.epoch or "none")[:8])
            self.epoch, self.version = epoch, version
        self.synced_at = time.monotonic()

    def _load_dump(self) -> None:
        epoch, version, settings, blocks = ray.get(self._actor.dump.remote(), timeout=self.call_timeout_s)
        fresh = PrefixIndex(**settings)
        for replica, hashes in blocks.items():
            fresh.add_confirmed(replica, hashes)
        with self._lock:
            self.index, self.epoch, self.version = fresh, epoch, version
        self.synced_at = time.monotonic()
