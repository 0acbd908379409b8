"""The tests' fixtures, read with ``ast`` (nothing is run): a fixture that only builds on shared fixtures is
defined once, in a conftest, not copied into each module that needs it; and no module defines a fixture of the
same name as one a conftest above it provides (pytest would let the module's silently replace the shared one).

A fixture that takes one of its own module's fixtures (a ``client`` of that module's ``server``) belongs to the
module and may look alike elsewhere.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _fixtures(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.name: node for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and any("fixture" in ast.unparse(d) for d in node.decorator_list)}


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name != "conftest.py" and "data" not in p.parts)


def _shared() -> dict[Path, dict[str, ast.FunctionDef]]:
    return {p.parent: _fixtures(p) for p in TESTS.rglob("conftest.py")}


def test_no_module_fixture_shadows_a_conftest_fixture():
    shared = _shared()
    shadows = [f"{p.relative_to(TESTS)}: {name} (also in {d.relative_to(TESTS.parent)}/conftest.py)"
               for p in _modules() for name in _fixtures(p)
               for d, conf in shared.items() if d in p.parents and name in conf]
    assert not shadows, "module fixtures that replace a shared one:\n" + "\n".join(shadows)


def test_a_fixture_built_only_on_shared_ones_is_defined_once():
    copies: dict[str, list[str]] = defaultdict(list)
    for p in _modules():
        own = _fixtures(p)
        for name, node in own.items():
            args = {a.arg for a in node.args.args}
            if args & set(own):
                continue                      # built on this module's own fixtures
            copies[ast.dump(node)].append(f"{p.relative_to(TESTS)}: {name}")
    repeated = [where for where in copies.values() if len(where) > 1]
    assert not repeated, "identical fixtures in several modules (move them to a conftest):\n" + "\n".join(
        ", ".join(w) for w in repeated)


def test_the_checks_see_fixtures(tmp_path):
    """The reader finds decorated fixtures (with or without arguments) and skips plain functions."""
    f = tmp_path / "m.py"
    f.write_text("import pytest\n\n@pytest.fixture\ndef a(): ...\n\n@pytest.fixture(scope='module')\n"
                 "def b(a): ...\n\ndef c(): ...\n")
    assert sorted(_fixtures(f)) == ["a", "b"]
    assert "e2e_tokenizer" in _shared()[TESTS / "e2e"] and "tiny_tokenizer_dir" in _shared()[TESTS]
