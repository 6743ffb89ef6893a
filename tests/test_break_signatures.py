"""Attacks on signing and secrets (``asnackq.wire.webhooks``) found by review."""

from __future__ import annotations

from asnackq.wire import webhooks
from asnackq.wire.send import AsyncHttpSender


def test_a_keyring_s_repr_never_shows_a_secret() -> None:
    """``Signatures`` hides its keys from its repr; a sender's ``Keyring`` showed its
    ``whsec_`` secrets whole (a log line, an error or a traceback with locals)."""
    one, two = webhooks.new_secret(), webhooks.new_secret()
    ring = webhooks.Keyring.of(one).rotate(two, now_s=1_000.0)
    for shown in (
        repr(ring),
        str(ring),
        repr(AsyncHttpSender("http://127.0.0.1:9/", secrets=ring).keyring),
    ):
        assert one[6:] not in shown and two[6:] not in shown and "whsec_" not in shown, shown
    assert "2 secrets" in repr(ring)
