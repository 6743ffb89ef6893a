"""Docs that cannot drift: docs/architecture.md maps every module, and every module a doc or a
docstring names (``asnackq.x.y``, or a path ``asnackq/x/y.py``) exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import asnackq

PACKAGE = Path(asnackq.__file__).parent
ROOT = PACKAGE.parent
MAP = (ROOT / "docs" / "architecture.md").read_text()
DOTTED = re.compile(r"\basnackq(?:\.[a-z_][a-z0-9_]*)+")
PATH = re.compile(r"\basnackq/[a-z_/]+\.(?:py|html)\b")


# ``asnackq.<member>``: a module name starts with one of the package's own modules or
# wings; other dotted names (span attributes such as ``asnackq.owner``, loggers such as
# ``asnackq.work.metrics``) are not modules.
MEMBERS = {p.stem for p in PACKAGE.glob("*.py")} | {
    p.parent.name for p in PACKAGE.glob("*/__init__.py")
}


def modules() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
    )


def resolves(dotted: str) -> bool:
    """``asnackq.x.y`` is a module, or a name in one (``asnackq.aio.AsyncQueue``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        value: object = module
        for name in parts[cut:]:
            if not hasattr(value, name):
                return False
            value = getattr(value, name)
        return True
    return False


def texts() -> dict[str, str]:
    found = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "docs").glob("*.md")}
    found["README.md"] = (ROOT / "README.md").read_text()
    found |= {str(p.relative_to(ROOT)): p.read_text() for p in PACKAGE.rglob("*.py")}
    return found


def test_the_architecture_map_names_every_module():
    missing = [module for module in modules() if module not in MAP]
    assert missing == []


def test_every_module_a_doc_or_docstring_names_exists():
    wrong = sorted(
        {
            f"{where}: {name}"
            for where, text in texts().items()
            for name in DOTTED.findall(text)
            if name.split(".")[1] in MEMBERS and not resolves(name)
        }
        | {
            f"{where}: {path}"
            for where, text in texts().items()
            for path in PATH.findall(text)
            if not (ROOT / path).exists()
        }
    )
    assert wrong == []


def test_the_check_catches_a_stale_name():
    assert resolves("asnackq.aio.AsyncQueue") and resolves("asnackq.http_sink")
    assert not resolves("asnackq.store.aio") and not resolves("asnackq.aio.NoSuchThing")
