"""``import asnackq``: the product's names next to the contract's, typed, loaded on first use."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import asnackq
from asnackq.aio import AsyncQueue, Dispatcher

ROOT = Path(__file__).parents[1]
PROGRAM = """
    import asyncio

    import asnackq


    async def main(path: str, url: str) -> asnackq.Summary:
        async with asnackq.AsyncQueue.open(path) as q, asnackq.AsyncHttpSender(url) as send:
            inserted: bool = await q.enqueue({"id": "order-1", "qty": 3})
            await q.enqueue_many([{"id": "order-2", "qty": 1}, ({"id": "o3", "qty": 2}, 60_000, 3)])
            assert inserted
            dispatcher = asnackq.Dispatcher(
                q,
                send,
                owner="shop",
                retry=asnackq.Retry(100, 5000),
                breaker=asnackq.BreakerPolicy(),
            )
            return await dispatcher.run()


    def sync_send(url: str) -> asnackq.HttpSender:
        return asnackq.HttpSender(url)


    errors: tuple[type[Exception], ...] = (
        asnackq.Conflict,
        asnackq.Retryable,
        asnackq.Unavailable,
        asnackq.Permanent,
        asnackq.BadAck,
        asnackq.Untrusted,
        asnackq.QueueBusy,
        asnackq.StoreUnavailable,
        asnackq.CommitUnknown,
    )
    summary: asnackq.Summary = asyncio.run(main("q.db", "http://127.0.0.1:1/events"))
"""

# A receiving application needs one module: the receiver, its effect's refusal, the secrets
# file's reader and the connection's turn (docs/sink.md, examples/webhook_receiver.py).
RECEIVING = """
    import aiosqlite
    from aiohttp import web

    from asnackq.http_sink import Rejected, WebhookReceiver, read_secrets, turn


    async def credit(db: aiosqlite.Connection, webhook_id: str, payload: object) -> None:
        if type(payload) is not dict:
            raise Rejected("the body must be an object")
        await db.execute("INSERT INTO payments VALUES (?)", (webhook_id,))


    async def receiver(db: aiosqlite.Connection) -> WebhookReceiver[aiosqlite.Connection]:
        async with turn(db):
            await db.execute("CREATE TABLE IF NOT EXISTS payments (id TEXT)")
        return await WebhookReceiver.within(db, read_secrets("secrets.txt"), credit)


    async def receive(request: web.Request) -> web.StreamResponse:
        async with aiosqlite.connect("pay.db", isolation_level=None) as db:
            return await (await receiver(db)).handle(request)
"""

WRONG = """
    import asnackq


    async def main() -> None:
        async with asnackq.AsyncQueue.open("q.db") as q:
            inserted: str = await q.enqueue({"id": "order-1", "qty": 3})
"""


def mypy(tmp_path, source):
    """mypy --strict on ``source`` as a user's program; the package is found on MYPYPATH
    (an editable install's import hook is invisible to mypy)."""
    program = tmp_path / "user_program.py"
    program.write_text(textwrap.dedent(source))
    # As for an installed package, errors inside asnackq are not the user's (the project's
    # own mypy run checks it, with its settings for untyped extras such as plotly).
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nstrict = True\n\n[mypy-asnackq.*]\nfollow_imports = silent\n")
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--no-incremental", program],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(ROOT)},
        timeout=120,
        check=False,
    )


@pytest.mark.process
def test_mypy_strict_accepts_a_program_using_the_front_door(tmp_path):
    done = mypy(tmp_path, PROGRAM)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found in 1 source file" in done.stdout


@pytest.mark.process
@pytest.mark.timeout(300)  # (mypy over the package: on a busy machine, minutes)
def test_mypy_strict_accepts_a_receiving_program_using_asnackq_http_sink_alone(tmp_path):
    done = mypy(tmp_path, RECEIVING)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.process
def test_mypy_strict_rejects_a_wrong_program(tmp_path):
    done = mypy(tmp_path, WRONG)
    assert done.returncode == 1, done.stdout + done.stderr
    assert 'Incompatible types in assignment (expression has type "bool"' in done.stdout


@pytest.mark.process
def test_the_names_are_the_product_objects_and_load_on_first_use():
    assert asnackq.AsyncQueue is AsyncQueue and asnackq.Dispatcher is Dispatcher
    assert set(asnackq.__all__) <= set(dir(asnackq))
    for name in asnackq.__all__:
        assert getattr(asnackq, name) is not None
    heavy = ("aiohttp", "aiosqlite", "asnackq.aio", "asnackq.aio")
    code = f"import sys, asnackq; print(sorted(m for m in sys.modules if m in {heavy}))"
    done = subprocess.run(
        [sys.executable, "-c", code + "; asnackq.Dispatcher"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "[]"
    missing = subprocess.run(
        [sys.executable, "-c", "import asnackq; asnackq.Nope"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "AttributeError: module 'asnackq' has no attribute 'Nope'" in missing.stderr


def test_the_package_ships_its_type_marker():
    assert (ROOT / "asnackq" / "py.typed").is_file()
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert package_data["asnackq"] == ["py.typed"]


def test_the_version_is_the_project_s_and_the_changelog_s_latest():
    with (ROOT / "pyproject.toml").open("rb") as f:
        version = tomllib.load(f)["project"]["version"]
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    latest = next(line for line in changelog.splitlines() if line.startswith("## "))
    assert asnackq.__version__ == version
    assert latest.split()[1] == version


@pytest.mark.process
@pytest.mark.timeout(300)  # (an install and mypy: on a busy machine, minutes)
def test_an_editable_install_is_visible_to_mypy(tmp_path):
    """``pip install -e .`` puts a plain path on ``sys.path`` (no import hook), so mypy, run
    for another project's interpreter, type-checks against the package's own annotations."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = [python, "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run([*install, "-e", ROOT], check=True, timeout=300, capture_output=True)
    app = tmp_path / "app.py"
    app.write_text("from asnackq.aio import AsyncQueue\n\nqueue: int = AsyncQueue\n")
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", python, "--no-incremental", app],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert 'type "type[AsyncQueue]", variable has type "int"' in checked.stdout, checked.stdout
    assert "import-not-found" not in checked.stdout
