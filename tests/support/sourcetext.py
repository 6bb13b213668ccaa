"""The text carve prints, as its source holds it: for tests that keep docs quoting carve's
messages and names in step with the code."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("controller", "kubeletplugin", "driver", "process", "carvecli")
CHART_TEMPLATES = REPO / "deploy" / "helm" / "carve" / "templates"


@cache
def string_literals() -> str:
    """Every string constant of the shipped packages; an f-string's pieces with a NUL where
    a value goes, so no fragment can match across one; and the chart's templates."""
    out: list[str] = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "_generated" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.JoinedStr):
                    out.append(
                        "".join(
                            v.value if isinstance(v, ast.Constant) else "\0" for v in node.values
                        )
                    )
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    out.append(node.value)
    # The chart's admission policies print their own refusals: their text, with YAML's
    # folded lines joined as the apiserver reads them.
    for path in sorted(CHART_TEMPLATES.glob("*.yaml")):
        out.append(re.sub(r"\s+", " ", path.read_text()))
    return "\n".join(out)
