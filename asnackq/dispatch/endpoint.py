"""A run's send to one named endpoint of its queue, kept in step with the endpoint's row.

Rules of this module:

* The endpoint's row (``asnackq.core.endpoints``) says where and how to send: its URL,
  success rule, timeout, headers, keyring, and the networks the address guard lets it reach
  beside the worker's own allow-list (a worker run with ``allow_remote`` only). It is read
  again at most every ``refresh_s`` before a send: a rotated secret signs from the next
  send on; a changed URL, rule, timeout, header set or allow-list gets a sender of its own
  (the two before it stay open for the sends in flight; an older one is closed: a send
  still in flight on it ends without an answer, and is sent again, no attempt spent).
* A disabled endpoint is sent nothing: a send finds it disabled and raises ``Disabled``, an
  ``Unavailable`` - no request, no attempt spent, the run pauses (its breaker) and its
  probes find the endpoint again once it is enabled.
* ``410 Gone`` disables the endpoint, its reason ``gone: answered 410``, in a transaction
  of its own (outside any send), and the send raises as the answer means (``Gone``, an
  ``Unavailable``): the jobs wait, spending nothing, until an operator enables it.
* An endpoint removed while the run goes on is treated as disabled.
* A row changed to what this worker refuses to send to (a URL its address guard refuses, an
  http:// URL with its TLS files, ...) is treated as disabled until the row changes again:
  nothing is sent, neither there nor to the URL before.
* With ``payload`` (a worker in the endpoint's lane: ``asnackq.core.lanes``) each job is a
  delivery: its event's stored body is sent, the event's id its ``webhook-id`` (the same
  for every endpoint and attempt), the job's token in its header; a job that is no
  delivery is refused (``Permanent``), never sent as ``{id, qty}``.  Without it each job
  is sent as the contract's ``{id, qty}``.
* While the queue's database is away (``StoreUnavailable``) the run sends as the row last
  read says and reads it again after ``refresh_s``, as a sink's run sends on through an
  outage: a send never fails for the row's read (nor a 410 for its disabling, tried again
  at the next 410), so no job is abandoned as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from asnackq.core import worker as w
from asnackq.core.endpoints import Endpoint, NoSuchEndpoint
from asnackq.store.outage import StoreUnavailable
from asnackq.wire.send import AsyncHttpSender, Gone
from asnackq.wire.webhooks import Keyring

__all__ = ["GONE_REASON", "REFRESH_S", "Disabled", "EndpointSend"]

Payload = Callable[[str], Awaitable[tuple[str, bytes] | None]]
REFRESH_S = 1.0
KEPT_SENDERS = 3  # the current sender and the two it replaced last
GONE_REASON = "gone: answered 410"


class Disabled(w.Unavailable):
    """Raised instead of a request while the endpoint is disabled (or removed): nothing is
    sent and no attempt is spent."""


class EndpointSend:
    """``await send(event, token)`` to the endpoint ``name``, as its row says now.

    ``read()`` returns the endpoint's row (``NoSuchEndpoint`` when it is gone) and
    ``disable(reason)`` disables it, each a transaction of the queue's
    (``AsyncQueue.endpoint``, ``AsyncQueue.disable_endpoint``); ``payload(job_id)``, if
    given, a delivery's event id and body (``AsyncQueue.delivery``). ``sender_options`` go to
    each ``AsyncHttpSender`` (``allow_remote``, ``allow_networks``, TLS files, ``limit``).
    Use as ``async with EndpointSend(...) as send``.
    """

    def __init__(
        self,
        name: str,
        read: Callable[[], Awaitable[Endpoint]],
        disable: Callable[[str], Awaitable[bool]],
        *,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
        payload: Payload | None = None,
        **sender_options: Any,
    ) -> None:
        self.name, self.read, self.disable, self.payload = name, read, disable, payload
        self.refresh_s, self.clock, self.options = refresh_s, clock, sender_options
        self.endpoint: Endpoint | None = None  # the row as last read (None: removed)
        self.sender: AsyncHttpSender | None = None
        self.refused = ""  # why this worker cannot send as the row says ("": it can)
        self.senders: list[AsyncHttpSender] = []  # every one opened, closed at the end
        self.read_at = -float("inf")
        self.lock = asyncio.Lock()  # one read of the row at a time

    @property
    def timeout_s(self) -> float | None:
        """The endpoint's timeout as last read (said by a run's "started" line)."""
        return None if self.endpoint is None else self.endpoint.timeout_s

    async def __aenter__(self) -> EndpointSend:
        await self._refresh(force=True)
        if self.endpoint is None:
            raise NoSuchEndpoint(f"no endpoint {self.name!r}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for sender in self.senders:
            await sender.__aexit__(None, None, None)
        self.senders.clear()

    async def __call__(self, event: dict[str, Any], token: int | None = None) -> object:
        await self._refresh()
        endpoint, sender = self.endpoint, self.sender
        if endpoint is None or endpoint.state != "enabled" or sender is None:
            why = "removed" if endpoint is None else f"disabled ({endpoint.disabled_reason})"
            if endpoint is not None and endpoint.state == "enabled":
                why = f"refused by this worker ({self.refused})"
            raise Disabled(f"endpoint {self.name!r} is {why}: nothing sent")
        try:
            if self.payload is None:
                return await sender(event, token)
            return await sender.post(*await self._delivery(event), token)
        except Gone:
            await self._gone()
            raise

    async def _delivery(self, event: dict[str, Any]) -> tuple[str, bytes]:
        """The event id and body of the delivery ``event`` names."""
        assert self.payload is not None
        job_id = w.check_event(event)[0]
        found = await self.payload(job_id)
        if found is None:
            raise w.Permanent(f"job {job_id!r} is no delivery: nothing sent to {self.name!r}")
        return found

    async def _gone(self) -> None:
        """Disable the endpoint (once, whoever met the 410 first) and forget the row read."""
        async with self.lock:
            if self.endpoint is not None and self.endpoint.state == "enabled":
                with contextlib.suppress(StoreUnavailable):  # (away: the next 410 disables it)
                    await self.disable(GONE_REASON)
            self.read_at = -float("inf")  # the next send reads the row again

    async def _refresh(self, force: bool = False) -> None:
        if not force and self.clock() - self.read_at < self.refresh_s:
            return
        async with self.lock:
            if not force and self.clock() - self.read_at < self.refresh_s:
                return  # (read meanwhile by another coroutine)
            try:
                fresh: Endpoint | None = await self.read()
            except NoSuchEndpoint:
                fresh = None
            except StoreUnavailable:
                if force:
                    raise
                self.read_at = self.clock()  # the row as last read, until the next read
                return
            self.read_at = self.clock()
            if fresh is not None and (self.endpoint is None or how(fresh) != how(self.endpoint)):
                try:
                    await self._open(fresh)
                except ValueError as error:
                    if force:
                        raise
                    self.sender, self.refused = None, str(error)  # (the one before: not there)
            elif fresh is not None and self.sender is not None:
                self.sender.keyring = keyring(fresh)  # a rotation: from the next send on
            self.endpoint = fresh

    async def _open(self, endpoint: Endpoint) -> None:
        options = dict(self.options)
        if endpoint.allow_networks and options.get("allow_remote"):  # the worker's and its own
            worker = tuple(options.get("allow_networks", ()))
            options["allow_networks"] = worker + endpoint.allow_networks
        sender = AsyncHttpSender(
            endpoint.url,
            timeout_s=endpoint.timeout_s,
            success=endpoint.success,
            secrets=keyring(endpoint),
            headers=endpoint.headers,
            **options,
        )
        await sender.__aenter__()
        self.senders.append(sender)
        self.sender = sender
        if len(self.senders) > KEPT_SENDERS:  # a sender replaced twice since has no sends left
            await self.senders.pop(0).__aexit__(None, None, None)


def keyring(endpoint: Endpoint) -> Keyring | None:
    """The endpoint's secrets as a sender's keyring (None: it signs nothing)."""
    return Keyring.of_ms(endpoint.secrets) if endpoint.secrets else None


def how(endpoint: Endpoint) -> tuple[object, ...]:
    """What a sender is made with, but for the keyring (which a sender takes as it is)."""
    return (
        endpoint.url,
        endpoint.timeout_s,
        endpoint.success,
        endpoint.headers,
        endpoint.allow_networks,
    )
