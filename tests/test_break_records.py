"""Attacks on the attempt records (asnackq_attempts) found by review."""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_attempt_records import deliver, kept


@pytest.mark.parametrize("where", ["sqlite", "postgresql"])
async def test_an_answer_holding_a_nul_byte_is_kept_and_the_run_goes_on(
    where: str, db: Path, pg_db
) -> None:
    """A receiver's body with a NUL byte must not stop the run (PostgreSQL's text holds no
    NUL: the cycle's INSERT failed and the Dispatcher stopped) nor cut the record short
    (SQLite's ``->>`` ended the text at the NUL): the job is done and the record whole."""
    target = str(db) if where == "sqlite" else pg_db()
    await deliver(target, [(200, b"ok\x00tail", {})])
    [row] = kept(target)
    assert row[3] == 200 and row[5] == "ok"
    assert row[6] == "ok\ufffdtail"
