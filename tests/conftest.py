"""Shared fixtures: paths of the real tiny model in ../shared."""

from pathlib import Path

import pytest

STORIES_DIR = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
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
