"""Shared fixtures: paths of the real tiny model in ../shared."""

import os
import threading
from pathlib import Path

# Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter. triton.jit reads
# the flag when a kernel module is imported (app.engine.kv_cache may import them), so it is set
# here, before any test module loads. CPU tests never launch a compiled kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# ../shared/models/stories260K beside the checkout, or $STORIES260K_DIR (the GPU machine gets a copy)
STORIES_DIR = Path(os.environ.get("STORIES260K_DIR") or
                   Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K")
STORIES_MODEL = STORIES_DIR / "stories260K.bin"
STORIES_TOKENIZER = STORIES_DIR / "tok512.bin"
STORIES_GREEDY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball."
)


@pytest.fixture(scope="session")
def stories_paths():
    if not STORIES_MODEL.exists():
        pytest.skip(f"stories260K not found at {STORIES_DIR}")
    return str(STORIES_MODEL), str(STORIES_TOKENIZER)


def _stop_serve_router_loop() -> None:
    """Stop the event loop thread Ray Serve keeps in a driver that made DeploymentHandles (one per
    process, for all handles' routers, never stopped by serve.shutdown or ray.shutdown). Its loop
    records Ray metrics every few seconds; left running into the interpreter's shutdown it calls
    into Ray's C++ side while that is torn down (the suite's process ran ~20 Ray sessions)."""
    try:
        from ray.serve._private.router import SingletonThreadRouter
    except ImportError:
        return
    loop = getattr(SingletonThreadRouter, "_asyncio_loop", None)
    if loop is None or loop.is_closed():
        return
    monitor = getattr(SingletonThreadRouter, "_event_loop_monitor", None)
    if monitor is not None:
        loop.call_soon_threadsafe(monitor.stop)
    loop.call_soon_threadsafe(loop.stop)
    for t in threading.enumerate():
        if "_run_router_event_loop" in t.name:
            t.join(5.0)
    SingletonThreadRouter._asyncio_loop = None
    SingletonThreadRouter._event_loop_monitor = None


def pytest_sessionfinish(session, exitstatus):
    """Stop Ray Serve's driver-side router loop, then name the threads still alive when the tests
    are done (a crash while the interpreter shuts down, with all tests passed, is easier to place
    with this and faulthandler's dump)."""
    _stop_serve_router_loop()
    alive = [t for t in threading.enumerate() if t is not threading.main_thread()]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if alive and reporter is not None:
        reporter.ensure_newline()
        reporter.write_line("threads alive at the end of the session: " +
                            ", ".join(f"{t.name} (daemon)" if t.daemon else t.name for t in alive))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # pytest's own faulthandler stops with the session; a crash in the interpreter's shutdown after
    # it (exit code 139, no traceback) should still name the threads and their stacks
    import faulthandler

    faulthandler.enable(all_threads=True)
