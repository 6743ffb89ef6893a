"""Children outlive no lab: a parent SIGKILLed takes its sinks, workers and PostgreSQL with it.

A lab (or a test) that is SIGKILLed cannot run its ``finally``.  Its ``asnackq`` children ask
the kernel for a SIGTERM when it ends (``asnackq.cli.lifeline``), and a throwaway PostgreSQL
server has a watchdog of its own that stops it and removes its directory
(``asnackq/lab/pg_watchdog.py``).  Each test SIGKILLs a real parent process and waits, with
a bound, for the real children to end (``pidfd``: no polling).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from asnackq.core import worker as w
from asnackq.lab import procs
from asnackq.lab.pg_server import find_binaries

from .pgdb import REQUIRED


def parent(code: str, *args: object) -> tuple[subprocess.Popen[str], list[str]]:
    """Start ``python -c code args`` and read the line it prints first (within 60 s)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready, "the parent did not start its children"
    return proc, proc.stdout.readline().split()


def ends_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` ends (exits, or is already gone) within ``seconds``."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([handle], [], [], seconds)
        return bool(ready)
    finally:
        os.close(handle)


def sigkill(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.mark.process
def test_a_lab_s_sink_and_worker_end_when_the_lab_is_sigkilled(tmp_path):
    """A sink and a worker started through ``procs`` end once their parent is SIGKILLed; a
    sink the same parent started without ``procs`` (no lifeline) lives on."""
    queue = tmp_path / "q.db"
    w.open_queue(str(queue)).close()
    code = """
        import subprocess, sys, time
        from asnackq.lab import procs
        sink, url = procs.start_sink(sys.argv[1])
        work = procs.worker(sys.argv[2], url)
        plain = subprocess.Popen(procs.command("sink", "--db", sys.argv[3], "--port", "0"),
                                 stdout=subprocess.DEVNULL)
        print(sink.pid, work.pid, plain.pid, flush=True)
        time.sleep(120)
    """
    lab, pids = parent(code, tmp_path / "sink.db", queue, tmp_path / "plain.db")
    sink, work, plain = map(int, pids)
    try:
        sigkill(lab)
        assert ends_within(sink, 30) and ends_within(work, 30)
        assert not ends_within(plain, 0.5)  # the lifeline is what ended the others
    finally:
        for pid in (sink, work, plain):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.process
def test_a_child_whose_lifeline_is_cut_already_stops_at_once(tmp_path):
    """A child handed a lifeline whose writer is gone before it starts stops itself."""
    read_end, write_end = os.pipe()
    os.close(write_end)
    try:
        child = subprocess.Popen(
            procs.command("sink", "--db", tmp_path / "s.db", "--port", "0"),
            env={**os.environ, procs.LIFELINE_ENV: str(read_end)},
            pass_fds=(read_end,),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(read_end)
    try:
        assert ends_within(child.pid, 30)
    finally:
        child.kill()
        _, err = child.communicate(timeout=30)
    assert "Traceback" not in err


@pytest.mark.process
@pytest.mark.parametrize(
    "value", ["\u00b2", "\u0663", "1", "0", "abc", "999999", "", str(2**31), str(2**64), "-1"]
)
def test_a_lifeline_variable_naming_no_pipe_changes_nothing(value):
    """Digits of other scripts, a descriptor that is no pipe (0: stdin here is /dev/null),
    none at all, or a number no descriptor can be: the command runs as usual."""
    done = subprocess.run(
        procs.command("--help"),
        env={**os.environ, procs.LIFELINE_ENV: value},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.process
def test_a_child_started_from_a_thread_that_ends_lives_on_with_its_process(tmp_path):
    """The lifeline is the process's, not the thread's: a worker started from a thread that
    then ends keeps running (the kernel's parent-death signal would have ended it)."""
    queue = tmp_path / "queue.db"
    w.open_queue(str(queue)).close()
    started: list[procs.Proc] = []
    thread = threading.Thread(
        target=lambda: started.append(
            procs.start(
                procs.command("work", queue, "--sink", "http://127.0.0.1:9/events"),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    )
    thread.start()
    thread.join(30)
    (child,) = started
    try:
        assert not ends_within(child.pid, 3)
    finally:
        procs.stop(child)


@pytest.mark.process
def test_a_throwaway_postgresql_ends_and_is_removed_when_its_maker_is_sigkilled():
    if find_binaries() is None:
        if REQUIRED:
            pytest.fail("ASNACKQ_REQUIRE_PG=1 but no PostgreSQL binaries", pytrace=False)
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) not found")
    code = """
        import time
        from asnackq.lab.pg_server import FAST, local_server
        with local_server(FAST) as server:
            print(server.root, server.watchdog.pid, flush=True)
            time.sleep(120)
    """
    maker, (root, watchdog) = parent(code)
    postmaster = int((Path(root) / "data" / "postmaster.pid").read_text().split()[0])
    sigkill(maker)
    assert ends_within(postmaster, 60), "the server outlived its maker"
    assert ends_within(int(watchdog), 60)
    assert not Path(root).exists()
