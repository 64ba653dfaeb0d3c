"""MultiprocExecutor: tensor parallelism on one node with one worker process per rank, no Ray.

`distributed_executor_backend: mp`. The engine's process starts tensor_parallel_size workers
(multiprocessing, spawn): rank r computes on cuda:r of the engine's visible GPUs (or on the CPU),
joins an NCCL (gloo on CPU) process group over a local rendezvous, loads only its shard and
answers the driver over its own pipe. Each step the driver pickles the compact StepMessage once
and writes the same bytes to every pipe; every rank runs the forward, rank 0 also samples and
sends back the SamplerOutput, the others an empty acknowledgement. With async scheduling the
driver sends "launch" instead: each rank launches the step, then answers the step before it (rank
0's samples reach the other ranks by a broadcast, which they need as the next step's inputs), and
"flush" asks for the answer of the last one.

Failures never hang the engine: the driver waits on the pipes and on the processes' sentinels
together, so a worker that exits (killed, crashed, out of memory) is seen at once; a step that
some rank has not finished within execute_timeout_s (a hung rank, a stuck collective) is a
failure too. Either way every worker is killed and the engine raises EngineDeadError (each open
request gets the error), instead of waiting out NCCL's own timeout. A rank that raises stops all
of them the same way.

vLLM also runs single-node tensor parallelism in worker processes and keeps Ray for multi-node;
the worker code here is the Ray executor's (tp_rank.start_rank, ModelRunner.execute).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import time
import traceback
from multiprocessing.connection import Connection, wait

from app.config import EngineConfig
from app.engine.errors import EngineDeadError
from app.engine.executor import Executor
from app.engine.model_runner import StepMessage
from app.engine.sampler import SamplerOutput

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a shard (and, on CUDA, initialising NCCL) must finish by then
SHUTDOWN_GRACE_S = 5.0


def _worker_main(rank: int, tp_size: int, config: EngineConfig, vocab_size: int, max_model_len: int,
                 init_method: str, backend: str, conn: Connection) -> None:
    """A worker process: load, then answer commands until told to stop or the pipe closes (a CPU
    rank's torch threads are set by its ModelRunner: model_runner.cpu_threads)."""
    from app.engine.tp_rank import start_rank

    try:
        runner = start_rank(config, vocab_size, max_model_len, rank, tp_size, init_method, backend, cuda_index=rank)
        conn.send(("ok", {"rank": rank, "pid": os.getpid(), "device": str(runner.device),
                          "kv_blocks_fit": runner.num_kv_blocks_fit(max_model_len),
                          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}))

        def answer(out, timing: dict) -> None:
            conn.send_bytes(pickle.dumps(("ok", (out, timing) if rank == 0 else None)))

        owed = None  # async scheduling: the launched step not answered yet, and its timing
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:  # the driver is gone
                return
            command, arg = pickle.loads(data)
            if command == "stop":
                return
            if command == "allocate_kv_cache":
                runner.allocate_kv_cache(arg)
                conn.send(("ok", None))
            elif command == "execute":  # run the step to the end and answer
                answer(runner.execute(arg), runner.last_timing)
            elif command == "launch":  # async scheduling: launch this step, then answer the one before
                launched = (runner.launch(arg), dict(runner.last_timing))
                if owed is not None:
                    answer(owed[0].result(), owed[1])
                owed = launched
            elif command == "sample":  # rank 0: sample the step launched last with defer_sample
                runner.sample(arg)
            elif command == "flush":  # answer the step launched last
                if owed is not None:
                    answer(owed[0].result(), owed[1])
                    owed = None
            else:
                raise ValueError(f"unknown command {command!r}")
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which stops every rank
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:  # noqa: BLE001 - the pipe is gone too
            pass
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer already died
            pass


class MultiprocExecutor(Executor):
    """tensor_parallel_size > 1 in worker processes of this node; see the module docstring."""

    supports_async = True

    def __init__(self, config: EngineConfig, vocab_size: int, max_model_len: int) -> None:
        super().__init__()
        from app.engine.tp_rank import free_port_address

        self.tp_size = tp = config.tensor_parallel_size
        self.execute_timeout_s = config.execute_timeout_s
        self._dead: EngineDeadError | None = None
        self._last_timing: dict = {}
        self._num_launched = self._num_answered = 0  # async scheduling's steps
        # the last rank first, rank 0 (which also samples) last: 8.67 vs 8.92 ms per 8B decode step at
        # TP=2 (experiments/tp_ab.py, docs/history.md)
        self._send_order = list(reversed(range(tp)))
        self.procs: list = []
        self.conns: list[Connection] = []
        on_cuda = config.device.startswith("cuda")
        if on_cuda:
            import torch

            if torch.cuda.device_count() < tp:
                raise ValueError(f"tensor_parallel_size {tp} with distributed_executor_backend 'mp' needs {tp} GPUs "
                                 f"visible to the engine's process; it sees {torch.cuda.device_count()} "
                                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        backend = config.distributed_backend
        if backend == "auto":
            backend = "nccl" if on_cuda else "gloo"
        init_method = free_port_address("127.0.0.1")
        ctx = mp.get_context("spawn")
        try:
            for rank in range(tp):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, name=f"tp-worker-{rank}", daemon=True,
                                   args=(rank, tp, config, vocab_size, max_model_len, init_method, backend, child))
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            self._info = self._gather("load", START_TIMEOUT_S)
            self.num_kv_blocks = min(i["kv_blocks_fit"] for i in self._info)
            self._broadcast(("allocate_kv_cache", self.num_kv_blocks))
            self._gather("allocate_kv_cache", START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d tensor-parallel worker processes (%s), pids %s, %d KV blocks", tp, backend,
                    [i["pid"] for i in self._info], self.num_kv_blocks)

    def _execute(self, message: StepMessage) -> SamplerOutput | None:
        self._broadcast(("execute", message))
        out, self._last_timing = self._gather("execute", self.execute_timeout_s)[0]
        return out

    # Async scheduling: "launch" makes each rank launch the step and then answer the step launched
    # before it, so a rank starts step N + 1 before it waits for step N's samples (under tensor
    # parallelism the other ranks take those from rank 0 by a broadcast, ModelRunner._previous_samples);
    # "flush" asks for the answer of the step launched last, when no next step comes.
    def _launch(self, message: StepMessage) -> int | SamplerOutput | None:
        if not self.pipelined:
            return self._execute(message)
        self._broadcast(("launch", message))
        self._num_launched += 1
        return self._num_launched

    def _sample(self, grammar) -> None:
        self._send(0, ("sample", grammar))  # only rank 0 samples

    def _collect(self, handle):
        if not self.pipelined:
            return handle
        assert handle == self._num_answered + 1, "steps are collected in the order they were launched"
        if handle == self._num_launched:
            self._broadcast(("flush", None))
        out, self._last_timing = self._gather("execute", self.execute_timeout_s)[0]
        self._num_answered += 1
        return out

    def collect(self, step):
        result = super().collect(step)
        if self.pipelined:  # its timing came with its answer
            step.timing = dict(self._last_timing)
        return result

    def abandon(self, step) -> None:
        """Take the answers of the steps launched and not collected, which the ranks still owe."""
        super().abandon(step)
        try:
            while self.pipelined and self._num_answered < self._num_launched:
                self._collect(self._num_answered + 1)
        except EngineDeadError:
            pass  # the workers are stopped: nothing is owed any more

    @property
    def last_timing(self) -> dict:
        return self._last_timing

    def worker_info(self) -> list[dict]:
        return [{k: v for k, v in i.items() if k != "kv_blocks_fit"} for i in self._info]

    # -- transport -------------------------------------------------------------------------------
    def _broadcast(self, command: tuple) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"tensor-parallel workers are stopped: {self._dead}")
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)  # once for all ranks
        first = data
        name, arg = command
        if isinstance(arg, StepMessage) and arg.grammar is not None:  # the mask is rank 0's alone
            data = pickle.dumps((name, dataclasses.replace(arg, grammar=None)), protocol=pickle.HIGHEST_PROTOCOL)
        for rank in self._send_order:
            self._send(rank, command, first if rank == 0 else data)

    def _send(self, rank: int, command: tuple, data: bytes | None = None) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"tensor-parallel workers are stopped: {self._dead}")
        if data is None:
            data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.conns[rank].send_bytes(data)
        except OSError as e:  # the worker's end is closed: it died
            self._fail(f"rank {rank} is gone ({self._exit_status(rank)}) and could not be sent {command[0]}()", e)

    def _gather(self, what: str, timeout_s: float | None) -> list:
        """Every rank's answer, in rank order; a death, an error or the deadline fails the engine."""
        if self._dead is not None:
            raise EngineDeadError(f"tensor-parallel workers are stopped: {self._dead}")
        answers: dict[int, object] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        by_conn = {conn: rank for rank, conn in enumerate(self.conns)}
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while len(answers) < self.tp_size:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            waiting = [c for c, r in by_conn.items() if r not in answers]
            ready = wait(waiting + [s for s, r in by_sentinel.items() if r not in answers], timeout=remaining)
            if not ready:
                late = sorted(set(range(self.tp_size)) - set(answers))
                self._fail(f"ranks {late} did not answer {what}() within {timeout_s:g} s "
                           "(execute_timeout_s: a rank hung or a collective is stuck)")
            for obj in ready:
                if obj in by_conn:
                    rank = by_conn[obj]
                    try:
                        status, value = obj.recv()
                    except (EOFError, OSError) as e:
                        self._fail(f"rank {rank} died in {what}() ({self._exit_status(rank)})", e)
                    if status != "ok":
                        self._fail(f"rank {rank} failed in {what}(): {value}")
                    answers[rank] = value
            for obj in ready:  # a process that exited without answering
                rank = by_sentinel.get(obj)
                if rank is not None and rank not in answers and not self.conns[rank].poll():
                    self._fail(f"rank {rank} died in {what}() ({self._exit_status(rank)})")
        return [answers[r] for r in range(self.tp_size)]

    def _exit_status(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=1.0)  # a process whose pipe just closed is usually exiting: reap it
        code = proc.exitcode
        if code is None:
            return f"pid {proc.pid}, still running"
        return f"pid {proc.pid}, exit code {code}" + (f" (signal {-code})" if code < 0 else "")

    def _fail(self, reason: str, cause: BaseException | None = None):
        self._dead = EngineDeadError(
            f"tensor-parallel worker failure: {reason}; all {self.tp_size} workers were stopped, restart the engine")
        logger.error("%s", self._dead)
        self._stop(graceful=False)
        raise self._dead from cause

    # -- lifecycle -----------------------------------------------------------------------------
    def _stop(self, graceful: bool) -> None:
        if graceful:
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(("stop", None)))
                except OSError:
                    pass
            end = time.monotonic() + SHUTDOWN_GRACE_S
            for proc in self.procs:
                proc.join(timeout=max(end - time.monotonic(), 0.0))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()  # SIGKILL: a rank stuck in a collective ignores anything gentler
        for proc in self.procs:
            proc.join(timeout=SHUTDOWN_GRACE_S)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def shutdown(self) -> None:
        if self.procs:
            self._stop(graceful=self._dead is None)
        if self._dead is None:
            self._dead = EngineDeadError("the tensor-parallel workers were shut down")

    def __del__(self) -> None:
        if getattr(self, "procs", None):
            try:
                self._stop(graceful=False)
            except Exception:  # noqa: BLE001 - interpreter shutting down
                pass
