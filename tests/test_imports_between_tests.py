"""Builders and fakes one test file shares with another live in tests/support/ (or a helper
module that is not a test file): importing a test module or a conftest couples two suites and
gives the helper a home someone may split or delete with its tests (issue 27.4)."""

from __future__ import annotations

import ast

from tests.support.lanes import REPO, TEST_FILE


def _imported_modules(source: str) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def _test_imports(source: str) -> list[str]:
    """The test modules and conftests this Python source imports."""
    return [
        m
        for m in _imported_modules(source)
        if m.startswith("tests.")
        and (TEST_FILE.search(m.replace(".", "/") + ".py") or m.endswith(".conftest"))
    ]


def test_no_test_file_imports_a_test_module_or_a_conftest() -> None:
    offenders = {
        str(path.relative_to(REPO)): found
        for path in sorted((REPO / "tests").rglob("*.py"))
        if (found := _test_imports(path.read_text()))
    }
    assert not offenders, (
        f"move what these import into tests/support/ and import it from there: {offenders}"
    )


def test_the_check_sees_both_forms() -> None:
    assert _test_imports("from tests.controller.test_reconciler_engine import node") == [
        "tests.controller.test_reconciler_engine"
    ]
    assert _test_imports("import tests.deploy.conftest") == ["tests.deploy.conftest"]
    assert _test_imports("from tests.support.reconciler import claim") == []
    assert _test_imports("from tests.kubeletplugin.node_harness import Node") == []
