"""Size limits that keep the product's modules readable: no module over 700 lines, no function
over 80 (issue 27). A module that grows past them mixes jobs; a function that does is several.

Enforced for every product package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("driver", "process", "kubeletplugin", "controller", "carvecli")
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80


def _offenders(package: str) -> set[str]:
    found: set[str] = set()
    for path in sorted((ROOT / package).rglob("*.py")):
        if "_generated" in path.parts:
            continue
        name = path.relative_to(ROOT).as_posix()
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            found.add(name)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.add(f"{name}:{node.name}")
    return found


def test_product_packages_keep_the_limits() -> None:
    offenders = set().union(*(_offenders(p) for p in PRODUCT))
    assert not offenders, (
        f"over {MAX_MODULE_LINES} lines per module or {MAX_FUNCTION_LINES} per function: "
        f"{sorted(offenders)}"
    )
