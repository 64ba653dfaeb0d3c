"""Shared fixtures: paths of the real tiny model in ../shared."""

import os
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


def pytest_sessionfinish(session, exitstatus):
    """Name the threads still alive when the tests are done (a crash while the interpreter shuts
    down, with all tests passed, is easier to place with this and faulthandler's dump)."""
    import threading

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
