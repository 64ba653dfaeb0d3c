"""RayExecutor (distributed_executor_backend "ray"): tensor-parallel workers as Ray actors on the
bundles of a placement group.

A replica's placement group has one bundle per rank (app/engine/placement.py), STRICT_PACK so that
all of a replica's ranks share a node (NCCL over NVLink) and a replica that fits no node stays
pending instead of being split; bundle 0 also holds the replica (the engine's process) itself.
Rank i runs on bundle i of the placement group the engine runs in (Ray Serve's replica placement
group), or of one RayExecutor creates when the engine runs outside any.

Each step the driver sends every rank the same compact StepMessage (model_runner.py); all ranks
run the forward, and rank 0 samples and returns the sampled ids and logprobs. A rank that dies
or raises stops all of them and surfaces as EngineDeadError; nothing waits on a dead rank.

Ray is imported only here and in tp_worker.py (the worker actor), and only when the engine runs
with this executor.
"""

from __future__ import annotations

import logging
import time

from app.config import EngineConfig
from app.engine.errors import EngineDeadError
from app.engine.executor import Executor
from app.engine.model_runner import StepMessage
from app.engine.placement import DEFAULT_CPUS_PER_WORKER, PLACEMENT_STRATEGY, placement_bundles
from app.engine.sampler import SamplerOutput
from app.engine.tp_worker import TPWorker

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 300.0  # wait this long for a placement group RayExecutor creates itself
WORKER_START_TIMEOUT_S = 300.0  # a worker not started by then did not fit its bundle


def wait_for_placement_group(pg, timeout_s: float) -> None:
    """Block until `pg` is placed; after timeout_s raise RuntimeError saying what did not fit."""
    import ray

    try:
        ray.get(pg.ready(), timeout=min(timeout_s, 5.0))
        return
    except ray.exceptions.GetTimeoutError:
        pass
    what = f"{len(pg.bundle_specs)} bundles {pg.bundle_specs[0]} ({PLACEMENT_STRATEGY}: all on one node)"
    logger.warning("waiting for a placement group of %s: no node has room for it yet", what)
    try:
        ray.get(pg.ready(), timeout=max(timeout_s - 5.0, 0.0))
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"placement group of {what} was not placed within {timeout_s:.0f} s: no node "
                           f"has that many free GPUs/CPUs; free a node or lower tensor_parallel_size") from None


class TPWorkerGroup:
    """tp_size TPWorker actors, rank i on bundle i of a placement group; calls with failure checks.

    placement_group: the group to use; default: the one this process runs in (a Ray Serve
    replica's), else a new STRICT_PACK group of placement_bundles(tp_size, cpus_per_worker, gpu)
    that this object owns and removes at shutdown. Each worker takes its bundle's GPU (if the
    bundle has one) and the smallest CPU share of the group's bundles (bundle 0 may also hold the
    replica), unless cpus_per_worker says otherwise.
    """

    def __init__(self, tp_size: int, *, gpu: bool = False, placement_group=None,
                 cpus_per_worker: float | None = None, placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
                 start_timeout_s: float = WORKER_START_TIMEOUT_S) -> None:
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.tp_size = tp_size
        self.workers: list = []
        self._owned_pg = None
        self._dead: EngineDeadError | None = None
        pg = placement_group if placement_group is not None else get_current_placement_group()
        if pg is None:
            cpus = DEFAULT_CPUS_PER_WORKER[gpu] if cpus_per_worker is None else cpus_per_worker
            pg = ray.util.placement_group(placement_bundles(tp_size, cpus, gpu), strategy=PLACEMENT_STRATEGY)
            self._owned_pg = pg
            try:
                wait_for_placement_group(pg, placement_timeout_s)
            except BaseException:
                self.shutdown()
                raise
        specs = pg.bundle_specs
        if len(specs) < tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} needs {tp_size} bundles, one per worker; the placement "
                             f"group has {len(specs)}: {specs}")
        specs = specs[:tp_size]
        self.bundles = specs
        self.uses_gpu = all(b.get("GPU", 0) >= 1 for b in specs)
        if cpus_per_worker is None:
            cpus_per_worker = min(b.get("CPU", 0.0) for b in specs)
        worker_cls = ray.remote(TPWorker)
        for rank in range(tp_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank)
            self.workers.append(worker_cls.options(
                num_cpus=cpus_per_worker, num_gpus=1 if self.uses_gpu else 0, scheduling_strategy=strategy,
            ).remote(rank, tp_size, rank))
        self.placement_group = pg
        resources = {"CPU": cpus_per_worker, **({"GPU": 1} if self.uses_gpu else {})}
        try:
            self._info = self.call("info", timeout_s=start_timeout_s,
                                   hint=f"each worker needs {resources} of its bundle {specs}; bundle 0 also "
                                        "holds the replica, so size it with placement_bundles(driver_cpus=...)")
        except EngineDeadError:
            self.shutdown()
            raise
        nodes = sorted({i["node_id"] for i in self._info})
        logger.info("%d tensor-parallel workers on node(s) %s, GPU ids %s", tp_size, nodes,
                    [i["gpu_ids"] for i in self._info])

    def worker_info(self) -> list[dict]:
        return [dict(i) for i in self._info]

    def refresh_info(self) -> None:
        self._info = self.call("info")

    def call(self, method: str, *args, ranks: list[int] | None = None, timeout_s: float | None = None,
             hint: str = "") -> list:
        """Call `method` on the workers (all, or `ranks`) and return their results in rank order.

        Returns as soon as every call finished; any rank that dies, raises or (with timeout_s)
        does not answer in time stops all workers and raises EngineDeadError at once.
        """
        import ray

        if self._dead is not None:
            raise EngineDeadError(f"tensor-parallel workers are stopped: {self._dead}")
        ranks = list(range(self.tp_size)) if ranks is None else ranks
        refs = [getattr(self.workers[r], method).remote(*args) for r in ranks]
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                late = [ranks[refs.index(r)] for r in pending]
                self._fail(f"ranks {late} did not answer {method}() within {timeout_s:.0f} s. {hint}".strip())
            try:
                ray.get(ready[0])
            except Exception as e:  # RayActorError (the worker died) or RayTaskError (it raised)
                rank = ranks[refs.index(ready[0])]
                self._fail(f"rank {rank} failed in {method}(): {type(e).__name__}: {e}", e)
        return ray.get(refs)

    def _fail(self, reason: str, cause: BaseException | None = None):
        self._dead = EngineDeadError(
            f"tensor-parallel worker failure: {reason}; all {self.tp_size} workers were stopped, restart the engine")
        self.shutdown()
        raise self._dead from cause

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []
        if self._owned_pg is not None:
            try:
                ray.util.remove_placement_group(self._owned_pg)
            except Exception:  # noqa: BLE001 - Ray already shut down
                pass
            self._owned_pg = None
        if self._dead is None:
            self._dead = EngineDeadError("the tensor-parallel workers were shut down")


class RayExecutor(Executor):
    """tensor_parallel_size > 1: one TPWorker per rank; see the module docstring.

    The workers compute on config.device (nccl on CUDA, gloo on CPU unless
    config.distributed_backend says otherwise). Every rank sizes its KV cache with the same
    rule (kv_cache_memory or GPU memory, per rank) and all allocate the smallest count, so one
    block id means the same pages on every rank.
    """

    def __init__(self, config: EngineConfig, vocab_size: int, max_model_len: int, placement_group=None) -> None:
        super().__init__()
        self.execute_timeout_s = config.execute_timeout_s
        tp = config.tensor_parallel_size
        on_cuda = config.device.startswith("cuda")
        self.group = TPWorkerGroup(tp, gpu=on_cuda, placement_group=placement_group)
        try:
            if on_cuda and not self.group.uses_gpu:
                raise ValueError(f"device {config.device!r} with tensor_parallel_size {tp} needs a GPU per worker, "
                                 f"but the placement group's bundles have none: {self.group.bundles}")
            backend = config.distributed_backend
            if backend == "auto":
                backend = "nccl" if on_cuda else "gloo"
            (address,) = self.group.call("rendezvous_address", ranks=[0])
            fits = self.group.call("load", config, vocab_size, max_model_len, address, backend)
            self.num_kv_blocks = min(fits)
            if max(fits) != self.num_kv_blocks:
                logger.info("KV blocks per rank %s: every rank allocates %d", fits, self.num_kv_blocks)
            self.group.call("allocate_kv_cache", self.num_kv_blocks)
            self.group.refresh_info()
        except BaseException:
            self.group.shutdown()
            raise

    def _execute(self, message: StepMessage) -> SamplerOutput | None:
        import ray

        ref = ray.put(message)  # serialized once for all ranks
        return self.group.call("execute", ref, timeout_s=self.execute_timeout_s,
                               hint="(execute_timeout_s: a rank hung or a collective is stuck)")[0]

    def worker_info(self) -> list[dict]:
        return self.group.worker_info()

    def shutdown(self) -> None:
        self.group.shutdown()

    def __del__(self) -> None:
        group = getattr(self, "group", None)
        if group is not None and group.workers:
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - interpreter or Ray already shutting down
                pass
