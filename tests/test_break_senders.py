"""Attacks on the senders (``asnackq.wire.send``) found by review."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asnackq.wire.send import AsyncHttpSender


@pytest.mark.parametrize("url", ["http://a\\@127.0.0.1:9/x", "http://[::1]@127.0.0.1:9/x"])
def test_a_url_aiohttp_cannot_read_is_refused_when_the_sender_is_made(url: str) -> None:
    """The standard library reads these as a loopback sink; aiohttp (yarl) refuses them, so
    every send was ``Unavailable`` ("the sink is away"): a run paused, probing forever,
    for a typo. The sender refuses the URL at once, as it refuses any bad URL."""
    with pytest.raises(ValueError, match="url must be http"):
        AsyncHttpSender(url)


@pytest.mark.process
def test_work_refuses_such_a_url_as_a_usage_error(tmp_path: Path) -> None:
    queue = tmp_path / "q.db"
    subprocess.run([sys.executable, "-m", "asnackq", "init", str(queue)], check=True)
    done = subprocess.run(
        [sys.executable, "-m", "asnackq", "work", str(queue), "--sink", "http://a\\@127.0.0.1:9/"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "argument --sink" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
