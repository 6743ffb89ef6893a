"""docs/cli.md's exit-code table, row by row: each example run as written as a real process."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from asnackq.lab import procs

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\| (\d+) \| (.+?) \| (`asnackq [^`]+`|-) \|$")


def table() -> list[tuple[int, str, str]]:
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    return [(int(m[1]), m[2], m[3].strip("`")) for m in map(ROW.match, section.splitlines()) if m]


ROWS = [row for row in table() if row[2] != "-"]


def test_the_table_is_there_and_covers_every_code():
    codes = {code for code, _, _ in table()}
    assert codes == {0, 1, 2, 130} and len(ROWS) >= 12


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("exit-codes")
    for args in (("init", "q.db"), ("enqueue", "q.db", "--id", "ab", "--qty", "1")):
        subprocess.run(procs.command(*args), cwd=where, check=True, capture_output=True)
    (where / "bad.jsonl").write_text('{"id": "x"}\n')
    return where


@pytest.mark.parametrize(("code", "when", "example"), ROWS, ids=[row[2] for row in ROWS])
def test_each_row_exits_as_documented(where, code, when, example):
    before = (where / "q.db").read_bytes()
    args = shlex.split(example)[1:]
    done = subprocess.run(
        procs.command(*args), cwd=where, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == code, (when, done.stderr)
    assert "Traceback" not in done.stderr
    if code:
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("asnackq")
    assert (where / "q.db").read_bytes() == before  # nothing changed
