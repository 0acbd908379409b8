"""e2e fixtures: the shared tiny tokenizer (tests/conftest.py) under the name the e2e modules use."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def e2e_tokenizer_dir(tiny_tokenizer_dir) -> Path:
    return Path(tiny_tokenizer_dir)
