"""What a receiver checks before it acts on a delivery, shared by the sink and the webhook
receiver (``asnackq.sink.receiver``): its Standard Webhooks signature, the fencing token
header, and the secrets an endpoint verifies with.

Rules of this module (no aiohttp: the command line reads a secrets file with it):

* Signatures are ``asnackq.wire.webhooks``'s: this module only holds the keys and the
  tolerance a receiver was given, and never shows a secret (not in a message, a repr or
  a log); a refusal is ``Unverified`` with a one-line reason.
* Several secrets are a rotation on the receiver's side: a delivery signed with any of
  them is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from asnackq.wire.send import TOKEN_HEADER
from asnackq.wire.webhooks import (
    MAX_SECRETS,
    TOLERANCE_S,
    BadSecret,
    Unverified,
    parse_secret,
    read_secrets,
    verify,
)

__all__ = [
    "MAX_SECRETS",
    "BadSecret",
    "Signatures",
    "Unverified",
    "check_token_header",
    "read_secrets",
]


@dataclass(frozen=True)
class Signatures:
    """The keys an endpoint verifies with and its tolerance for a delivery's timestamp."""

    keys: tuple[bytes, ...] = field(repr=False)
    tolerance_s: float = TOLERANCE_S

    @classmethod
    def of(cls, secrets: Sequence[str], tolerance_s: float = TOLERANCE_S) -> Signatures:
        """Keys from 1-16 ``whsec_`` secrets (``BadSecret``, a ``ValueError``, names the
        secret's position, never its text); a tolerance of 1 s to a day."""
        if isinstance(secrets, str) or not isinstance(secrets, Sequence):
            raise ValueError("secrets must be a list of 'whsec_' strings")
        if not 1 <= len(secrets) <= MAX_SECRETS:
            raise ValueError(f"give 1-{MAX_SECRETS} secrets, not {len(secrets)}")
        keys = []
        for number, secret in enumerate(secrets, 1):
            try:
                keys.append(parse_secret(secret))
            except BadSecret as error:
                raise BadSecret(f"secret {number}: {error}") from None
        if type(tolerance_s) not in (int, float) or not 1 <= tolerance_s <= 86_400:
            raise ValueError("tolerance_s must be a number of seconds in 1..86400")
        return cls(tuple(keys), float(tolerance_s))

    def check(self, headers: Mapping[str, str], body: bytes) -> str:
        """The delivery's ``webhook-id`` if its signature and timestamp hold; else
        ``Unverified`` with a one-line reason."""
        return verify(self.keys, headers, body, tolerance_s=self.tolerance_s)


def check_token_header(value: str | None) -> int | None:
    """The optional lease token header: digits only, 1..10**15 (``ValueError``)."""
    if value is None:
        return None
    digits = value.isascii() and value.isdigit() and len(value) <= 16  # (int() refuses 4300+)
    if not digits or not 1 <= int(value) <= 10**15:
        raise ValueError(f"{TOKEN_HEADER} must be an int in 1..10**15")
    return int(value)
