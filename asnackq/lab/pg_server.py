"""A throwaway PostgreSQL server from the binaries on this machine (tests, lab, benchmarks).

Rules of this module:

* ``initdb`` + ``pg_ctl`` into a fresh temporary directory; a Unix socket in that directory
  and a free loopback TCP port; trust authentication for the bootstrap superuser on the
  socket only (``host`` lines, the TCP port, ask for a password).
* PostgreSQL refuses to run as root: as root, every binary runs as the ``postgres`` system
  user (``runuser``), and the directory belongs to it.
* ``stop()`` always ends the server (``pg_ctl stop -m immediate``) and removes the directory;
  the ``with`` form guarantees it.  So does a watchdog (``pg_watchdog.py``, a process of
  its own) when the process that made the server ends without stopping it (SIGKILLed).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DURABLE", "SUPERUSER", "Binaries", "LocalServer", "find_binaries", "local_server"]

SUPERUSER = "asnackq"
# Durable settings (the benchmark's); tests pass FAST to trade durability for speed.
DURABLE: dict[str, str] = {"fsync": "on", "synchronous_commit": "on"}
FAST: dict[str, str] = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
HBA = """local all all trust
host all all 127.0.0.1/32 scram-sha-256
"""


class Binaries:
    """Where ``initdb`` and ``pg_ctl`` are, and how to run them (as ``postgres`` when root)."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.as_root = os.geteuid() == 0

    def command(self, name: str, *args: str) -> list[str]:
        line = [str(self.bindir / name), *args]
        return ["runuser", "-u", "postgres", "--", *line] if self.as_root else line

    def run(self, name: str, *args: str) -> None:
        done = subprocess.run(
            self.command(name, *args), capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed ({done.returncode}): {done.stderr.strip()[-500:]}")


def find_binaries() -> Binaries | None:
    """The PostgreSQL binaries in ``$ASNACKQ_PG_BINDIR`` if set, else on PATH (or in Debian's
    layout); None when absent or unusable."""
    chosen = os.environ.get("ASNACKQ_PG_BINDIR")
    found = shutil.which("initdb")
    if chosen is not None:
        candidates = [Path(chosen)]
    else:
        candidates = [Path(found).resolve().parent] if found else []
        candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "pg_ctl").is_file():
            binaries = Binaries(bindir)
            if binaries.as_root and not _postgres_user():
                return None
            return binaries
    return None


def _postgres_user() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        return None


def free_port() -> int:
    """A loopback port nothing listens on right now (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LocalServer:
    """One running throwaway server: its directory, port, socket and superuser URL."""

    def __init__(self, binaries: Binaries, root: Path, port: int) -> None:
        self.binaries, self.root, self.port = binaries, root, port
        self.data = root / "data"
        self.settings: dict[str, str] = {}
        self.watchdog: subprocess.Popen[bytes] | None = None

    def watch(self) -> None:
        """Start the watchdog that stops the server if this process ends first."""
        script = Path(__file__).with_name("pg_watchdog.py")
        pg_ctl = json.dumps(self.binaries.command("pg_ctl"))
        self.watchdog = subprocess.Popen(
            [sys.executable, str(script), str(self.root), pg_ctl],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def socket_dir(self) -> Path:
        return self.root

    def url(self, dbname: str = "postgres") -> str:
        """A superuser URL over the Unix socket (trust: no password)."""
        return f"postgresql://{SUPERUSER}@/{dbname}?host={self.root}&port={self.port}"

    def tcp_url(self, user: str, password: str, dbname: str = "postgres") -> str:
        """A URL over loopback TCP, where a password is required."""
        return f"postgresql://{user}:{password}@127.0.0.1:{self.port}/{dbname}"

    def start(self, settings: dict[str, str]) -> None:
        self.settings = settings
        options = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.root),
            "max_connections": "300",
            **settings,
        }
        line = " ".join(f"-c {key}={value}" for key, value in options.items())
        self._pg_ctl("-o", line, "start")

    def restart(self, mode: str) -> None:
        """``pg_ctl restart -m MODE`` (fast: sessions ended, a checkpoint; immediate: a crash
        and recovery), waiting until it accepts sessions again."""
        self._pg_ctl("-m", mode, "restart")

    def halt(self, mode: str = "fast") -> None:
        """Stop the server and keep its directory (``resume`` starts it again)."""
        self._pg_ctl("-m", mode, "stop")

    def resume(self) -> None:
        """Start a halted server again, on the same port and with the same settings."""
        self.start(self.settings)

    def _pg_ctl(self, *args: str) -> None:
        # -l: the server's output goes to its log, never to a pipe this process waits on
        self.binaries.run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.root / "server.log"),
            "-w",
            "-t",
            "60",
            *args,
        )

    def stop(self) -> None:
        """Stop the server at once and remove its directory (idempotent); the watchdog
        ends."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            if (self.data / "postmaster.pid").exists():
                self.binaries.run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None and watchdog.stdin is not None:
            watchdog.stdin.close()  # (its server is gone: it only removes nothing, and ends)
            with contextlib.suppress(subprocess.TimeoutExpired):
                watchdog.wait(30)

    def log_tail(self, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.root / "server.log").read_text(errors="replace")[-chars:]
        return ""


def create(binaries: Binaries, settings: dict[str, str]) -> LocalServer:
    """initdb and start a server in a fresh directory; on any failure nothing is left."""
    root = Path(tempfile.mkdtemp(prefix="asnackq-pg-"))
    server = LocalServer(binaries, root, free_port())
    try:
        server.watch()
        if binaries.as_root:
            user = _postgres_user()
            assert user is not None
            os.chown(root, user.pw_uid, user.pw_gid)
        binaries.run(
            "initdb",
            "-D",
            str(server.data),
            "-U",
            SUPERUSER,
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "-E",
            "UTF8",
            "--no-instructions",
        )
        (server.data / "pg_hba.conf").write_text(HBA, encoding="utf-8")
        for attempt in range(3):
            try:
                server.start(settings)
                break
            except RuntimeError:  # the port was taken meanwhile: another one
                if attempt == 2:
                    raise
                server.port = free_port()
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def local_server(settings: dict[str, str] | None = None) -> Iterator[LocalServer]:
    """``with local_server() as server:`` a running throwaway server, stopped on exit."""
    binaries = find_binaries()
    if binaries is None:
        raise RuntimeError("no PostgreSQL binaries (initdb, pg_ctl) on this machine")
    server = create(binaries, dict(DURABLE if settings is None else settings))
    try:
        yield server
    finally:
        server.stop()
