"""JSON from outside (a sink's request body, a sender's ACK, a line of ``enqueue``), read
one way everywhere: strictly, so that no two readers can see different values.

Rules of this module:

* Bytes are UTF-8 with no byte-order mark; UTF-16, UTF-32 and a BOM are refused (the
  standard library would guess the encoding and take them).
* An object with a key given twice is refused: a reader that keeps the first value (a
  proxy, a validator) and one that keeps the last would act on different events.
* ``NaN`` and ``Infinity`` are refused (not JSON), and so is an integer of more than
  ``MAX_DIGITS`` digits (no value asnackq takes is that long; the standard library would
  spend quadratic time on it, or refuse it with advice about ``sys``).
* Every refusal is a ``ValueError`` with a one-line reason; deep nesting included.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DIGITS", "loads"]

MAX_DIGITS = 30


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"ambiguous JSON: the key {key[:40]!r} appears more than once")
        result[key] = value
    return result


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"a JSON number of {len(text)} digits is out of range")
    return int(text)


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(data: bytes | str) -> Any:
    """The JSON value in ``data``; ``ValueError`` (one line) for anything ambiguous or not JSON."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"JSON must be UTF-8: {error}") from None
    if data.startswith("\ufeff"):
        raise ValueError("JSON must not start with a byte-order mark")
    try:
        return json.loads(
            data, object_pairs_hook=_object, parse_int=_integer, parse_constant=_constant
        )
    except RecursionError:
        raise ValueError("nested too deeply") from None
