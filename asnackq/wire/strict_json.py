"""JSON from outside (a sink's request body, a sender's ACK, a line of ``enqueue``), read
one way everywhere: strictly, so that no two readers can see different values.

Rules of this module:

* Bytes are UTF-8 with no byte-order mark; UTF-16, UTF-32 and a BOM are refused (the
  standard library would guess the encoding and take them).
* An object with a key given twice is refused: a reader that keeps the first value (a
  proxy, a validator) and one that keeps the last would act on different events.
* ``NaN`` and ``Infinity`` are refused (not JSON), and so is a number a double cannot hold
  (``1e999``: the standard library would read it as infinity), and an integer of more than
  ``MAX_DIGITS`` digits (no value asnackq takes is that long; the standard library would
  spend quadratic time on it, or refuse it with advice about ``sys``).
* A string holding an unpaired surrogate escape (``"\\ud800"``) is refused: it is not
  Unicode text, and no UTF-8 writer (a database, a log) could store it.
* Every refusal is a ``ValueError`` with a one-line reason; deep nesting included.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from asnackq.core.events import MAX_DIGITS, encodes_utf8  # (what an event's data may hold)

__all__ = ["MAX_DIGITS", "loads"]

SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # (a pair is one character once read)


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


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the JSON number {text[:40]} is out of a double's range")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unpaired(value: Any) -> bool:
    """Whether a string in ``value`` (a key or a value) holds an unpaired surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and not item.isascii() and not encodes_utf8(item):
            return True
    return False


def loads(data: bytes | str) -> Any:
    """The JSON value in ``data``; ``ValueError`` (one line) for anything ambiguous or not JSON."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"JSON must be UTF-8: {error}") from None
    elif not data.isascii() and not encodes_utf8(data):  # (argv's undecodable bytes, say)
        raise ValueError("JSON must be UTF-8: it holds a character no UTF-8 can carry")
    if data.startswith("\ufeff"):
        raise ValueError("JSON must not start with a byte-order mark")
    try:
        value = json.loads(
            data,
            object_pairs_hook=_object,
            parse_int=_integer,
            parse_float=_float,
            parse_constant=_constant,
        )
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if SURROGATE_ESCAPE.search(data) and _unpaired(value):  # (a walk only when one may be)
        raise ValueError("a JSON string holds an unpaired surrogate (\\ud800-\\udfff): not text")
    return value
