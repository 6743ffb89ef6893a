"""Both senders against every kind of ordinary server (``tests/peers.py``): the same verdict
from each, and the stdlib sender's connections kept alive exactly while the server allows."""

from __future__ import annotations

import json

import pytest

from asnackq.core.worker import BadAck, Permanent, Unavailable

from .peers import KEPT_ALIVE, KINDS, send_each, serving

IDS = ("a", "b", "c")


@pytest.mark.parametrize("kind", KINDS)
async def test_every_kind_of_server_acks_each_send_on_both_senders(kind, tmp_path):
    with serving(kind, tmp_path) as peer:
        assert await send_each(peer.url) == ([True] * 3, [True] * 3)
        assert peer.ids == [*IDS, *IDS]
        # the stdlib sender: one connection while the server keeps it, else one per send
        assert len(set(peer.peers[:3])) == (1 if kind in KEPT_ALIVE else 3)


def answering(status, body):
    return lambda event_id: (status, json.dumps(body).encode() if body is not None else b"OK")


ANSWERS = {
    "wrong-id": (answering(200, {"id": "zz", "status": "applied"}), BadAck),
    "not-json": (answering(200, None), BadAck),
    "conflict": (answering(409, {"id": "a"}), Permanent),
    "unavailable": (answering(503, {"status": "down"}), Unavailable),
}


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "sink"])
async def test_every_kind_of_server_refusing_gets_the_same_exception_from_both(
    kind, answer, tmp_path
):
    respond, expected = ANSWERS[answer]
    with serving(kind, tmp_path, respond) as peer:
        assert await send_each(peer.url, IDS[:2]) == ([expected] * 2, [expected] * 2)
        assert peer.ids == [*IDS[:2], *IDS[:2]]
