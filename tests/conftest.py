"""Shared session fixtures: tiny HF model directories built once per test run (see tests/fixtures/checkpoints.py).

``tiny_tokenizer_dir``, ``tiny_dense_dir``, ``tiny_moe_dir`` (float32, per-expert layout) and
``tiny_moe_gptq_dir`` (4-bit GPTQ: sym, group 32, v1 zeros, desc_act False) are paths to full model
directories; treat them as read-only (copy before modifying).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:       # `tests.fixtures` importable however pytest was started
    sys.path.insert(0, str(_ROOT))

from tests.fixtures import checkpoints


@pytest.fixture(scope="session")
def fixtures_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(fixtures_root) -> Path:
    return checkpoints.build_tokenizer(fixtures_root / "tokenizer")


@pytest.fixture(scope="session")
def tiny_dense_dir(fixtures_root, tiny_tokenizer_dir) -> Path:
    return checkpoints.build_dense(fixtures_root / "dense", tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_moe_dir(fixtures_root, tiny_tokenizer_dir) -> Path:
    return checkpoints.build_moe(fixtures_root / "moe", tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_moe_gptq_dir(fixtures_root, tiny_moe_dir) -> Path:
    return checkpoints.build_moe_gptq(fixtures_root / "moe_gptq", tiny_moe_dir)
