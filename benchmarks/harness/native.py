"""Run hardbyte/postgresql-job-queue-benchmarking natively: no Docker, one throwaway PostgreSQL.

    python benchmarks/harness/native.py --harness /tmp/pjqb [--port 15555] -- run \\
        --systems asnackq,pgboss --producer-mode depth-target --target-depth 4000 \\
        --producer-rate 50000 --worker-count 16 --skip-build \\
        --phase warmup=warmup:30s --phase clean=clean:180s

Everything after ``--`` is the harness's own command line (``bench.py``).  This wrapper
changes three things in the harness, in this process only:

* PostgreSQL: instead of ``docker compose``, ``initdb``/``pg_ctl`` (as the ``postgres`` user
  when root) into a temporary directory, listening on 127.0.0.1 only, with the harness's
  ``postgres.conf`` (``listen_addresses`` kept to loopback); the role ``bench``/``bench``
  the harness expects; ``postgres-restart`` chaos phases stop and start that server.
* ``asnackq`` is registered: ``benchmarks/harness/asnackq-bench`` run by ``$ASNACKQ_PYTHON``
  with this checkout (or ``$ASNACKQ_TREE``, another checkout's, to compare) first on
  ``PYTHONPATH``.
* ``pgboss`` runs natively: ``node main.js`` in the harness's ``pgboss-bench`` (after
  ``npm ci`` there).

The harness's Python needs its own dependencies (psycopg, pandas, matplotlib, pydantic):
run this file with a Python that has them; the asnackq adapter runs with ``$ASNACKQ_PYTHON``
(default: this Python), which needs asnackq's (see asnackq-bench/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TREE = Path(os.environ.get("ASNACKQ_TREE", HERE.parent.parent))  # the asnackq to run
CONF_SKIP = ("listen_addresses",)


class Server:
    """The harness's PostgreSQL, run from this machine's binaries."""

    def __init__(self, harness: Path, port: int) -> None:
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), reverse=True)
        if not found:
            raise SystemExit("no PostgreSQL binaries (/usr/lib/postgresql/*/bin) found")
        self.bindir, self.as_root = found[0].parent, os.geteuid() == 0
        self.port, self.harness = port, harness
        self.root = Path(tempfile.mkdtemp(prefix="pjqb-pg-"))
        self.data = self.root / "data"
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")

    def command(self, name: str, *args: str) -> list[str]:
        line = [str(self.bindir / name), *args]
        return ["runuser", "-u", "postgres", "--", *line] if self.as_root else line

    def run(self, name: str, *args: str) -> None:
        subprocess.run(self.command(name, *args), check=True, capture_output=True, timeout=120)

    def create(self) -> None:
        self.run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
        )
        conf = [
            line
            for line in (self.harness / "postgres.conf").read_text().splitlines()
            if not line.strip().startswith(CONF_SKIP)
        ]
        conf += [
            "listen_addresses = '127.0.0.1'",
            f"port = {self.port}",
            f"unix_socket_directories = '{self.root}'",
        ]
        with (self.data / "postgresql.conf").open("a") as fh:
            fh.write("\n".join(conf) + "\n")
        self.start()
        self.psql("CREATE ROLE bench LOGIN SUPERUSER PASSWORD 'bench'")

    def psql(self, sql: str) -> None:
        line = self.command(
            "psql",
            "-h",
            str(self.root),
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            sql,
        )
        subprocess.run(line, check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self.run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def patch(harness: Path, server: Server) -> Any:
    sys.path.insert(0, str(harness))
    from bench_harness import adapters, orchestrator

    def pg_url(dbname: str, host: str = "127.0.0.1") -> str:
        return f"postgres://bench:bench@127.0.0.1:{server.port}/{dbname}"

    for module in (adapters, orchestrator):
        module.pg_url = pg_url  # type: ignore[attr-defined]
    orchestrator.start_postgres = lambda image: None  # started before the run
    orchestrator.stop_postgres = lambda image: None  # removed after it
    orchestrator._compose_stop_postgres = lambda image: server.stop()
    orchestrator._compose_start_postgres = lambda image: server.start()

    def launch_asnackq(manifest: Any, overrides: dict[str, str]) -> Any:
        env = adapters._base_env(manifest, overrides)
        env["PYTHONPATH"] = os.pathsep.join([str(TREE), os.environ.get("PYTHONPATH", "")])
        python = os.environ.get("ASNACKQ_PYTHON", sys.executable)
        return adapters.LaunchSpec(argv=[python, str(HERE / "asnackq-bench" / "main.py")], env=env)

    def launch_pgboss(manifest: Any, overrides: dict[str, str]) -> Any:
        env = adapters._base_env(manifest, overrides)
        return adapters.LaunchSpec(
            argv=["node", "main.js"], env=env, cwd=str(harness / "pgboss-bench")
        )

    adapters.ADAPTERS["asnackq"] = adapters.AdapterEntry(
        bench_dir=HERE / "asnackq-bench", builder=lambda skip: None, launcher=launch_asnackq
    )
    adapters.ADAPTERS["pgboss"] = adapters.AdapterEntry(
        bench_dir=harness / "pgboss-bench", builder=lambda skip: None, launcher=launch_pgboss
    )
    return orchestrator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--harness", type=Path, required=True)
    parser.add_argument("--port", type=int, default=15555)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    server = Server(args.harness.resolve(), args.port)
    try:
        server.create()
        orchestrator = patch(args.harness.resolve(), server)
        raise SystemExit(orchestrator.main(rest))
    finally:
        server.remove()


if __name__ == "__main__":
    main()
