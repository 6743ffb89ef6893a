"""The wings import one way (docs/architecture.md): core <- store, wire <- dispatch, sink <- aio,
http_sink <- ops <- lab <- cli; peers (store and wire, dispatch and sink, aio and http_sink)
never import each other, and no module reaches itself through its imports, counting the
imports inside functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import asnackq

RANK = {
    "core": 0,
    "store": 1,
    "wire": 1,
    "dispatch": 2,
    "sink": 2,
    "aio": 3,  # asnackq/aio.py: the asyncio layer
    "http_sink": 3,  # asnackq/http_sink.py: the HTTP sink
    "ops": 4,
    "lab": 5,
    "cli": 6,
}
PACKAGE = Path(asnackq.__file__).parent


def entry_point(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``: a module run as a program, the command line's shell."""
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


def imports(path: Path) -> set[str]:
    """The asnackq modules ``path`` imports, at module level or inside functions (not in
    its ``__main__`` block)."""
    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text())]
    while todo:
        node = todo.pop()
        if entry_point(node):
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("asnackq"):
            for alias in node.names:  # from asnackq.store import pg: the module asnackq.store.pg
                sub = f"{node.module}.{alias.name}"
                found.add(sub if module_path(sub) else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("asnackq")}
    return found


def module_path(name: str) -> Path | None:
    parts = name.split(".")[1:]
    for path in (
        PACKAGE.joinpath(*parts).with_suffix(".py"),
        PACKAGE.joinpath(*parts, "__init__.py"),
    ):
        if parts and path.exists():
            return path
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(["asnackq", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def wing(name: str) -> str | None:
    """The wing of ``asnackq.X.Y`` (X), or None for the package's facade and entry point."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_wing_imports_only_the_wings_below_it():
    wrong = [
        f"{name} imports {other}"
        for name, path in MODULES.items()
        if (mine := wing(name)) is not None
        for other in sorted(imports(path))
        if (theirs := wing(other)) is not None and theirs != mine and RANK[theirs] >= RANK[mine]
    ]
    assert wrong == []
    assert {p.parent.name for p in PACKAGE.glob("*/__init__.py")} | {"aio", "http_sink"} == set(
        RANK
    )


def test_no_module_reaches_itself_through_its_imports():
    graph = {
        name: {m for m in imports(path) if m in MODULES} - {name} for name, path in MODULES.items()
    }
    # a package's __init__ is imported with each of its modules: an edge to it is kept
    circles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join([*trail, nxt]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert circles == []


@pytest.mark.process
def test_the_command_line_s_help_imports_neither_aiohttp_nor_aiosqlite():
    probe = (
        "import sys, contextlib, io\n"
        "from asnackq.cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])\n"
        "print(sorted(m for m in ('aiohttp', 'aiosqlite', 'psycopg') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_layer_test_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from asnackq.cli import main\n")
    assert imports(sample) == {"asnackq.cli"}
    sample.write_text('if __name__ == "__main__":\n    from asnackq.cli import main\n')
    assert imports(sample) == set()


def test_the_design_card_s_files_hold_their_code():
    import asnackq.aio
    import asnackq.http_sink

    for name in ("AsyncQueue", "Dispatcher", "deliver"):
        assert getattr(asnackq.aio, name).__module__ == "asnackq.aio"
    for name in ("make_app", "serve", "SinkConfig"):
        assert getattr(asnackq.http_sink, name).__module__ == "asnackq.http_sink"
    assert asnackq.AsyncQueue is asnackq.aio.AsyncQueue


@pytest.mark.process
def test_python_m_asnackq_http_sink_is_asnackq_sink():
    def usage(*command: str) -> str:
        run = subprocess.run(
            [sys.executable, *command, "--help"], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0, run.stderr
        return run.stdout

    assert usage("-m", "asnackq.http_sink") == usage("-m", "asnackq", "sink")
