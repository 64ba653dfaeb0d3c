"""LLMServer: one engine replica (one node's worth of GPUs), as a Ray Serve deployment.

The ingress tokenizes and sends a `GenerateRequest`; `generate` streams the engine's
`RequestOutput` deltas back (call it with `handle.options(stream=True)`). A caller that goes away
cancels the stream, which aborts the request and frees its KV blocks. The replica publishes its
KV events, in numbered batches, and its engine stats (each time Ray Serve calls
`record_routing_stats`) to the application's index actor (app/deployments/kv_index.py), which the
KV-aware routers follow and /metrics reads.

The engine class is injected (`engine_cls`), so a test can run the server on any engine with the
same interface; by default it is the one `engine.backend` names: AsyncLLMEngine over our
LLMEngine ("native"), or VLLMEngine over vLLM's AsyncLLM ("vllm", app/engine/vllm_engine.py).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import AsyncIterator

from app.config import ServerConfig
from app.deployments import logs
from app.engine.outputs import RequestOutput
from app.kv_events.schema import KVEvent
from app.kv_events.wire import encode_batch
from app.serving_types import GenerateRequest, ModelInfo

__all__ = ["LLMServer", "GenerateRequest", "ModelInfo", "set_switch_interval"]

logger = logging.getLogger(__name__)


class LLMServer:
    """The engine replica. Ray Serve deployment name: LLMServer (see builder.py)."""

    def __init__(self, config: ServerConfig | dict, engine_cls=None, kv_index=None) -> None:
        """`kv_index`: the handle of the application's KVIndex deployment; binding it here makes it
        part of the application (the replica talks to the actor it owns, by name)."""
        self.config = config = ServerConfig.model_validate(config)
        logs.install()  # a client's bad request is a warning line here, not a traceback
        set_switch_interval(config.gil_switch_interval_s)  # the engine thread waits less for the GIL
        self.replica_id, self._app_name = _replica_identity()
        # The application's index actor (created by its KVIndex deployment; the KV-aware routers
        # follow it, /metrics reads the stats kept there). Looked up lazily and again after it
        # fails: it may start after this replica or be replaced. Always None outside Ray Serve.
        self._index = None
        self._index_looked_up_at = float("-inf")
        self._pending_events: list[KVEvent] = []
        self._events_lock = threading.Lock()
        self._next_batch_seq = 1
        self._last_cut = time.monotonic()
        self._index_epoch: str | None = None  # the index's epoch when this replica last heard it
        self._status_ref = None  # an index.status call in flight (polled without waiting)
        self._zmq = _zmq_publisher(config.kv_events_endpoint) if config.kv_events_endpoint else None
        t0 = time.perf_counter()
        # The engine (torch, the kernels) is imported here, in the replica, not where the application
        # is built: `serve run`'s build step then imports no torch.
        if engine_cls is None and config.engine.backend == "vllm":
            from app.engine.vllm_engine import VLLMEngine as engine_cls
        elif engine_cls is None:
            from app.engine.async_engine import AsyncLLMEngine as engine_cls
        self.engine = engine_cls(
            config.engine, max_queued_requests=config.max_queued_requests, on_kv_events=self._on_kv_events,
            request_timeout_s=config.request_timeout_s, step_timeout_s=config.step_timeout_s
        )
        self.info = ModelInfo(
            model_id=config.served_model_id,
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.vocab_size,
            block_size=config.engine.block_size,
            kv_cache_dtype=config.engine.kv_cache_dtype,
            tensor_parallel_size=config.engine.tensor_parallel_size,
            num_kv_blocks=self.engine.num_kv_blocks,
        )
        logger.info("LLMServer %s ready in %.1f s: %s", self.replica_id, time.perf_counter() - t0, self.info)

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (with request.stream False, the first and the final ones).
        Raises InvalidRequestError / EngineOverloadedError / EngineDeadError (typed, through the
        handle) before the first output."""
        first = True
        async for out in self.engine.generate(
            request.prompt_token_ids, request.sampling_params, request_id=request.request_id, stream=request.stream,
            block_hashes=request.block_hashes or None,
        ):
            if request.stream or first or out.finished:
                first = False
                out.prompt, out.prompt_token_ids = None, []  # the caller has them (GenerateRequest)
                yield out

    async def model_info(self) -> ModelInfo:
        return self.info

    async def worker_info(self) -> dict:
        """This replica and where its tensor-parallel workers run (node, GPU ids), for placement checks."""
        return {"replica_id": self.replica_id, "workers": self.engine.worker_info()}

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    # -- health, stats, events -----------------------------------------------------------------
    async def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy (restarted)."""
        self.engine.check_health()

    def stats(self) -> dict:
        """Engine state and counters (as of the latest step), as reported to the index."""
        s = {**self.engine.snapshot, "replica_id": self.replica_id, "kv_event_seq": self._next_batch_seq - 1}
        if self._zmq is not None:
            s["kv_events_endpoint"], s["kv_events_replay_endpoint"] = self._zmq.endpoint, self._zmq.replay_endpoint
        return s

    def record_routing_stats(self) -> dict:
        """Ray Serve's hook (request_router_config.request_routing_stats_period_s), called every
        period whichever router the deployment has: what a request router sees of this replica as
        `replica.routing_stats`. It is also this replica's heartbeat to the index: its stats, the
        pending KV events, and a status poll."""
        self._cut_batch()
        s = self.stats()
        index = self._index_actor()
        if index is not None:
            index.report_stats.remote(self.replica_id, s)
            self._poll_index()
        return {k: s[k] for k in ("num_running", "num_waiting", "num_queued_tokens", "num_free_kv_blocks",
                                  "num_kv_blocks", "kv_event_seq")}

    def _index_actor(self):
        if self._index is None and self._app_name is not None and time.monotonic() - self._index_looked_up_at > 1.0:
            from app.router.index_actor import get_index

            self._index_looked_up_at = time.monotonic()
            self._index = get_index(self._app_name)
        return self._index

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
            except Exception as e:  # the index is restarting or was replaced: look it up again
                logger.info("KV index status unavailable (%r)", e)
                self._index = None
                return
            if wanted or (self._index_epoch is not None and epoch != self._index_epoch):
                self._publish_snapshot(epoch)
            self._index_epoch = epoch
        self._status_ref = self._index.status.remote(self.replica_id)

    def _publish_snapshot(self, epoch: str) -> None:
        snapshot = self.engine.kv_cache_snapshot_events()
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
            events, self._pending_events = self._pending_events, []
            seq = self._next_batch_seq
            self._next_batch_seq += 1
            # Numbered even while no index is there: a new index sees the gap and asks for a resync.
            index = self._index
            payload = encode_batch(time.time(), events)
            if index is not None:
                index.publish.remote(self.replica_id, seq, payload)
            if self._zmq is not None:
                self._zmq.publish_payload(payload)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        if getattr(self, "_zmq", None) is not None:
            self._zmq.close()


def set_switch_interval(seconds: float | None) -> None:
    """sys.setswitchinterval(seconds) for this process (ServerConfig.gil_switch_interval_s; None leaves
    Python's), logged as the process then runs with it."""
    if seconds is not None:
        sys.setswitchinterval(seconds)
    logger.info("GIL switch interval %.3g ms", 1e3 * sys.getswitchinterval())


def _zmq_publisher(endpoint: str):
    """The ZMQ publisher of kv_events_endpoint; a tcp endpoint names this node's address."""
    from app.kv_events.zmq_transport import ZmqEventPublisher

    if endpoint.startswith("ipc://"):
        return ZmqEventPublisher(endpoint, endpoint + "-replay")
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
    pub = ZmqEventPublisher(endpoint, f"tcp://{host}:0")
    if host in ("*", "0.0.0.0"):  # say where to connect: this node's address
        try:
            import ray

            node = ray.util.get_node_ip_address()
        except Exception:  # outside Ray
            node = "127.0.0.1"
        pub.endpoint = pub.endpoint.replace(f"tcp://{host}:", f"tcp://{node}:")
        pub.replay_endpoint = pub.replay_endpoint.replace(f"tcp://{host}:", f"tcp://{node}:")
    return pub


def _replica_identity() -> tuple[str, str | None]:
    """(replica id, application name) inside Ray Serve; ("local", None) outside it."""
    try:
        from ray import serve

        replica_id = serve.get_replica_context().replica_id
    except Exception:  # not running inside Ray Serve (a unit test)
        return "local", None
    return replica_id.unique_id, replica_id.deployment_id.app_name
