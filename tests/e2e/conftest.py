"""e2e fixtures shared by the modules: the tiny tokenizer (tests/conftest.py) under the name the e2e modules
use, loaded (``e2e_tokenizer``), and the agent APIs' scripted server (``agent_server``, agent_server.py).

Their names are distinct from any module's own fixtures (several modules define a ``server`` of their own): a
module fixture of the same name would silently replace one of these (tests/unit/test_fixture_names.py checks).
"""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def e2e_tokenizer_dir(tiny_tokenizer_dir) -> Path:
    return Path(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def e2e_tokenizer(e2e_tokenizer_dir):
    from onecard.vocab import load_tokenizer

    return load_tokenizer(e2e_tokenizer_dir)


@pytest.fixture(scope="module")
def agent_server(e2e_tokenizer_dir, e2e_tokenizer):
    """One scripted agent server per module (Qwen3-Coder's template, qwen3 + hermes parsers, an API key)."""
    from tests.e2e.agent_server import start_agent_server

    srv = start_agent_server(e2e_tokenizer_dir, e2e_tokenizer, max_model_len=2048)
    yield srv
    srv.stop()
