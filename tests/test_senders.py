"""Both senders against real loopback peers: only a verified ACK is evidence."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from asnackq.core.worker import BadAck, Overloaded, Permanent, Retryable, Unavailable
from asnackq.wire.send import AsyncHttpSender, HttpSender, TimedOut, judge, request_parts

from .sinks import dead_port, peer, serving, sink, sink_state

EVENT = {"id": "a", "qty": 2}


async def send_both(url, event=EVENT, **options):
    """Send with each sender; return what each returned or raised, by type."""
    outcomes = []
    try:
        outcomes.append(await asyncio.to_thread(HttpSender(url, **options), dict(event)))
    except Exception as error:
        outcomes.append(type(error))
    async with AsyncHttpSender(url, **options) as send:
        try:
            outcomes.append(await send(dict(event)))
        except Exception as error:
            outcomes.append(type(error))
    return outcomes


def answering(status=200, body=None, headers=None):
    async def handler(request):
        await request.read()
        text = json.dumps({"id": "a", "status": "applied"}) if body is None else body
        return web.Response(
            status=status, text=text, headers=headers, content_type="application/json"
        )

    return peer(handler)


@pytest.mark.parametrize(
    ("app", "expected"),
    [
        (answering(), True),
        (answering(body=json.dumps({"id": "a", "status": "duplicate"})), True),
        (answering(body=json.dumps({"id": "b", "status": "applied"})), BadAck),
        (answering(body=json.dumps({"id": "a", "status": "conflict"})), BadAck),
        (answering(body=json.dumps({"id": "a"})), BadAck),
        (answering(body=json.dumps(["a", "applied"])), BadAck),
        (answering(body="OK"), BadAck),
        (answering(body=json.dumps({"id": "a", "status": "applied", "pad": "x" * 5000})), BadAck),
        (answering(status=302, headers={"Location": "/elsewhere"}), BadAck),
        (answering(status=307, headers={"Location": "/elsewhere"}), BadAck),
        (answering(status=201), BadAck),
        (answering(status=404), BadAck),
        (answering(status=400), Permanent),
        (answering(status=409), Permanent),
        (answering(status=413), Permanent),
        (answering(status=415), Permanent),
        (answering(status=422), Permanent),
        (answering(status=408), Retryable),
        (answering(status=425), Retryable),
        (answering(status=429), Overloaded),
        (answering(status=429, headers={"Retry-After": "soon"}), Overloaded),
        (answering(status=503, headers={"Retry-After": "1"}), Overloaded),
        (answering(status=503, headers={"Retry-After": "soon"}), Unavailable),
        (answering(status=500), Retryable),
        (answering(status=501), Retryable),
        (answering(status=502), Unavailable),
        (answering(status=503), Unavailable),
        (answering(status=504), Unavailable),
    ],
)
async def test_answers_are_classified_the_same_by_both_senders(app, expected):
    async with serving(app) as running:
        assert await send_both(running.url) == [expected, expected]


async def test_a_redirect_is_never_followed(tmp_path):
    hits = []

    async def elsewhere(request):
        hits.append(request.path)
        return web.json_response({"id": "a", "status": "applied"})

    async def redirect(request):
        raise web.HTTPFound("/elsewhere")

    app = web.Application()
    app.router.add_post("/events", redirect)
    app.router.add_post("/elsewhere", elsewhere)
    async with serving(app) as running:
        assert await send_both(running.url) == [BadAck, BadAck]
    assert hits == []


async def test_a_reset_connection_and_a_refused_port_say_the_sink_is_unavailable():
    async def reset(request):
        request.transport.abort()
        raise asyncio.CancelledError

    async with serving(peer(reset)) as running:
        assert await send_both(running.url) == [Unavailable, Unavailable]
    assert await send_both(f"http://127.0.0.1:{dead_port()}/events") == [Unavailable] * 2
    assert issubclass(Unavailable, Retryable)  # run_once retries it like any Retryable


async def test_no_answer_in_time_says_the_sink_is_timing_out():
    async def slow(request):
        await asyncio.sleep(1)
        return web.json_response({"id": "a", "status": "applied"})

    async with serving(peer(slow)) as running:
        assert await send_both(running.url, timeout_s=0.1) == [TimedOut, TimedOut]


async def test_proxy_variables_are_ignored(tmp_path, monkeypatch):
    proxy = f"http://127.0.0.1:{dead_port()}"
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, proxy)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    async with sink(tmp_path / "s.db") as running:
        assert await send_both(running.url) == [True, True]
    assert sink_state(tmp_path / "s.db") == (2, [("a", 2, 2)])


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1/events",
        "http://192.168.1.5:8080/events",
        "http://example.com/events",
        "http://0.0.0.0/events",
        "ftp://127.0.0.1/events",
        "127.0.0.1:80/events",
        "",
        5,
    ],
)
def test_non_loopback_or_malformed_urls_are_refused(url):
    with pytest.raises(ValueError):
        HttpSender(url)
    with pytest.raises(ValueError):
        AsyncHttpSender(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:1/events",
        "http://localhost/events",
        "http://[::1]:8080/events",
        "http://127.8.9.10/x",
    ],
)
def test_loopback_urls_are_accepted(url):
    HttpSender(url)
    AsyncHttpSender(url)


def test_remote_urls_need_the_explicit_flag():
    assert HttpSender("http://sink.test/events", allow_remote=True).parts.hostname == "sink.test"
    # A private address also needs its network allowed (tests/test_address_guard.py).
    with pytest.raises(ValueError, match=r"10\.0\.0\.1 is a private address"):
        HttpSender("http://10.0.0.1/events", allow_remote=True)
    allowed = HttpSender("http://10.0.0.1/events", allow_remote=True, allow_networks=["10.0.0.0/8"])
    assert allowed.parts.hostname == "10.0.0.1"


@pytest.mark.parametrize(
    ("event", "token"),
    [
        ({"id": "a b", "qty": 1}, None),
        ({"id": "a", "qty": 0}, None),
        ({"id": "a"}, None),
        ({"id": "a", "qty": 1}, 0),
        ({"id": "a", "qty": 1}, True),
        ({"id": "a", "qty": 1}, "1"),
    ],
)
async def test_bad_events_and_tokens_are_refused_before_sending(tmp_path, event, token):
    async with sink(tmp_path / "s.db") as running, AsyncHttpSender(running.url) as send:
        with pytest.raises(ValueError):
            await send(event, token)
        with pytest.raises(ValueError):
            await asyncio.to_thread(HttpSender(running.url), event, token)
    assert sink_state(tmp_path / "s.db") == (0, [])


def test_judge_reads_only_a_bounded_ack():
    assert judge(200, json.dumps({"id": "a", "status": "applied"}).encode(), "a") is True
    with pytest.raises(BadAck):
        judge(200, b" " * 4097, "a")


@contextlib.asynccontextmanager
async def raw_peer(answer):
    """A loopback server that reads one request, then runs ``answer(reader, writer)``."""

    async def handle(reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            await answer(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/events"
    finally:
        server.close()
        await server.wait_closed()


ACK = json.dumps({"id": "a", "status": "applied"}).encode()
OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


async def test_timeout_s_bounds_the_whole_answer_not_each_read():
    """A peer dripping a valid ACK a byte every 20 ms (about 2.5 s in all) is a timeout
    after timeout_s = 0.3 for both senders, however lively each read is."""

    async def drip(reader, writer):
        for byte in OK_HEAD % len(ACK) + ACK:
            if reader.at_eof():  # the sender gave up and closed
                return
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.02)

    async with raw_peer(drip) as url:
        started = time.monotonic()
        with pytest.raises(Retryable):
            await asyncio.to_thread(HttpSender(url, timeout_s=0.3), dict(EVENT))
        assert time.monotonic() - started < 2.2  # (the whole drip: 2.5 s)
        assert await send_both(url, timeout_s=0.3) == [TimedOut, TimedOut]


async def test_a_body_shorter_than_its_content_length_proves_nothing():
    async def short(reader, writer):
        writer.write(OK_HEAD % 1000 + ACK)  # 1000 announced, a whole ACK, then close
        await writer.drain()

    async with raw_peer(short) as url:  # a cut answer: the connection, not the job
        assert await send_both(url) == [Unavailable, Unavailable]


@given(
    st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True),
    st.integers(1, 1000),
    st.one_of(st.none(), st.integers(1, 10**15)),
)
def test_the_body_is_json_dumps_own_bytes(event_id, qty, token):
    sent_id, body, headers = request_parts({"id": event_id, "qty": qty}, token)
    assert body == json.dumps({"id": event_id, "qty": qty}).encode() and sent_id == event_id
    assert json.loads(body) == {"id": event_id, "qty": qty}
    assert headers.get("X-Asnackq-Token") == (None if token is None else str(token))
