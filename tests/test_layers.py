"""The wings import one way (docs/architecture.md): core <- store, wire <- dispatch, sink <- ops
<- lab <- cli; peers (store and wire, dispatch and sink) never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import asnackq

RANK = {"core": 0, "store": 1, "wire": 1, "dispatch": 2, "sink": 2, "ops": 3, "lab": 4, "cli": 5}
PACKAGE = Path(asnackq.__file__).parent


def imported(path: Path) -> set[str]:
    """The asnackq wings ``path`` imports, at module level or inside functions."""
    wings = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("asnackq"):
            if node.module == "asnackq":  # from asnackq import ops
                wings |= {alias.name for alias in node.names}
            else:
                wings.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            wings |= {a.name.split(".")[1] for a in node.names if a.name.startswith("asnackq.")}
    return wings & RANK.keys()


def test_every_wing_imports_only_the_wings_below_it():
    wrong = [
        f"{path.relative_to(PACKAGE)} imports {other}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if len(path.relative_to(PACKAGE).parts) > 1
        for other in imported(path)
        if (wing := path.relative_to(PACKAGE).parts[0]) != other and RANK[other] >= RANK[wing]
    ]
    assert wrong == []
    assert len(list(PACKAGE.glob("*/__init__.py"))) == len(RANK)
