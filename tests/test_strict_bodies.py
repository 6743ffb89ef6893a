"""Ambiguous JSON and unreadable encodings, through a real ``asnackq sink`` process on raw
sockets, both senders against a real peer, and the real ``enqueue`` command: refused with
one reason, nothing applied."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest
from aiohttp import web

from asnackq.core.worker import BadAck

from .sinks import peer, serving, sink_state
from .test_cli import fails, ok
from .test_hostile_sink import JSON, request, running_sink
from .test_senders import send_both

EVENT = b'{"id": "a", "qty": 2}'
AMBIGUOUS = [
    b'{"id": "a", "qty": 1, "qty": 2}',
    b'{"id": "x", "qty": 1, "id": "a"}',
    '{"id": "a", "qty": 2}'.encode("utf-16"),
    '{"id": "a", "qty": 2}'.encode("utf-16-le"),
    b"\xef\xbb\xbf" + EVENT,
    b'{"id": "a", "qty": NaN}',
    b'{"id": "a", "qty": ' + b"1" * 4000 + b"}",
]


@pytest.mark.process
def test_the_sink_refuses_ambiguous_json_and_applies_nothing(tmp_path):
    with running_sink(tmp_path) as sink:
        for body in AMBIGUOUS:
            status, answer = sink.exchange(request(body, headers=[JSON]))
            assert status == 400, body
            assert json.loads(answer)["status"] == "bad request"
        assert sink.serves("after")
        lines = sink.log_lines()
    assert len(lines) == len(AMBIGUOUS), lines  # one line each
    assert any("appears more than once" in line for line in lines)
    assert any("UTF-8" in line for line in lines)
    assert any("byte-order mark" in line for line in lines)


def cut(data, n):
    return data[:-n]


CODED = [
    (cut(gzip.compress(EVENT), 8), b"gzip", 400),  # CRC and length cut off
    (cut(gzip.compress(EVENT), 4), b"gzip", 400),  # the length cut off
    (cut(gzip.compress(EVENT), 1), b"gzip", 400),
    (gzip.compress(EVENT) + b"junk", b"gzip", 400),
    (gzip.compress(EVENT) * 2, b"gzip", 400),  # a second member: not one body
    (cut(zlib.compress(EVENT), 4), b"deflate", 400),  # the Adler-32 cut off
    (EVENT, b"gzip", 400),
    (gzip.compress(b" " * 100_000 + EVENT), b"gzip", 413),  # measured decoded
    (EVENT, b"foo", 415),
    (EVENT, b"gzip\xff", 415),
    (gzip.compress(EVENT), b"gzip, deflate", 415),
    (EVENT, b"br", 415),
    (EVENT, b"zstd", 415),
    (EVENT, b"compress", 415),
    (gzip.compress(EVENT), b"GZip", 200),
    (gzip.compress(EVENT), b"x-gzip", 200),
    (zlib.compress(EVENT), b"deflate", 200),
    (EVENT, b"identity", 200),
]


@pytest.mark.process
def test_the_sink_decodes_a_body_whole_or_refuses_it_as_json(tmp_path):
    with running_sink(tmp_path) as sink:
        for body, coding, expected in CODED:
            headers = [JSON, b"Content-Encoding: " + coding]
            status, answer = sink.exchange(request(body, headers=headers))
            assert status == expected, (coding, body[:40])
            assert json.loads(answer)["error" if expected != 200 else "status"]
        assert sink.serves("after")
        lines = sink.log_lines()
    refused = sum(expected != 200 for _, _, expected in CODED)
    assert len(lines) == refused and all("asnackq sink: 4" in line for line in lines)
    # The four good bodies: one effect, four deliveries; the refused ones: none.
    assert sink_state(tmp_path / "sink.db") == (3, [("a", 2, 4), ("after", 1, 1)])


@pytest.mark.process
def test_two_content_encoding_headers_are_refused(tmp_path):
    with running_sink(tmp_path) as sink:
        headers = [JSON, b"Content-Encoding: identity", b"Content-Encoding: gzip"]
        assert sink.exchange(request(EVENT, headers=headers))[0] == 415


@pytest.mark.parametrize(
    "ack",
    [
        '{"id": "other", "status": "applied", "id": "a"}',
        '{"id": "a", "status": "conflict", "status": "applied"}',
        '{"id": "a", "status": "applied", "id": "a"}',
        '\ufeff{"id": "a", "status": "applied"}',
    ],
)
async def test_both_senders_refuse_an_ambiguous_ack(ack):
    async def handler(request):
        await request.read()
        return web_response(ack)

    async with serving(peer(handler)) as running:
        assert await send_both(running.url) == [BadAck, BadAck]


def web_response(text):
    return web.Response(text=text, content_type="application/json")


@pytest.mark.process
def test_enqueue_refuses_an_ambiguous_line_and_writes_nothing(tmp_path):
    queue = tmp_path / "q.db"
    ok("init", queue)
    before = queue.read_bytes()
    for line in (
        '{"id": "x", "qty": 1, "id": "y"}',
        '{"id": "x", "qty": 1, "qty": 2}',
        '{"id": "x", "qty": ' + "9" * 100_000 + "}",
        '{"id": "x", "qty": 1e400}',
    ):
        said = fails("enqueue", queue, "-", stdin='{"id": "ok", "qty": 1}\n' + line + "\n")
        assert said.startswith("asnackq enqueue: stdin:2: ") and said.count("\n") == 1, said
        assert "sys.set_int_max_str_digits" not in said
    assert queue.read_bytes() == before
