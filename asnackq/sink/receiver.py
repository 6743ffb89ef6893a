"""Receiving webhooks in an aiohttp application: each delivery's Standard Webhooks signature
verified, and each ``webhook-id``'s effect applied once ever, inside the inbox's transaction
on the application's own connection (re-exported by ``asnackq.http_sink``).

Rules of this module:

* ``await WebhookReceiver.within(con, secrets, effect)`` creates the inbox's table
  (``asnackq_webhook_inbox``) on ``con`` if absent; ``receiver.handle`` is the route's
  handler.  ``effect(con, webhook_id, payload)`` runs on ``con`` inside the transaction that
  writes the id's inbox row (``asnackq.store.effects``): both commit, or neither.
* Checks, in order, before any transaction; each refusal is a one-line JSON answer
  (``{"status", "error"}``) and one log line, and applies nothing: ``413`` a body over
  ``max_body`` (declared or read), ``415`` not ``application/json``, ``408`` a body late,
  ``400`` a body cut off, ``401`` a signature, timestamp or id that does not hold
  (``asnackq.sink.checks``; its reason, never a secret), ``400`` a bad token header or a
  body that is not strict JSON (``asnackq.wire.strict_json``).
* Then one transaction (``batch_max`` over 1: shared with the deliveries waiting at that
  moment, each decided as if alone: ``asnackq.sink.inbox``): ``200 {"id", "status":
  "applied"}``; ``200 {"id", "status": "duplicate"}`` (the same id and body again: no
  effect, counted); ``409`` the same id with another body (a SHA-256 of its bytes;
  nothing changes); ``500`` the effect raised (rolled back: the sender sends it again;
  the log names the exception's type, never its text, which may hold whatever the effect
  touched); ``422`` the effect refused the payload (``Rejected``: its reason is the
  application's to show; rolled back, nothing recorded, a sender gives up); ``503`` the
  database could not commit.
* This is the sink wing's one module that imports aiohttp at import time; the command line
  imports it only when it serves.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Generic, TypeVar

from aiohttp import web

from asnackq.core.inbox import MAX_BATCH, WEBHOOK_SCHEMA, Arrival, plan_receive
from asnackq.core.worker import check_callable, check_int, epoch_ms
from asnackq.sink.checks import Signatures, Unverified, check_token_header
from asnackq.sink.inbox import Delivery, GroupCommit, SinkUnavailable
from asnackq.store import effects
from asnackq.store.targets import one_line
from asnackq.wire import strict_json
from asnackq.wire.send import TOKEN_HEADER, check_number
from asnackq.wire.webhooks import TOLERANCE_S

__all__ = [
    "COUNTERS",
    "LOG",
    "MAX_BODY",
    "Effect",
    "Rejected",
    "WebhookReceiver",
    "as_json",
    "expect_continue",
    "read_within",
]

LOG = logging.getLogger("asnackq.sink")  # one line each, never a traceback
MAX_BODY = 256 * 1024  # the default body limit; at most MAX_BODY_LIMIT
MAX_BODY_LIMIT = 1024 * 1024
COUNTERS = ("applied", "duplicates", "conflicts", "refused", "rejected", "failed", "unavailable")
C = TypeVar("C")
Effect = Callable[[C, str, Any], Awaitable[None]]  # (connection, webhook-id, payload)


class Rejected(Exception):
    """Raised by an application's effect for a payload it will never apply: the transaction
    rolls back and the delivery is answered ``422`` with ``reason`` (shown to the sender)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def as_json(request: web.BaseRequest, refusal: web.HTTPException) -> web.HTTPException:
    """A refusal with its reason as a JSON body, logged as one line."""
    detail = refusal.text or ""
    LOG.info(
        "%s %s %s from %s: %s",
        refusal.status,
        request.method,
        request.path[:80],
        request.remote,
        detail,
    )
    refusal.text = json.dumps({"status": (refusal.reason or "").lower(), "error": detail[:200]})
    refusal.content_type = "application/json"
    return refusal


class WebhookReceiver(Generic[C]):
    """An aiohttp handler (``handle``) applying each verified webhook's effect once ever.

    ``counts`` holds what it answered: applied, duplicates, conflicts, refused (a 4xx
    before the transaction), rejected (the effect's ``Rejected``), failed (the effect
    raised) and unavailable (the database could not commit)."""

    def __init__(
        self,
        con: C,
        signatures: Signatures,
        effect: Effect[C],
        max_body: int,
        body_timeout_s: float,
        batch_max: int = 1,
    ) -> None:
        self.con, self.signatures, self.effect = con, signatures, effect
        self.max_body, self.body_timeout_s = max_body, body_timeout_s
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.inbox = GroupCommit(self._run, batch_max)

    @classmethod
    async def within(
        cls,
        con: C,
        secrets: Sequence[str],
        effect: Effect[C],
        *,
        tolerance_s: float = TOLERANCE_S,
        max_body: int = MAX_BODY,
        body_timeout_s: float = 10.0,
        batch_max: int = 1,
    ) -> WebhookReceiver[C]:
        """A receiver on the application's aiosqlite or psycopg async connection ``con``,
        verifying with the ``whsec_`` ``secrets`` (several: a rotation), its inbox's table
        created if absent; every argument is checked first (``ValueError``).  With
        ``batch_max`` over 1, concurrent deliveries are group-committed, up to that many in
        one transaction (``asnackq.sink.inbox``)."""
        effects.check_connection(con)
        signatures = Signatures.of(secrets, tolerance_s)
        check_callable(effect, "effect")
        if type(max_body) is not int or not 1 <= max_body <= MAX_BODY_LIMIT:
            raise ValueError(f"max_body must be an int in 1..{MAX_BODY_LIMIT} (bytes)")
        check_number(body_timeout_s, "body_timeout_s", 0, 600, open_low=True)
        check_int(batch_max, "batch_max", 1, MAX_BATCH)
        await effects.prepare(con, WEBHOOK_SCHEMA)
        return cls(con, signatures, effect, max_body, body_timeout_s, batch_max)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """``POST``: verify, apply once, answer (see the module's rules)."""
        try:
            event_id, body, token = await self._admit(request)
            payload = strict_json.loads(body)
        except ValueError as error:  # (strict_json's refusals and the token header's)
            self.counts["refused"] += 1
            raise as_json(request, web.HTTPBadRequest(text=str(error))) from None
        except web.HTTPException as refusal:
            self.counts["refused"] += 1
            if not request.content.is_eof():  # (refused before the body was whole)
                spoil(request, refusal)
            raise as_json(request, refusal) from None
        digest = hashlib.sha256(body).hexdigest()
        return await self._apply(request, event_id, digest, token, payload)

    async def _admit(self, request: web.Request) -> tuple[str, bytes, int | None]:
        """The delivery's id, body and token, or the refusal it deserves."""
        declared = request.content_length
        if declared is not None and declared > self.max_body:
            raise too_large(self.max_body)
        if request.content_type != "application/json":
            raise web.HTTPUnsupportedMediaType(text="the body must be application/json")
        body = await self._body(request)
        try:
            event_id = self.signatures.check(request.headers, body)
        except Unverified as error:
            raise web.HTTPUnauthorized(text=error.reason) from None
        return event_id, body, check_token_header(request.headers.get(TOKEN_HEADER))

    async def _body(self, request: web.Request) -> bytes:
        """The whole body, at most ``max_body`` bytes, within ``body_timeout_s``."""

        async def bounded() -> bytes:
            data = bytearray()
            while chunk := await request.content.read(self.max_body + 1 - len(data)):
                data += chunk
                if len(data) > self.max_body:
                    raise too_large(self.max_body)
            return bytes(data)

        return await read_within(request, bounded, self.body_timeout_s)

    async def _apply(
        self, request: web.Request, event_id: str, digest: str, token: int | None, payload: Any
    ) -> web.StreamResponse:
        try:
            status = await self.inbox.submit(Arrival(event_id, digest, token), payload)
        except effects.EffectFailed as error:
            if isinstance(error.__cause__, Rejected):
                self.counts["rejected"] += 1
                return rejected(request, event_id, error.__cause__.reason)
            self.counts["failed"] += 1
            return failed(request, event_id, error)
        except SinkUnavailable as error:  # the database: busy, away, full, or a connection misused
            self.counts["unavailable"] += 1
            return unavailable(request, event_id, error)
        self.counts[{"applied": "applied", "duplicate": "duplicates"}.get(status, "conflicts")] += 1
        return web.json_response(
            {"id": event_id, "status": status}, status=409 if status == "conflict" else 200
        )

    async def _run(self, batch: list[Delivery]) -> list[str]:
        """One batch in one transaction on the application's connection."""

        async def effect_at(index: int) -> None:
            await self.effect(self.con, batch[index].arrival.event_id, batch[index].payload)

        make = partial(plan_receive, [d.arrival for d in batch], epoch_ms())
        return await effects.receive(self.con, make, effect_at)

    async def close(self) -> None:
        """Return once every delivery in hand has been answered (with ``batch_max`` > 1)."""
        await self.inbox.close()


async def read_within(
    request: web.BaseRequest, read: Callable[[], Awaitable[bytes]], timeout_s: float | None
) -> bytes:
    """``read()``'s body within ``timeout_s`` (None: no bound); a body that cannot be had is
    a 408 or 400 that closes the connection.  It spoils the rest: the body is marked ended,
    so that aiohttp does not drain it after the answer (nor log its error a second time)."""
    try:
        if timeout_s is None:  # (a body already in: no timer to set and cancel)
            return await read()
        async with asyncio.timeout(timeout_s):
            return await read()
    except TimeoutError:
        refusal: web.HTTPException = web.HTTPRequestTimeout(
            text=f"the body did not arrive within {timeout_s:g} s"
        )
    except (web.RequestPayloadError, ConnectionError) as error:  # bad framing, hang-up
        refusal = web.HTTPBadRequest(text=f"the body cannot be read: {one_line(error)}")
    spoil(request, refusal)
    raise refusal


def spoil(request: web.BaseRequest, refusal: web.HTTPException) -> None:
    """The rest of ``request``'s body is never read: ``refusal`` is the connection's last
    answer, aiohttp parses nothing more that arrives on it, and the body is marked ended, so
    that it is not drained after the answer (aiohttp's lingering read, which on a server that
    inflates bodies itself - its default - inflates a compressed rest on the event loop: a
    gzip bomb's gigabytes)."""
    request.protocol.close()  # (first: no byte is parsed into the body once it is ended)
    request.content.feed_eof()
    refusal.force_close()


async def expect_continue(request: web.Request) -> None:
    """An ``expect_handler`` for the receiver's route (``router.add_post(path, handler,
    expect_handler=expect_continue)``): ``100-continue`` as aiohttp's own, any other
    ``Expect`` a one-line JSON ``417``.  aiohttp's own echoes the header into its answer: a
    byte that is not UTF-8 made that a ``500`` and a traceback in the application's log."""
    expect = request.headers.get("Expect", "")
    if expect.lower() != "100-continue":
        refusal = web.HTTPExpectationFailed(text="only 'Expect: 100-continue' is understood")
        refusal.force_close()  # (its body, if any, is never read)
        raise as_json(request, refusal)
    if request.version == (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # (as aiohttp's: the answer has not begun)


def too_large(limit: int) -> web.HTTPException:
    return web.HTTPRequestEntityTooLarge(limit, limit + 1, text=f"the body is over {limit} bytes")


def rejected(request: web.Request, event_id: str, reason: str) -> web.Response:
    """422: the effect refused the payload; rolled back, nothing recorded."""
    shown = " ".join(str(reason).split())[:200]
    LOG.info("422 %s %s: %s: %s", request.method, request.path[:80], event_id, shown)
    return web.json_response({"id": event_id, "status": "rejected", "error": shown}, status=422)


def failed(request: web.Request, event_id: str, error: effects.EffectFailed) -> web.Response:
    """500: the effect raised, nothing was applied; logged with the exception's type only."""
    kind = type(error.__cause__).__name__
    LOG.error(
        "500 %s %s: the effect of %s raised %s: nothing applied",
        request.method,
        request.path[:80],
        event_id,
        kind,
        extra={"event": "effect_failed", "fields": {"id": event_id, "error": kind}},
    )
    return web.json_response(
        {"id": event_id, "status": "failed", "error": "the effect failed: nothing was applied"},
        status=500,
    )


def unavailable(request: web.Request, event_id: str, error: Exception) -> web.Response:
    """503: the inbox's transaction could not commit, nothing was applied."""
    LOG.warning(
        "503 %s %s: the inbox of %s cannot commit: %s",
        request.method,
        request.path[:80],
        event_id,
        one_line(error),
        extra={"event": "db_down"},
    )
    return web.json_response(
        {"id": event_id, "status": "unavailable", "error": "the inbox cannot commit now"},
        status=503,
    )
