"""A real ``asnackq sink`` process against hostile clients: raw sockets send what an HTTP
client would refuse to.  Every bad request gets a 4xx (JSON where the request could be
parsed) and one log line, never a 500 or a traceback; the sink keeps serving and its
stock stays the sum of its inbox."""

from __future__ import annotations

import contextlib
import gzip
import json
import resource
import socket
import time
import urllib.parse
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asnackq.lab.procs import sink_process, sink_stats
from asnackq.wire.send import HttpSender

from .logs import problems
from .sinks import sink_state


class Sink:
    """A running sink child process: its URL, port, DB and log file."""

    def __init__(self, url, db, log):
        self.url, self.db, self.log = url, db, log
        self.port = urllib.parse.urlsplit(url).port

    def log_lines(self):
        """Its log's lines, the state changes (started, stopping, stopped) set apart."""
        return problems(self.log.read_text()).splitlines()

    def exchange(self, data, timeout=5.0):
        """Send raw bytes on a new connection; the status (None without an answer) and body."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            with contextlib.suppress(OSError):
                s.sendall(data)
            reply = read_until_close(s)
        if not reply:
            return None, b""
        assert reply.startswith(b"HTTP/1."), reply[:100]
        head, _, body = reply.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body

    def serves(self, event_id):
        return HttpSender(self.url, timeout_s=5)({"id": event_id, "qty": 1}) is True


def read_until_close(s):
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def running_sink(tmp_path, *options):
    db, log = tmp_path / "sink.db", tmp_path / "sink.log"
    with open(log, "w") as stderr, sink_process(db, *options, stderr=stderr) as url:
        yield Sink(url, db, log)
    assert "Traceback" not in log.read_text()
    total, inbox = sink_state(db)
    assert total == sum(qty for _, qty, _ in inbox)


def request(body=b"", *, method=b"POST", path=b"/events", headers=(), length=None):
    """A raw HTTP/1.1 request (``Connection: close``, so that the sink closes after it)
    announcing ``length`` body bytes (by default the body's length)."""
    lines = [
        method + b" " + path + b" HTTP/1.1",
        b"Host: sink",
        b"Connection: close",
        b"Content-Length: %d" % (len(body) if length is None else length),
        *headers,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def wait_for(condition, timeout=5.0):
    """Poll ``condition`` until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


JSON = b"Content-Type: application/json"
EVENT = b'{"id": "a", "qty": 2}'


@pytest.mark.process
def test_a_body_that_is_not_in_its_content_encoding_is_a_json_400(tmp_path):
    with running_sink(tmp_path) as sink:
        for encoding in (b"deflate", b"gzip"):
            status, body = sink.exchange(
                request(EVENT, headers=[JSON, b"Content-Encoding: " + encoding])
            )
            assert status == 400
            assert json.loads(body)["status"] == "bad request"
        assert (
            sink.exchange(request(gzip.compress(EVENT), headers=[JSON, b"Content-Encoding: gzip"]))[
                0
            ]
            == 200
        )  # real gzip is fine
        assert sink_stats(sink.url)["rejected"] == 2
        lines = sink.log_lines()
    assert len(lines) == 2 and all("cannot be read" in line for line in lines)
    assert sink_state(tmp_path / "sink.db") == (2, [("a", 2, 1)])


@pytest.mark.process
def test_with_a_token_every_route_needs_it_and_a_non_ascii_header_is_a_401(tmp_path):
    with running_sink(tmp_path, "--auth-token", "s3cret") as sink:
        good = b"Authorization: Bearer s3cret"
        for bad in (
            b"Authorization: Bearer s3cr\xe9t",
            b"Authorization: Bearer \xff\xfe",
            b"Authorization: Bearer wrong",
        ):
            status, body = sink.exchange(request(EVENT, headers=[JSON, bad]))
            assert (status, json.loads(body)["status"]) == (401, "unauthorized")
        for path in (b"/events/a", b"/stats", b"/metrics"):
            assert sink.exchange(request(method=b"GET", path=path))[0] == 401
            assert sink.exchange(request(method=b"GET", path=path, headers=[good]))[0] in (200, 404)
        assert sink.exchange(request(EVENT, headers=[JSON, good]))[0] == 200
        assert len(sink.log_lines()) == 6
    assert sink_state(tmp_path / "sink.db") == (2, [("a", 2, 1)])


MALFORMED = [
    b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n",
    b"POST /events HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(40)) + b"\r\n",
    b"POST /events HTTP/1.1\r\nHost: x\r\nX-Long: " + b"y" * 5000 + b"\r\n\r\n",
    b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /events/\xff HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /events HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
]


@pytest.mark.process
def test_malformed_requests_and_mid_body_hang_ups_log_one_line_each(tmp_path):
    with running_sink(tmp_path) as sink:
        for data in MALFORMED:
            assert sink.exchange(data)[0] == 400
        for _ in range(5):  # announce 100 bytes, send 5, hang up
            with socket.create_connection(("127.0.0.1", sink.port)) as s:
                s.sendall(request(b'{"id"', headers=[JSON], length=100))
        assert sink.exchange(request(method=b"GET", path=b"/%1B[2J%0Afake%E2%80%AE"))[0] == 404
        assert sink.serves("after")
        assert wait_for(lambda: len(sink.log_lines()) >= len(MALFORMED) + 6)
        lines = sink.log_lines()
    assert len(lines) == len(MALFORMED) + 6
    assert all(
        line.startswith("asnackq sink: ") and line.isascii() and line.isprintable()
        for line in lines
    )
    assert sum("the body cannot be read" in line for line in lines) == 5


@pytest.mark.process
def test_an_unknown_expectation_is_a_417_on_every_path_even_with_a_non_utf8_byte(tmp_path):
    """(aiohttp's default expect handler echoes the header: a non-UTF-8 byte made a 500.)"""
    with running_sink(tmp_path) as sink:
        for method, path in (
            (b"POST", b"/events"),
            (b"GET", b"/stats"),
            (b"GET", b"/nowhere"),
            (b"GET", b"/new%0Aline"),
            (b"OPTIONS", b"*"),
            (b"CONNECT", b"127.0.0.1:80"),
            (b"GET", b"http://x"),
        ):
            status, body = sink.exchange(
                request(EVENT, method=method, path=path, headers=[JSON, b"Expect: \x80"])
            )
            assert (status, json.loads(body)["status"]) == (417, "expectation failed")
        with socket.create_connection(("127.0.0.1", sink.port), timeout=5) as s:
            s.sendall(request(EVENT, headers=[JSON, b"Expect: 100-continue"]))
            reply = read_until_close(s)
        assert reply.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
    assert sink_state(tmp_path / "sink.db") == (2, [("a", 2, 1)])


HALF_HEADERS = b"POST /events HTTP/1.1\r\nHost: x\r\n"
HALF_BODY = request(EVENT, headers=[JSON], length=100)  # 100 announced, 21 sent


def idle_sockets(port, count, sent=HALF_HEADERS):
    """``count`` connections, each with half a request sent (slowloris)."""
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(sent)
        socks.append(s)
    return socks


def closed_by_peer(s, timeout):
    s.settimeout(timeout)
    try:
        return read_until_close(s) == b""
    except TimeoutError:
        return False


@pytest.mark.process
def test_idle_and_half_sent_connections_are_closed_after_the_idle_timeout(tmp_path):
    with running_sink(tmp_path, "--idle-timeout-s", "0.3") as sink:
        socks = idle_sockets(sink.port, 20)
        started = time.monotonic()
        try:
            assert all(closed_by_peer(s, 5) for s in socks)
        finally:
            for s in socks:
                s.close()
        assert 0.1 < time.monotonic() - started < 3
        assert sink.serves("after")


@contextlib.contextmanager
def descriptor_limit(soft):
    """Lower this process's soft descriptor limit (a child started meanwhile inherits it)."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


@pytest.mark.process
@pytest.mark.parametrize("sent", [HALF_HEADERS, HALF_BODY], ids=["headers", "body"])
def test_a_flood_of_half_sent_requests_beyond_the_descriptor_limit_cannot_starve_a_request(
    tmp_path, sent
):
    """With 224 descriptors the sink admits 32 connections (224 - one accept batch of 128
    - 64 for itself); 260 slowloris sockets - half their headers sent, or half their
    body - evict each other, oldest first, and a real request still gets through at once."""
    with contextlib.ExitStack() as stack:
        with descriptor_limit(224):
            sink = stack.enter_context(running_sink(tmp_path))
        socks = [stack.enter_context(s) for s in idle_sockets(sink.port, 260, sent)]
        started = time.monotonic()
        assert HttpSender(sink.url, timeout_s=5)({"id": "real", "qty": 3}) is True
        assert time.monotonic() - started < 2
        stats = sink_stats(sink.url)
        assert stats["evicted"] >= 260 - 32 and stats["applied"] == 1
        assert sum(closed_by_peer(s, 0.01) for s in socks) >= 260 - 32
    assert sink_state(tmp_path / "sink.db") == (3, [("real", 3, 1)])


@pytest.mark.process
def test_a_body_that_does_not_arrive_in_time_is_a_408(tmp_path):
    with running_sink(tmp_path, "--body-timeout-s", "0.3") as sink:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", sink.port), timeout=5) as s:
            s.sendall(request(EVENT, headers=[JSON])[:-4])  # four bytes short
            reply = read_until_close(s)
        assert 0.2 < time.monotonic() - started < 4
        assert reply.startswith(b"HTTP/1.1 408 ")
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["status"] == "request timeout"
        assert sink.serves("after")
    assert sink_state(tmp_path / "sink.db") == (1, [("after", 1, 1)])


# --- fuzz: random bytes, headers and encodings --------------------------------------------

ENCODINGS = [
    b"gzip",
    b"deflate",
    b"br",
    b"zstd",
    b"identity",
    b"gzip, deflate",
    b"x-bogus",
    b"gzip\xff",
]
COMPRESS = {b"gzip": gzip.compress, b"deflate": zlib.compress}
bodies = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda i, q: json.dumps({"id": i, "qty": q}).encode(),
        st.sampled_from(["f1", "f2", "f3", "a b", ""]),
        st.one_of(st.integers(-2, 1002), st.booleans(), st.none(), st.text(max_size=3)),
    ),
)
header_values = st.one_of(
    st.binary(max_size=30),
    st.sampled_from(
        [
            b"application/json",
            b"text/plain",
            b"application/json; charset=latin-1",
            b"1",
            b"0",
            b"99999999999999999",
            b"chunked",
            b"100-continue",
            b"Bearer x",
        ]
    ),
)


@st.composite
def hostile_requests(draw):
    body = draw(bodies)
    encoding = draw(st.none() | st.sampled_from(ENCODINGS))
    headers = [b"Content-Type: " + draw(header_values)]
    if encoding is not None:
        headers.append(b"Content-Encoding: " + encoding)
        if draw(st.booleans()) and encoding in COMPRESS:
            body = COMPRESS[encoding](body)
    names = st.sampled_from(
        [
            b"X-Asnackq-Token",
            b"Authorization",
            b"Transfer-Encoding",
            b"Expect",
            b"Content-Length",
            b"X-" + b"y" * 40,
        ]
    )
    headers += [
        n + b": " + v for n, v in draw(st.lists(st.tuples(names, header_values), max_size=3))
    ]
    cut = draw(st.integers(0, 3))  # a body longer than announced
    method = draw(
        st.sampled_from(
            [b"POST", b"POST", b"POST", b"GET", b"PUT", b"OPTIONS", b"CONNECT", b"P\x00ST"]
        )
    )
    path = draw(
        st.sampled_from(
            [
                b"/events",
                b"/events",
                b"/events/f1",
                b"/events/%ED%A0%80",
                b"/stats",
                b"/metrics",
                b"/nowhere",
                b"/events?x=\xff",
                b"*",
                b"http://x/events",
                b"x:80",
                b"/%0A%1B",
            ]
        )
    )
    return request(body, method=method, path=path, headers=headers, length=max(len(body) - cut, 0))


@pytest.fixture(scope="module")
def fuzz_sink(tmp_path_factory):
    with running_sink(tmp_path_factory.mktemp("fuzz"), "--body-timeout-s", "0.5") as sink:
        yield sink


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=hostile_requests())
def test_fuzzed_raw_requests_never_get_a_5xx_and_the_sink_keeps_serving(fuzz_sink, data):
    status, _ = fuzz_sink.exchange(data)
    assert status is None or status < 500, (status, data)
    assert fuzz_sink.exchange(request(b'{"id": "ok", "qty": 1}', headers=[JSON]))[0] == 200
    total, inbox = sink_state(fuzz_sink.db)
    assert total == sum(qty for _, qty, _ in inbox)
