"""Standard Webhooks signatures against the official library, the specification's test
vector, and hostile headers."""

from __future__ import annotations

import base64
import datetime
import time

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from asnackq.wire import webhooks as wh

# The test vector of the specification's reference libraries (standard-webhooks, and
# Svix's documentation): secret, id, timestamp and body, and the signature they give.
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR = ("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
BODY = b'{"type": "order.created", "data": {"id": "o-1", "total": 12.5}}'


def key(secret: str) -> bytes:
    return wh.parse_secret(secret)


def test_the_specification_vector_signs_and_verifies() -> None:
    msg_id, stamp, body = VECTOR
    assert wh.sign([key(VECTOR_SECRET)], msg_id, stamp, body) == VECTOR_SIGNATURE
    headers = {"webhook-id": msg_id, "webhook-timestamp": str(stamp)}
    headers["webhook-signature"] = VECTOR_SIGNATURE
    assert wh.verify([key(VECTOR_SECRET)], headers, body, now_s=stamp + 299) == msg_id
    with pytest.raises(wh.Unverified, match="too old"):
        wh.verify([key(VECTOR_SECRET)], headers, body, now_s=stamp + 301)


def test_the_official_library_accepts_our_signatures_with_every_active_secret() -> None:
    old, new = wh.new_secret(), wh.new_secret(64)
    headers = wh.signed_headers([key(new), key(old)], "d-1", BODY)
    assert headers["webhook-signature"].count("v1,") == 2
    for secret in (old, new):  # a receiver holding either secret verifies it
        assert Webhook(secret).verify(BODY, headers) == {
            "type": "order.created",
            "data": {"id": "o-1", "total": 12.5},
        }
    with pytest.raises(WebhookVerificationError):
        Webhook(wh.new_secret()).verify(BODY, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(new).verify(BODY + b" ", headers)


def test_we_accept_the_official_librarys_signatures_and_nothing_altered() -> None:
    secret = wh.new_secret()
    now = datetime.datetime.now(datetime.UTC)
    headers = {
        "webhook-id": "msg_2",
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": Webhook(secret).sign("msg_2", now, BODY),
    }
    assert wh.verify([key(wh.new_secret()), key(secret)], headers, BODY) == "msg_2"
    altered = [
        ({**headers, "webhook-id": "msg_3"}, BODY),
        (headers, BODY.replace(b"12.5", b"125")),
        ({**headers, "webhook-timestamp": str(int(now.timestamp()) - 1)}, BODY),
    ]
    for changed, body in altered:
        with pytest.raises(wh.Unverified, match="no webhook-signature entry matches"):
            wh.verify([key(secret)], changed, body)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"webhook-id": None}, "headers are required"),
        ({"webhook-signature": ""}, "headers are required"),
        ({"webhook-id": "a b"}, "visible ASCII"),
        ({"webhook-id": "x" * 257}, "visible ASCII"),
        ({"webhook-id": "caf\u00e9"}, "visible ASCII"),
        ({"webhook-timestamp": "1e9"}, "Unix seconds"),
        ({"webhook-timestamp": "-5"}, "Unix seconds"),
        ({"webhook-timestamp": "9" * 400}, "Unix seconds"),
        ({"webhook-timestamp": "100"}, "too old"),
        ({"webhook-timestamp": str(int(time.time()) + 3600)}, "far in the future"),
        ({"webhook-signature": " ".join(["v1,AAAA"] * 1000)}, "more than 16"),
        ({"webhook-signature": "v1a,AAAA v2,BBBB"}, "no webhook-signature entry"),
        ({"webhook-signature": "v1," + "A" * 3000}, "more than 16"),
    ],
)
def test_a_bad_header_is_one_clear_refusal(change: dict[str, str | None], reason: str) -> None:
    secret = key(wh.new_secret())
    headers: dict[str, str] = wh.signed_headers([secret], "d-1", BODY)
    for name, value in change.items():
        if value is None:
            del headers[name]
        else:
            headers[name] = value
    with pytest.raises(wh.Unverified, match=reason) as refused:
        wh.verify([secret], headers, BODY)
    assert "\n" not in refused.value.reason


def test_a_tolerance_can_be_set() -> None:
    secret = key(wh.new_secret())
    headers = wh.signed_headers([secret], "d-1", BODY, now_s=1_000_000)
    assert wh.verify([secret], headers, BODY, now_s=1_000_030, tolerance_s=30) == "d-1"
    with pytest.raises(wh.Unverified, match="tolerance 30 s"):
        wh.verify([secret], headers, BODY, now_s=1_000_031, tolerance_s=30)


@pytest.mark.parametrize(
    "text",
    [
        "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",  # no prefix
        "whsec_" + base64.b64encode(b"x" * 23).decode(),  # too short
        "whsec_" + base64.b64encode(b"x" * 65).decode(),  # too long
        "whsec_not base64!",
        "whsec_QUJD\nREVG",
        "whsec_",
        b"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        None,
    ],
)
def test_a_bad_secret_is_refused_without_repeating_it(text: object) -> None:
    with pytest.raises(wh.BadSecret) as refused:
        wh.parse_secret(text)
    assert "MfKQ9r8G" not in str(refused.value) and "QUJD" not in str(refused.value)


def test_a_rotation_keeps_the_old_secret_signing_for_its_overlap() -> None:
    first, second, third = wh.new_secret(), wh.new_secret(), wh.new_secret()
    ring = wh.Keyring.of(first).rotate(second, now_s=1000)
    assert ring.keys(now_s=1000) == [key(second), key(first)]
    assert ring.keys(now_s=1000 + 86_399) == [key(second), key(first)]
    assert ring.keys(now_s=1000 + 86_400) == [key(second)]
    later = ring.rotate(third, now_s=2000, overlap_s=60)
    # the first keeps its own end; the second, replaced now, signs for 60 s more
    assert later.entries == ((third, None), (second, 2060), (first, 1000 + 86_400))
    assert later.rotate(wh.new_secret(), now_s=100_000).entries[1:] == ((third, 100_000 + 86_400),)
    with pytest.raises(wh.BadSecret):
        ring.rotate("whsec_short", now_s=1000)


def test_an_unpadded_secret_is_the_same_key_as_the_official_librarys() -> None:
    padded = "whsec_" + base64.b64encode(bytes(range(40, 65))).decode()  # 25 bytes: '=' padded
    assert padded.endswith("=")
    unpadded = padded.rstrip("=")
    assert wh.parse_secret(unpadded) == wh.parse_secret(padded) == bytes(range(40, 65))
    headers = wh.signed_headers([wh.parse_secret(unpadded)], "d-1", BODY)
    assert Webhook(unpadded).verify(BODY, headers) is not None
    with pytest.raises(wh.BadSecret):  # URL-safe base64 is another key: refused, not misread
        wh.parse_secret("whsec_" + base64.urlsafe_b64encode(b"\xfb\xff" * 16).decode())
