"""LLMServer: one engine replica (one node's worth of GPUs), as a Ray Serve deployment.

The ingress tokenizes and sends a `GenerateRequest`; `generate` streams the engine's
`RequestOutput` deltas back (call it with `handle.options(stream=True)`). A caller that goes away
cancels the stream, which aborts the request and frees its KV blocks. The replica also reports
routing stats (Ray Serve calls `record_routing_stats` periodically) and keeps its KV events in
numbered batches for the KV-aware router to consume.

The engine class is injected (`engine_cls`), so a test can run the server on any engine with the
same interface; by default it is AsyncLLMEngine over our LLMEngine.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import AsyncIterator

from app.config import ServerConfig
from app.engine.async_engine import AsyncLLMEngine
from app.engine.engine import RequestOutput
from app.engine.kv_events import KVEvent
from app.engine.sampling_params import SamplingParams
from app.deployments.types import GenerateRequest, KVEventBatch, ModelInfo
from app.router.events import encode_batch

__all__ = ["LLMServer", "GenerateRequest", "KVEventBatch", "ModelInfo"]

logger = logging.getLogger(__name__)

_MAX_KV_EVENT_BATCHES = 4096  # kept for consumers that poll; older batches are dropped


class LLMServer:
    """The engine replica. Ray Serve deployment name: LLMServer (see builder.py)."""

    def __init__(self, config: ServerConfig | dict, engine_cls=AsyncLLMEngine) -> None:
        self.config = config = ServerConfig.model_validate(config)
        self.replica_id, app_name = _replica_identity()
        # The application's shared KV index actor (the KV-aware router reads it; it also keeps every
        # replica's latest stats, with or without that router); None outside Ray Serve.
        self._index = None
        if app_name is not None:
            from app.router.kv_router import get_or_create_index

            self._index = get_or_create_index(
                app_name, max_blocks=config.router.index_max_blocks, predicted_ttl_s=config.router.predicted_ttl_s
            )
        self._pending_events: list[KVEvent] = []
        self._events_lock = threading.Lock()
        self._batches: collections.deque[KVEventBatch] = collections.deque(maxlen=_MAX_KV_EVENT_BATCHES)
        self._next_batch_seq = 1
        self._last_cut = time.monotonic()
        self._index_epoch: str | None = None  # the index's epoch when this replica last heard it
        self._status_ref = None  # an index.status call in flight (polled without waiting)
        t0 = time.perf_counter()
        self.engine = engine_cls(
            config.engine, max_queued_requests=config.max_queued_requests, on_kv_events=self._on_kv_events,
            request_timeout_s=config.request_timeout_s, step_timeout_s=config.step_timeout_s
        )
        inner = self.engine.engine
        self.info = ModelInfo(
            model_id=config.served_model_id,
            max_model_len=inner.max_model_len,
            vocab_size=inner.vocab_size,
            block_size=config.engine.block_size,
            kv_cache_dtype=config.engine.kv_cache_dtype,
            tensor_parallel_size=config.engine.tensor_parallel_size,
            num_kv_blocks=inner.num_kv_blocks,
        )
        logger.info("LLMServer %s ready in %.1f s: %s", self.replica_id, time.perf_counter() - t0, self.info)

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs. Raises InvalidRequestError / EngineOverloadedError /
        EngineDeadError (typed, through the handle) before the first output."""
        async for out in self.engine.generate(
            request.prompt_token_ids, request.sampling_params, request_id=request.request_id
        ):
            if request.prompt is not None:
                out.prompt = request.prompt
            yield out

    async def model_info(self) -> ModelInfo:
        return self.info

    async def worker_info(self) -> dict:
        """This replica and where its tensor-parallel workers run (node, GPU ids), for placement checks."""
        return {"replica_id": self.replica_id, "workers": self.engine.engine.worker_info()}

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    # -- health, stats, events -----------------------------------------------------------------
    async def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy (restarted)."""
        self.engine.check_health()

    def stats(self) -> dict:
        """Engine state and counters (as of the latest step), for /metrics and the router."""
        return {**self.engine.snapshot, "replica_id": self.replica_id, "kv_event_seq": self._next_batch_seq - 1}

    async def get_stats(self) -> dict:
        return self.stats()

    def record_routing_stats(self) -> dict:
        """Ray Serve's hook (request_router_config.request_routing_stats_period_s): what a request
        router sees of this replica as `replica.routing_stats`."""
        self._cut_batch()
        s = self.stats()
        if self._index is not None:
            self._index.report_stats.remote(self.replica_id, s)
            self._poll_index()
        return {k: s[k] for k in ("num_running", "num_waiting", "num_queued_tokens", "num_free_kv_blocks",
                                  "num_kv_blocks", "kv_event_seq")}

    def _poll_index(self) -> None:
        """Resync the router's index when it asks for this replica's full block set (after a gap in
        the batches it received) or when its epoch changed (it restarted, empty): the prefix cache
        goes out as one batch opening with AllBlocksCleared. Polled from the periodic routing-stats
        hook; never waits on the index (a status call in flight is checked, not awaited)."""
        import ray

        ref = self._status_ref
        if ref is not None:
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                return
            self._status_ref = None
            try:
                epoch, wanted = ray.get(ref)
            except Exception as e:  # the index is restarting: ask again next time
                logger.info("KV index status unavailable (%r)", e)
                return
            if wanted or (self._index_epoch is not None and epoch != self._index_epoch):
                self._publish_snapshot(epoch)
            self._index_epoch = epoch
        self._status_ref = self._index.status.remote(self.replica_id)

    def _publish_snapshot(self, epoch: str) -> None:
        snapshot = self.engine.engine.kv_cache_snapshot_events()
        logger.info("replica %s resyncs the KV index (epoch %s): %d cached blocks", self.replica_id, epoch[:8],
                    len(snapshot) - 1)
        with self._events_lock:
            # events not yet published happened before the snapshot: it supersedes them
            self._pending_events = snapshot
        self._cut_batch()

    def _on_kv_events(self, events: list[KVEvent]) -> None:  # engine thread
        with self._events_lock:
            self._pending_events.extend(events)
        if time.monotonic() - self._last_cut >= self.config.kv_events_period_s:
            self._cut_batch()

    def _cut_batch(self) -> None:
        with self._events_lock:
            self._last_cut = time.monotonic()
            if not self._pending_events:
                return
            batch = KVEventBatch(self._next_batch_seq, time.time(), self.replica_id, self._pending_events)
            self._pending_events = []
            self._next_batch_seq += 1
            self._batches.append(batch)
            if self._index is not None:
                self._index.publish.remote(self.replica_id, batch.seq, encode_batch(batch.ts, batch.events))

    async def kv_event_batches(self, after_seq: int = 0) -> list[KVEventBatch]:
        """Batches numbered above `after_seq`, oldest first (pending events are cut first). A
        consumer whose `after_seq` is older than the oldest kept batch has missed events and
        should drop what it knows of this replica (the first batch's seq tells it)."""
        self._cut_batch()
        with self._events_lock:
            return [b for b in self._batches if b.seq > after_seq]

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _replica_identity() -> tuple[str, str | None]:
    """(replica id, application name) inside Ray Serve; ("local", None) outside it."""
    try:
        from ray import serve

        replica_id = serve.get_replica_context().replica_id
    except Exception:  # not running inside Ray Serve (a unit test)
        return "local", None
    return replica_id.unique_id, replica_id.deployment_id.app_name
