"""Standard Webhooks (v1.0.0) signatures: sign a delivery, verify one, and keep secrets.

Rules (one place for the sender and every receiver):

* A secret is ``whsec_`` + base64 of 24-64 random bytes; anything else is ``BadSecret``,
  whose message never contains the text it was given (the form, and a keyring's rotation
  rule, are ``asnackq.core.receivers``', shared with the endpoints).
* A signed request carries ``webhook-id`` (the delivery's id, the same on every attempt),
  ``webhook-timestamp`` (Unix seconds, when this attempt was signed) and
  ``webhook-signature``: space-separated ``v1,<base64 HMAC-SHA256 of id.timestamp.body>``,
  one entry per active secret, so a receiver keeps verifying while secrets rotate.
* A receiver accepts a request when some ``v1`` entry matches some key it holds
  (compared in constant time), the timestamp is within ``tolerance_s`` of its clock (either
  way), and the headers are within bounds: an id of 1-256 visible ASCII characters, a
  timestamp of at most 12 digits, at most ``MAX_SIGNATURES`` entries in at most
  ``MAX_SIGNATURE_HEADER`` characters. Anything else is ``Unverified`` with a one-line
  reason. Entries of other versions (``v1a``, ed25519) are skipped, as the specification
  asks, yet they count towards the bound.
* A ``Keyring`` is an endpoint's secrets over time: the newest signs, and a secret it
  replaced keeps signing beside it until its ``until`` (by default 24 h after the rotation).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import re
import secrets as random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from asnackq.core.receivers import PREFIX, ROTATION_S, BadSecret, parse_secret, rotated

__all__ = [
    "ID_HEADER",
    "MAX_SECRETS",
    "MAX_SIGNATURES",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "TOLERANCE_S",
    "BadSecret",
    "Keyring",
    "Unverified",
    "new_secret",
    "parse_secret",
    "read_secrets",
    "sign",
    "signed_headers",
    "verify",
]

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
TOLERANCE_S = 300  # the specification's five minutes, either way
MAX_SIGNATURES = 16  # more entries in one header are refused, not searched
MAX_SIGNATURE_HEADER = 2048
MAX_SECRETS = 16  # secrets an endpoint signs or verifies with, at most
MAX_SECRETS_FILE = 64 * 1024  # bytes
ID_RULE = re.compile(r"[!-~]{1,256}")
TIMESTAMP_RULE = re.compile(r"[0-9]{1,12}")


class Unverified(Exception):
    """Raised by ``verify`` when a request's signature headers do not prove it came from a
    holder of a key: ``reason`` says which check failed, in one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_secrets(path: Path | str) -> tuple[str, ...]:
    """The secrets of a file: one ``whsec_`` secret a line, blank lines and ``#`` comments
    skipped; a file that cannot be read or holds anything else is one ``ValueError`` line
    naming the line, never its text."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_SECRETS_FILE + 1)
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror or error}") from None
    if len(data) > MAX_SECRETS_FILE:
        raise ValueError(f"{path} is over {MAX_SECRETS_FILE // 1024} KiB: not a secrets file")
    try:
        lines = data.decode("ascii").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not ASCII text: not a secrets file") from None
    secrets = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            parse_secret(text)
        except BadSecret as error:
            raise ValueError(f"{path}, line {number}: {error}") from None
        secrets.append(text)
    if not 1 <= len(secrets) <= MAX_SECRETS:
        raise ValueError(f"{path} holds {len(secrets)} secrets: give 1-{MAX_SECRETS}")
    return tuple(secrets)


def new_secret(size: int = 32) -> str:
    """A fresh random secret in ``whsec_`` form."""
    return PREFIX + base64.b64encode(random.token_bytes(size)).decode()


def _digest(key: bytes, msg_id: str, timestamp: str, body: bytes) -> str:
    mac = _keyed(key).copy()  # (a keyed HMAC's copy costs less than keying a new one)
    mac.update(b"%s.%s." % (msg_id.encode(), timestamp.encode()))
    mac.update(body)
    return base64.b64encode(mac.digest()).decode()


@functools.lru_cache(maxsize=1024)
def _keyed(key: bytes) -> hmac.HMAC:
    """An HMAC-SHA256 keyed with ``key``, fed nothing: each signature continues a copy."""
    return hmac.new(key, digestmod=hashlib.sha256)


def sign(keys: Iterable[bytes], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: one ``v1`` entry per key."""
    stamp = str(timestamp)
    return " ".join(f"v1,{_digest(key, msg_id, stamp, body)}" for key in keys)


def signed_headers(
    keys: Sequence[bytes], msg_id: str, body: bytes, now_s: float | None = None
) -> dict[str, str]:
    """The three Standard Webhooks headers for one attempt, signed at ``now_s``."""
    timestamp = int(time.time() if now_s is None else now_s)
    return {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: sign(keys, msg_id, timestamp, body),
    }


def verify(
    keys: Sequence[bytes],
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_s: float = TOLERANCE_S,
    now_s: float | None = None,
) -> str:
    """Return the request's ``webhook-id`` if its signature holds; raise ``Unverified``.

    ``headers`` is looked up by the lower-case names (aiohttp's and http.server's header
    mappings match any case)."""
    msg_id, stamp, listed = (
        headers.get(name) for name in (ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER)
    )
    if not msg_id or not stamp or not listed:
        raise Unverified(
            "the webhook-id, webhook-timestamp and webhook-signature headers are required"
        )
    if not ID_RULE.fullmatch(msg_id):
        raise Unverified("webhook-id must be 1-256 visible ASCII characters")
    if not TIMESTAMP_RULE.fullmatch(stamp):
        raise Unverified("webhook-timestamp must be Unix seconds")
    now = time.time() if now_s is None else now_s
    if abs(now - int(stamp)) > tolerance_s:
        side = "old" if int(stamp) < now else "far in the future"
        raise Unverified(f"webhook-timestamp is too {side} (tolerance {tolerance_s:g} s)")
    entries = listed.split(" ")
    if len(listed) > MAX_SIGNATURE_HEADER or len(entries) > MAX_SIGNATURES:
        raise Unverified(f"webhook-signature lists more than {MAX_SIGNATURES} signatures")
    given = [entry[3:].encode() for entry in entries if entry.startswith("v1,")]
    matched = 0
    for key in keys:  # every key against every entry: the time tells nothing of which matched
        expected = _digest(key, msg_id, stamp, body).encode()
        matched += sum(hmac.compare_digest(expected, entry) for entry in given)
    if not matched:
        raise Unverified("no webhook-signature entry matches a key")
    return msg_id


@dataclass(frozen=True)
class Keyring:
    """An endpoint's secrets over time: ``(secret, until)`` pairs, newest first; ``until``
    (Unix seconds) ends a replaced secret's signing, None for the current one."""

    entries: tuple[tuple[str, float | None], ...] = field(default=(), repr=False)

    def __repr__(self) -> str:  # (the secrets are never shown: how many, and until when)
        return f"Keyring({len(self.entries)} secrets, until {[u for _, u in self.entries]})"

    @classmethod
    def of(cls, *secrets: str) -> Keyring:
        """A keyring whose every secret signs until it is rotated out."""
        for secret in secrets:
            parse_secret(secret)
        return cls(tuple((secret, None) for secret in secrets))

    @classmethod
    def of_ms(cls, entries: Iterable[tuple[str, int | None]]) -> Keyring:
        """The keyring of an endpoint's secrets, whose ``until`` is in epoch milliseconds
        (``asnackq.core.endpoints``)."""
        return cls(tuple((secret, None if ms is None else ms / 1000) for secret, ms in entries))

    def rotate(self, secret: str, now_s: float, overlap_s: float = ROTATION_S) -> Keyring:
        """A new keyring: ``secret`` signs from now; the current ones keep signing beside
        it for ``overlap_s``; ones already retired and expired are dropped."""
        parse_secret(secret)
        if not 0 <= overlap_s <= 30 * 86_400:
            raise ValueError("a rotation's overlap must be 0-30 days")
        return Keyring(rotated(self.entries, secret, now_s, overlap_s))

    def keys(self, now_s: float | None = None) -> list[bytes]:
        """The keys that sign at ``now_s``."""
        now = time.time() if now_s is None else now_s
        return [_key(s) for s, until in self.entries if until is None or until > now]


_key = functools.lru_cache(maxsize=1024)(parse_secret)  # a keyring's secrets, read once
