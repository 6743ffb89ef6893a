"""The pages a newcomer follows, run as written: every ``python`` block of docs/embedding.md
and of the README is a whole program run in a fresh directory against a real ``asnackq sink``
(only the sink's port differs from the page: the page's 8080 becomes a free one); the README's
command-line steps run as a shell script."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asnackq.lab.procs import Replicas

from .sinks import dead_port

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
PAGE_URL = "http://127.0.0.1:8080/events"


def blocks(page: str, language: str) -> list[str]:
    text = (ROOT / page).read_text()
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.M | re.S)


EMBEDDING = blocks("docs/embedding.md", "python")
README = blocks("README.md", "python")


def test_the_pages_have_their_programs():
    assert len(EMBEDDING) == 5 and len(README) == 2
    assert all("asyncio.run(main())" in block for block in EMBEDDING + README)


def run_program(source: str, where: Path, url: str) -> subprocess.CompletedProcess[str]:
    program = where / "program.py"
    program.write_text(source.replace(PAGE_URL, url))
    return subprocess.run(
        [sys.executable, str(program)],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "SINK_URL": url},
    )


@pytest.mark.parametrize(
    ("page", "n"),
    [("docs/embedding.md", n) for n in range(5)] + [("README.md", n) for n in range(2)],
)
def test_every_program_on_the_page_runs_as_written(tmp_path, page, n):
    source = (EMBEDDING if page == "docs/embedding.md" else README)[n]
    with Replicas(tmp_path / "sink.db", 1) as sinks:
        done = run_program(source, tmp_path, sinks.urls[0])
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


def test_the_watching_program_logs_through_the_apps_logging(tmp_path):
    with Replicas(tmp_path / "sink.db", 1) as sinks:
        done = run_program(EMBEDDING[0], tmp_path, sinks.urls[0])
    assert done.returncode == 0, done.stderr
    assert "3 done, 3 requests, 0 dead" in done.stdout
    assert "asnackq.worker started" in done.stderr and "asnackq.worker stopped" in done.stderr


def test_the_readmes_command_line_steps_run_as_written(tmp_path):
    script = blocks("README.md", "sh")[1]
    assert script.startswith("asnackq init q.db")
    port = dead_port()
    script = script.replace("8080", str(port))
    lines = [line.split("  #")[0].rstrip() for line in script.splitlines() if line.strip()]
    bin_dir = Path(sys.executable).parent
    shell = "\n".join(
        [
            "set -e",
            f'export PATH="{bin_dir}:$PATH"',
            *[
                line
                if not line.endswith("&")
                else f"{line}\nSINK=$!\n"
                f"for _ in $(seq 600); do (echo > /dev/tcp/127.0.0.1/{port}) 2>/dev/null "
                "&& break; sleep 0.1; done"
                for line in lines
            ],
            "kill -TERM $SINK; wait $SINK",
        ]
    )
    done = subprocess.run(
        ["bash", "-c", shell], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "no violations" in done.stdout
    assert "asnackq work: stopped" in done.stderr  # the worker said so, stderr not a terminal
