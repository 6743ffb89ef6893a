"""The stdlib sender's kept-alive connections against a scripted raw server: reused while
the server keeps them, never used after the server announced a close, and a stale one
(closed by the server before it answered) costs one resend of the same id, never more."""

from __future__ import annotations

import contextlib
import json
import socket
import threading

import pytest

from asnackq.core.worker import Unavailable
from asnackq.wire import conn as http_conn
from asnackq.wire.send import HttpSender

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"


def ack(event_id, extra=b"", version=b"HTTP/1.1"):
    body = json.dumps({"id": event_id, "status": "applied"}).encode()
    return (HEAD % (len(body), extra)).replace(b"HTTP/1.1", version, 1) + body


class RawServer:
    """Accepts connections; ``script(connection, request, id)`` answers each request with
    bytes (ending ``|close``: then closes; ending ``|stop``: then reads until the client
    closes, recording what came), or ``None``: closes without answering.  Records every
    request as ``(connection, id)``; ``closed`` is set whenever it closed a connection."""

    def __init__(self, script):
        self.script = script
        self.requests: list[tuple[int, str]] = []
        self.after_close: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/events"
        self.threads: list[threading.Thread] = []
        self.closed = threading.Event()

    def serve(self):
        for number in range(100):
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed: the test is over
                return
            thread = threading.Thread(target=self.connection, args=(conn, number))
            thread.start()
            self.threads.append(thread)

    def connection(self, conn, number):
        try:
            self.exchanges(conn, number)
        finally:
            self.closed.set()

    def exchanges(self, conn, number):
        with conn, conn.makefile("rb") as reader:
            conn.settimeout(5)
            for request in range(100):
                head = read_head(reader)
                if not head:
                    return
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                event_id = json.loads(reader.read(length))["id"]
                self.requests.append((number, event_id))
                answer = self.script(number, request, event_id)
                if answer is None:
                    return
                conn.sendall(answer.removesuffix(b"|stop").removesuffix(b"|close"))
                if answer.endswith(b"|stop"):  # announced a close, left the socket open
                    self.after_close.append(reader.read())  # until the client closes
                if answer.endswith((b"|stop", b"|close")):
                    return


def read_head(reader):
    """A request's head up to its blank line; empty at the end of the connection."""
    lines = []
    while (line := reader.readline()) not in (b"\r\n", b""):
        lines.append(line)
    return b"".join(lines) if line else b""


@contextlib.contextmanager
def raw_server(script):
    server = RawServer(script)
    acceptor = threading.Thread(target=server.serve)
    acceptor.start()
    try:
        yield server
    finally:
        server.listener.shutdown(socket.SHUT_RDWR)
        server.listener.close()
        acceptor.join(5)
        for thread in server.threads:
            thread.join(5)


def send_all(url, ids, **options):
    with HttpSender(url, **options) as send:
        return [send({"id": event_id, "qty": 1}) for event_id in ids]


def test_one_connection_carries_every_send_while_the_server_keeps_it():
    with raw_server(lambda conn, request, event_id: ack(event_id)) as server:
        assert send_all(server.url, "abcde") == [True] * 5
    assert server.requests == [(0, x) for x in "abcde"]


@pytest.mark.parametrize(
    "announce",
    [
        pytest.param(lambda event_id: ack(event_id, b"Connection: close\r\n"), id="close"),
        pytest.param(lambda event_id: ack(event_id, version=b"HTTP/1.0"), id="http10"),
    ],
)
def test_a_connection_the_server_announced_closing_is_never_sent_on(announce):
    """The server leaves the socket open after announcing the close: a request on it would
    arrive; none does, and every send opens its own connection."""
    with raw_server(lambda conn, request, event_id: announce(event_id) + b"|stop") as server:
        assert send_all(server.url, "abc") == [True] * 3
    assert server.requests == [(0, "a"), (1, "b"), (2, "c")]
    assert server.after_close == [b"", b"", b""]


def test_a_connection_the_server_closed_while_idle_is_left_for_a_new_one():
    closing = lambda conn, request, event_id: ack(event_id) + b"|close"  # noqa: E731
    with raw_server(closing) as server, HttpSender(server.url) as send:
        assert send({"id": "a", "qty": 1}) is True
        assert server.closed.wait(5)  # closed after its answer, unannounced
        assert send({"id": "b", "qty": 1}) is True
    assert server.requests == [(0, "a"), (1, "b")]


def test_a_stale_connection_costs_one_resend_of_the_same_id_on_a_new_connection():
    """The race a poll cannot see: the server closes a kept connection as the next request
    arrives, unanswered.  The same request goes once more on a new connection."""

    def stale_at_second(conn, request, event_id):
        return None if (conn, request) == (0, 1) else ack(event_id)

    with raw_server(stale_at_second) as server:
        assert send_all(server.url, "abc") == [True] * 3
    assert server.requests == [(0, "a"), (0, "b"), (1, "b"), (1, "c")]


def test_a_kept_connection_cut_inside_its_answer_is_not_resent():
    """Part of an answer came back: the server was answering; the sender says the sink
    was unavailable and does not send again on its own."""

    def cut_at_second(conn, request, event_id):
        return ack(event_id) if request == 0 else b"HTTP/1.1 2|close"

    with raw_server(cut_at_second) as server, HttpSender(server.url) as send:
        assert send({"id": "a", "qty": 1}) is True
        with pytest.raises(Unavailable):
            send({"id": "b", "qty": 1})
    assert server.requests == [(0, "a"), (0, "b")]


def test_a_new_connection_closed_before_its_answer_is_not_resent():
    with raw_server(lambda conn, request, event_id: None) as server, pytest.raises(Unavailable):
        send_all(server.url, "a")
    assert server.requests == [(0, "a")]


def test_a_connection_idle_past_the_pool_limit_is_replaced(monkeypatch):
    monkeypatch.setattr(http_conn, "POOL_IDLE_S", 0.0)
    with raw_server(lambda conn, request, event_id: ack(event_id)) as server:
        assert send_all(server.url, "ab") == [True, True]
    assert server.requests == [(0, "a"), (1, "b")]


def test_each_thread_keeps_its_own_connection():
    barrier = threading.Barrier(2)
    with (
        raw_server(lambda conn, request, event_id: ack(event_id)) as server,
        HttpSender(server.url) as send,
    ):

        def two(prefix):
            barrier.wait(5)
            return [send({"id": f"{prefix}{n}", "qty": 1}) for n in range(3)]

        threads = [threading.Thread(target=two, args=(p,)) for p in "xy"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert len(send.pool.connections) == 2
    by_connection: dict[int, set[str]] = {}
    for conn, event_id in server.requests:
        by_connection.setdefault(conn, set()).add(event_id[0])
    assert sorted(by_connection.values(), key=sorted) == [{"x"}, {"y"}]
