"""Fixtures shared by the engine tests."""
from __future__ import annotations

import pytest

from tests.engine.spec_helpers import plain_reference


@pytest.fixture(scope="session")
def plain(tiny_moe_gptq_dir):
    """Plain decoding's outputs of the speculative-decoding tests' requests, and the oracle's references."""
    return plain_reference(tiny_moe_gptq_dir)
