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

It wraps `JITFunction._do_compile`, which Triton (3.4 and later; Gluon kernels included) calls
when a launch's specialization is not yet in the kernel's in-memory cache, to compile it or load it
from its disk cache. (Triton's `knobs.runtime.jit_cache_hook` would be the public way, but with any
hook set Triton 3.6 serializes each specialization to JSON, and Gluon's layout constexprs are not
JSON-serializable: every Gluon compile then fails.) Counts are of this process only: tensor-parallel
workers in other processes compile on their own.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class CompileLog:
    """Counts the compiles `record` is told of; after `mark_serving()` each is also logged as a warning."""

    def __init__(self) -> None:
        self.num_compiles = 0
        self.compile_s = 0.0
        self.num_compiles_serving = 0  # of num_compiles, after mark_serving()
        self.serving = False
        self._lock = threading.Lock()

    def record(self, what: str, seconds: float) -> None:
        with self._lock:
            self.num_compiles += 1
            self.compile_s += seconds
            if self.serving:
                self.num_compiles_serving += 1
        if self.serving:
            logger.warning("Triton compiled %s while serving (%.2f s; the step waited): a launch specialization "
                           "start-up did not warm", what, seconds)

    def mark_starting(self) -> None:
        """An engine of this process starts: its compiles are start-up ones until mark_serving()."""
        self.serving = False

    def mark_serving(self) -> None:
        self.serving = True

    def stats(self) -> dict:
        return {"kernel_compiles_total": self.num_compiles, "kernel_compile_s_total": self.compile_s,
                "kernel_compiles_serving_total": self.num_compiles_serving}


def describe(fn, signature, constexprs) -> str:
    """A kernel's name and specialization, as a compile's log line names it: the argument types
    Triton specialized on (e.g. `i32` vs `constexpr` for an integer equal to 1) and the constexpr values."""
    try:
        names = fn.arg_names
        values = {names[k[0]] if isinstance(k, tuple) and len(k) == 1 else str(k): v for k, v in constexprs.items()}
        sig = ", ".join(f"{n}: {t}" for n, t in signature.items() if t != "constexpr")
        consts = ", ".join(f"{n}={v!r}"[:80] for n, v in values.items())
        return f"{fn.fn.__qualname__}({sig}; {consts})"
    except Exception:  # a description is never worth a failed compile
        return getattr(getattr(fn, "fn", None), "__qualname__", "?")


_LOG: CompileLog | None = None
_INSTALL_LOCK = threading.Lock()


def install() -> CompileLog | None:
    """The process's recorder, wrapped around Triton's compile on the first call (None where this
    Triton has no JITFunction._do_compile: counts then stay unknown, and the caller reports none)."""
    global _LOG
    with _INSTALL_LOCK:
        if _LOG is not None:
            return _LOG
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return None
        compile_fn = getattr(JITFunction, "_do_compile", None)
        if compile_fn is None:
            logger.info("this Triton has no JITFunction._do_compile: kernel compiles are not counted")
            return None
        log = CompileLog()

        def _do_compile(self, key, signature, device, constexprs, *args, **kwargs):
            start = time.perf_counter()
            kernel = compile_fn(self, key, signature, device, constexprs, *args, **kwargs)
            log.record(describe(self, signature, constexprs), time.perf_counter() - start)
            return kernel

        JITFunction._do_compile = _do_compile
        _LOG = log
        return log
