"""What names a receiver, for the senders (``asnackq.wire``) and the endpoints alike.

Rules of this module (standard library only, no I/O):

* A receiver's URL is ``http(s)://HOST[:PORT]/PATH`` with a port in 1..65535; a host that
  is not loopback (``localhost``, 127.0.0.0/8, ``::1``) only where remote hosts are allowed.
* What proves a delivery is one of ``SUCCESS_RULES``: the sink's verified ACK, or any 2xx.
* A secret is ``whsec_`` + base64 of 24-64 bytes; anything else is ``BadSecret``, whose
  message never contains the text it was given.  A secret is shown only as its
  ``fingerprint``.
* A keyring is plain data: ``(secret, until)`` pairs, newest first, ``until`` None for a
  secret that signs until it is rotated out.  ``rotated`` is the one rotation rule, in
  whatever unit its caller counts time (``wire.webhooks.Keyring``: seconds; the endpoints:
  milliseconds).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import re
import urllib.parse
from collections.abc import Iterable
from typing import TypeVar

__all__ = [
    "PREFIX",
    "ROTATION_S",
    "SUCCESS_RULES",
    "BadSecret",
    "check_url",
    "fingerprint",
    "is_loopback",
    "parse_secret",
    "rotated",
]

SUCCESS_RULES = ("ack", "2xx")
PREFIX = "whsec_"
ROTATION_S = 86_400  # how long a replaced secret keeps signing beside the new one
SECRET_RULE = re.compile(r"whsec_[A-Za-z0-9+/]+={0,2}")

N = TypeVar("N", int, float)  # a keyring's time: seconds or milliseconds, as its owner counts


def check_url(url: object, allow_remote: bool) -> urllib.parse.SplitResult:
    """Parse a sink URL; refuse anything but http(s), and non-loopback hosts unless allowed."""
    if type(url) is not str:
        raise ValueError(f"url must be a str: {url!r}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be http(s)://HOST[:PORT]/PATH: {url!r}")
    try:
        port = parts.port
    except ValueError:  # not a number, or over 65535
        port = 0
    if port == 0:
        raise ValueError(f"url port must be a number in 1..65535: {url!r}")
    if not allow_remote and not is_loopback(parts.hostname):
        raise ValueError(f"refusing non-loopback sink {parts.hostname!r} (pass allow_remote=True)")
    return parts


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BadSecret(ValueError):
    """Raised for a secret that is not ``whsec_`` + base64 of 24-64 bytes (its text is
    never repeated)."""


def parse_secret(text: object) -> bytes:
    """The key bytes of a ``whsec_`` secret."""
    if type(text) is not str or not SECRET_RULE.fullmatch(text):
        raise BadSecret("a webhook secret must be 'whsec_' followed by base64")
    encoded = text[len(PREFIX) :]
    if "=" not in encoded:  # unpadded base64, as the official libraries take it too
        encoded += "=" * (-len(encoded) % 4)
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise BadSecret("a webhook secret must be 'whsec_' followed by base64") from None
    if not 24 <= len(key) <= 64:
        raise BadSecret(f"a webhook secret must hold 24-64 bytes, not {len(key)}")
    return key


def fingerprint(secret: object) -> str:
    """What may be shown of a secret: the first 8 hex digits of its key's SHA-256."""
    return hashlib.sha256(parse_secret(secret)).hexdigest()[:8]


def rotated(
    entries: Iterable[tuple[str, N | None]], secret: str, now: N, overlap: N
) -> tuple[tuple[str, N | None], ...]:
    """A keyring's entries after a rotation at ``now``: ``secret`` signs from now; the
    current ones keep signing beside it until ``now + overlap``; ones already retired keep
    their end, and those past it are dropped (as is ``secret`` itself, if it was there)."""
    parse_secret(secret)
    ring: list[tuple[str, N | None]] = [(secret, None)]
    for old, until in entries:
        if (until is None or until > now) and old != secret:
            ring.append((old, now + overlap if until is None else until))
    return tuple(ring)
