"""Triton kernel compiles of this process: how many, how long, and which happened while serving.

Triton compiles a kernel (or loads it from its on-disk cache) the first time a launch brings a new
specialization: new constexpr values, a new dtype, or an integer argument newly divisible by 16 or
equal to 1. At start-up that is expected (the engine's CUDA-graph capture launches every decode
build it will use); once the engine serves, every compile stalls a step for as long as it takes
(up to seconds on a cold machine), which shows up as a latency spike nobody can explain. So the
engine installs this recorder on CUDA: it counts compiles and their seconds (engine stats
`kernel_compiles_total` / `kernel_compile_s_total`, /metrics `llm_engine_kernel_compiles_total`,
`llm_engine_kernel_compile_seconds_total`), and once the engine calls `mark_serving()` it logs a
WARNING naming each further compile's kernel and specialization.

It uses Triton's process-wide hooks `knobs.runtime.jit_cache_hook` (called before a compile or a
disk-cache load, when a launch's specialization is not yet in the kernel's in-memory cache) and
`knobs.runtime.jit_post_compile_hook` (after it), chaining any hooks already installed. Counts are
of this process only: tensor-parallel workers in other processes compile on their own.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class CompileLog:
    """Counts the compiles its hooks see. `on_cache_miss` / `on_compiled` take Triton's hook
    keyword arguments (`fn`, `repr`, ... ) and return what the chained hook returns (a true value
    from jit_cache_hook tells Triton to skip the compile, so this recorder itself returns None)."""

    def __init__(self) -> None:
        self.num_compiles = 0
        self.compile_s = 0.0
        self.num_compiles_serving = 0  # of num_compiles, after mark_serving()
        self.serving = False
        self._started: dict[int, float] = {}  # thread id -> perf_counter at the miss
        self._lock = threading.Lock()
        self._prev_miss = self._prev_compiled = None

    def on_cache_miss(self, **kw):
        self._started[threading.get_ident()] = time.perf_counter()
        return self._prev_miss(**kw) if self._prev_miss is not None else None

    def on_compiled(self, **kw):
        t0 = self._started.pop(threading.get_ident(), None)
        seconds = time.perf_counter() - t0 if t0 is not None else 0.0
        with self._lock:
            self.num_compiles += 1
            self.compile_s += seconds
            if self.serving:
                self.num_compiles_serving += 1
        if self.serving:
            logger.warning("Triton compiled %s while serving (%.2f s; the step waited): a launch specialization "
                           "start-up did not warm", kw.get("repr") or getattr(kw.get("fn"), "name", "?"), seconds)
        return self._prev_compiled(**kw) if self._prev_compiled is not None else None

    def mark_serving(self) -> None:
        self.serving = True

    def stats(self) -> dict:
        return {"kernel_compiles_total": self.num_compiles, "kernel_compile_s_total": self.compile_s,
                "kernel_compiles_serving_total": self.num_compiles_serving}


_LOG: CompileLog | None = None
_INSTALL_LOCK = threading.Lock()


def install() -> CompileLog | None:
    """The process's recorder, installed on Triton's hooks on the first call (None where this
    Triton has no such hooks: counts then stay unknown, and the caller reports none)."""
    global _LOG
    with _INSTALL_LOCK:
        if _LOG is not None:
            return _LOG
        try:
            from triton import knobs
            runtime = knobs.runtime
            runtime.jit_cache_hook, runtime.jit_post_compile_hook  # noqa: B018 (present in this Triton?)
        except (ImportError, AttributeError):
            logger.info("this Triton has no compile hooks (triton.knobs.runtime.jit_cache_hook): kernel compiles "
                        "are not counted")
            return None
        log = CompileLog()
        log._prev_miss, log._prev_compiled = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = log.on_cache_miss, log.on_compiled
        _LOG = log
        return log


def installed() -> CompileLog | None:
    return _LOG
