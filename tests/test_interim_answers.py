"""Interim answers before the final one (RFC 9110, 15.2): ``100 Continue``, ``102
Processing`` and ``103 Early Hints`` are read past by both senders, which judge the final
answer; ``101 Switching Protocols`` is no ACK.  The receiver is Python's ``http.server``,
writing its interim answers as the standard library does (``send_response_only``)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from asnackq.core.worker import BadAck
from asnackq.wire.send import AsyncHttpSender, HttpSender


class Interim(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    interim: tuple[tuple[int, dict[str, str]], ...] = ()
    final = 200

    def do_POST(self) -> None:
        event = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        for status, headers in self.interim:
            self.send_response_only(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.flush()
        body = json.dumps({"id": event["id"], "status": "applied"}).encode()
        self.send_response(self.final)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def receiver(interim: tuple[tuple[int, dict[str, str]], ...], final: int = 200) -> Iterator[str]:
    handler = type("Handler", (Interim,), {"interim": interim, "final": final})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/events"
    finally:
        server.shutdown()
        server.server_close()


async def send_async(url: str, event_id: str) -> bool:
    async with AsyncHttpSender(url, timeout_s=10) as send:
        return await send({"id": event_id, "qty": 1})


HINTS = (103, {"Link": "</style.css>; rel=preload; as=style"})
PROCESSING = (102, {})
CONTINUE = (100, {})


@pytest.mark.parametrize(
    "interim",
    [(HINTS,), (PROCESSING,), (CONTINUE, PROCESSING, HINTS, HINTS), (PROCESSING,) * 20],
    ids=["103", "102", "100-102-103-103", "102x20"],
)
def test_both_senders_read_past_interim_answers_to_the_ack(interim):
    with receiver(interim) as url:
        with HttpSender(url, timeout_s=10) as send:
            assert send({"id": "a-1", "qty": 1}) is True
            assert send({"id": "a-2", "qty": 1}) is True  # the kept connection is sound
        assert asyncio.run(send_async(url, "a-3")) is True


def test_switching_protocols_is_no_ack_for_either_sender():
    with receiver((), final=101) as url:
        with HttpSender(url, timeout_s=10) as send, pytest.raises(BadAck, match="101"):
            send({"id": "a-1", "qty": 1})
        with pytest.raises(BadAck, match="101"):
            asyncio.run(send_async(url, "a-2"))
