"""An encrypted private key is refused in one line, never prompted for: each command runs
with a terminal of its own as its controlling terminal (where OpenSSL would ask for the pass
phrase and wait), and ends at once with exit 2."""

from __future__ import annotations

import fcntl
import os
import pty
import subprocess
import termios

import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from asnackq.lab import procs

pytestmark = pytest.mark.process


@pytest.fixture
def encrypted(tmp_path):
    """A certificate and its key, the key encrypted with a pass phrase."""
    leaf = trustme.CA().issue_cert("127.0.0.1", "localhost")
    key = serialization.load_pem_private_key(leaf.private_key_pem.bytes(), password=None)
    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"not-asked-for"),
        )
    )
    return cert, key_file


def on_a_terminal(argv: list[str]) -> tuple[int, str]:
    """Run ``argv`` with a new pseudo-terminal as its controlling terminal and stdio; its
    exit code and everything it wrote there."""
    main, secondary = pty.openpty()

    def own_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        child = subprocess.Popen(
            argv, stdin=secondary, stdout=secondary, stderr=secondary, preexec_fn=own_terminal
        )
        os.close(secondary)
        try:
            code = child.wait(timeout=30)  # (a prompt would wait forever)
        finally:
            child.kill()
        chunks = []
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # (EIO: the terminal's other end is closed)
                break
            if not chunk:
                break
            chunks.append(chunk)
        return code, b"".join(chunks).decode(errors="replace")
    finally:
        os.close(main)


@pytest.mark.parametrize("command", ["work", "sink"])
def test_an_encrypted_key_is_one_line_and_no_prompt(encrypted, tmp_path, command):
    cert, key = encrypted
    if command == "work":
        queue = tmp_path / "q.db"
        subprocess.run(procs.command("init", queue), check=True, capture_output=True)
        argv = ["work", queue, "--sink", "https://127.0.0.1:9/e", "--until-empty"]
        argv += ["--sink-cert", cert, "--sink-key", key]
    else:
        argv = ["sink", "--db", tmp_path / "s.db", "--port", 0]
        argv += ["--tls-cert", cert, "--tls-key", key]
    code, shown = on_a_terminal(procs.command(*argv))
    lines = shown.strip().splitlines()
    assert code == 2, shown
    assert len(lines) == 1 and "the key is encrypted" in lines[0], shown
    assert "pass phrase:" not in shown.lower() and "Traceback" not in shown
