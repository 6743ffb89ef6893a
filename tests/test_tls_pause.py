"""A worker's TLS set up wrong is the worker's: one line naming the cause, a pause like an
outage, no attempt spent - against real https servers (trustme's throwaway CAs)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gc
import json
import signal
import socket
import ssl
import subprocess
import threading
import time

import pytest
import trustme

from asnackq.aio import AsyncQueue, Dispatcher, Event
from asnackq.dispatch.breaker import BreakerPolicy
from asnackq.lab import procs
from asnackq.wire.send import AsyncHttpSender

from .conftest import execute
from .peers import serving

BREAKER = BreakerPolicy(after=2, base_ms=20, max_ms=200)


def server_tls(ca: trustme.CA, *names: str, client_ca=None, **dates) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*(names or ("127.0.0.1",)), **dates).configure_cert(context)
    if client_ca is not None:
        client_ca.configure_trust(context)
        context.verify_mode = ssl.CERT_REQUIRED
        context.maximum_version = ssl.TLSVersion.TLSv1_2  # (1.3: refused after the handshake)
    return context


EXPIRED = {"not_after": datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)}


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("unknown-ca", "not from a trusted CA"),
        ("expired", "has expired"),
        ("another-host", "names another host"),
        ("plain-port", "does not speak TLS on that port"),
        ("client-refused", "client certificate"),
    ],
)
async def test_a_tls_failure_pauses_with_its_cause_and_spends_no_attempt(tmp_path, case, why):
    ca, other = trustme.CA(), trustme.CA()
    ca_file = tmp_path / "ca.pem"
    (other if case == "unknown-ca" else ca).cert_pem.write_to_path(ca_file)
    tls = {
        "expired": server_tls(ca, **EXPIRED),
        "another-host": server_tls(ca, "localhost"),
        "plain-port": None,
        "client-refused": server_tls(ca, client_ca=trustme.CA()),
    }.get(case, server_tls(ca))
    events: list[Event] = []
    async with AsyncQueue.open(tmp_path / "q.db") as queue:
        await queue.enqueue({"id": "t1", "qty": 1}, max_attempts=2)
        with serving("sink", tmp_path, tls=tls) as peer:
            url = peer.url.replace("http://", "https://")
            async with AsyncHttpSender(url, ca_file=ca_file) as send:
                dispatcher = Dispatcher(
                    queue, send, owner="w", lease_ms=1000, breaker=BREAKER, on_event=events.append
                )
                run = asyncio.ensure_future(dispatcher.run(follow=True))
                for _ in range(600):  # until it pauses (bounded: 60 s)
                    if any(event.name == "paused" for event in events):
                        break
                    await asyncio.sleep(0.1)
                # two and a half leases' worth of the pause (a lease of 1 s, extended at
                # its half, outlasts a busy machine's stalls; one of 300 ms may lapse)
                await asyncio.sleep(2.5)
                dispatcher.stop()
                summary = await asyncio.wait_for(run, 60)
        assert peer.ids == []  # nothing reached the receiver
    paused = [event for event in events if event.name == "paused"]
    assert len(paused) == 1, [event.name for event in events]  # said once
    assert paused[0].fields["cause"] == "tls" and why in str(paused[0].fields["why"])
    assert summary.untrusted >= 2 and summary.bad_acks == 0 and summary.dead == 0
    assert summary.claimed == 1  # held under its lease all along, never reclaimed
    assert execute(tmp_path / "q.db", "SELECT status, attempts FROM jobs") == [("leased", 1)]


def test_a_peer_stopped_mid_handshake_closes_that_connection(tmp_path):
    """The https peers these tests send to close a connection still in its TLS handshake
    when they stop (a client that gave up on a certificate, not yet read by the peer): none
    is left for the collector to find unclosed during a later test."""
    ca = trustme.CA()
    client = ssl.create_default_context()
    ca.configure_trust(client)
    hello, flight = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = client.wrap_bio(flight, hello, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()  # (the ClientHello, in ``hello``)
    with serving("sink", tmp_path, tls=server_tls(ca)) as peer:
        port = int(peer.url.split(":")[2].split("/")[0])
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        raw.sendall(hello.read())
        assert raw.recv(65536)  # the peer's answer: it is in the handshake, waiting for ours
    with raw:  # closed by the peer as it stopped (left open, a read times out: TimeoutError)
        try:
            while raw.recv(65536):  # (the rest of its answer, had it come in parts)
                pass
        except ConnectionResetError:
            pass  # (a reset closes it too)
    gc.collect()  # (an unclosed transport would warn here: warnings fail the test)


def test_a_peer_stopped_while_clients_keep_connecting_leaves_no_connection_open(tmp_path):
    """Connections the https peers accept as they stop are closed too: one accepted just
    before the close, whose transport is made a step later, is the peer's to close (a
    closed server refuses it, and its socket would be left to the collector)."""
    ca = trustme.CA()
    client = ssl.create_default_context()
    ca.configure_trust(client)

    def hello() -> bytes:
        into, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        with pytest.raises(ssl.SSLWantReadError):
            client.wrap_bio(into, out, server_hostname="127.0.0.1").do_handshake()
        return out.read()

    def connect(port: int, done: threading.Event, greet: bool) -> None:
        while not done.is_set():  # (each connection closed here: only the peer's may leak)
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            ):
                if greet:
                    raw.sendall(hello())

    for stop_after in (0.0, 0.02, 0.05, 0.1, 0.2, 0.3):  # (a race: a few stops meet it)
        with serving("sink", tmp_path, tls=server_tls(ca)) as peer:
            done = threading.Event()
            port = int(peer.url.split(":")[2].split("/")[0])
            clients = [
                threading.Thread(target=connect, args=(port, done, greet))
                for greet in (True, False, True)
            ]
            for thread in clients:
                thread.start()
            time.sleep(stop_after)
        done.set()
        for thread in clients:
            thread.join(30)
        gc.collect()  # (an unclosed transport or socket would warn here: warnings fail it)


@pytest.mark.process
def test_work_says_once_on_stderr_why_tls_fails(tmp_path):
    """``asnackq sink`` on https with an expired certificate; ``work`` prints one line
    naming the cause, keeps its job (one attempt), and stops cleanly."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    ca.issue_cert("127.0.0.1", **EXPIRED).private_key_and_cert_chain_pem.write_to_path(
        tmp_path / "sink.pem"
    )
    queue = tmp_path / "q.db"
    for args in (("init", queue), ("enqueue", queue, "--id", "a", "--qty", "1")):
        subprocess.run(procs.command(*args), check=True, capture_output=True)
    tls = ("--tls-cert", tmp_path / "sink.pem", "--tls-key", tmp_path / "sink.pem")
    log = tmp_path / "work.log"
    with procs.Replicas(tmp_path / "sink.db", 1, *tls) as sinks, log.open("w") as stderr:
        url = sinks.urls[0].replace("http://", "https://")
        options = ("--sink-ca", tmp_path / "ca.pem", "--lease-ms", "500", "--json")
        proc = subprocess.Popen(
            procs.command("work", queue, "--sink", url, *options),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        give_up = time.monotonic() + 120
        while "paused" not in log.read_text() and time.monotonic() < give_up:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        time.sleep(2)  # four leases' worth of the pause
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, log.read_text()
    said = [line for line in log.read_text().splitlines() if "TLS" in line]
    assert len(said) == 1 and "the sink's certificate has expired" in said[0], said
    assert json.loads(out)["untrusted"] >= 1
    assert execute(queue, "SELECT status, attempts FROM jobs") == [("leased", 1)]
