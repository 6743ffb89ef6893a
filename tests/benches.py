"""A script of ``benchmarks/`` loaded as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def script(name: str) -> Path:
    """``benchmarks/NAME.py``."""
    return BENCHMARKS / f"{name}.py"


def loaded(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` as a module (with ``benchmarks/`` on ``sys.path`` while it
    loads: the scripts import each other's helpers)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, script(name))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module
