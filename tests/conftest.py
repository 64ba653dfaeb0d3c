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
