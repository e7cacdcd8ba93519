"""conftest.TIERS names tests that exist, with tags that mean something: a renamed test must not
silently leave the slow tier (or lose its root or GPU skip)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import MARKERS, NEEDS, TIERS

TESTS = Path(__file__).resolve().parent


def _test_functions(module: str) -> set[str]:
    tree = ast.parse((TESTS / module).read_text())
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


@pytest.mark.parametrize("key", sorted(TIERS))
def test_each_key_names_a_module_or_test_that_exists(key):
    module, _, name = key.partition("::")
    assert (TESTS / module).is_file(), f"{key}: no module {module}"
    if name:
        assert name.split("[")[0] in _test_functions(module), f"{key}: no such test"


@pytest.mark.parametrize("key", sorted(TIERS))
def test_each_tag_is_a_marker_or_a_need(key):
    assert TIERS[key] <= set(MARKERS) | set(NEEDS), key
