"""What a run tells: one ``Event`` for each change of its state, as a record of the
``asnackq.worker`` logger (a child of ``asnackq``) and to the application's listeners.

Rules of this module:

* An event's ``name`` and ``message`` are stable (a log query or an alert may match
  them); what varies is in ``fields``, which the log record carries as attributes of
  their own names (``extra``) and all together as ``record.fields``.
* The names, in a run's order: ``started``; ``paused`` (``cause``: ``away``, no sink
  there, or ``timing_out``, no answer within the sender's timeout), ``probing`` (the first
  probe of a pause), ``resumed``; ``db_down``, ``db_back``; ``rate`` (the shared rate set,
  changed or removed), ``limit`` (concurrency "auto" cut its limit); ``dead`` (jobs a
  transaction ended dead, by reason); ``clock_step``; ``stopping``; ``stopped`` (with the
  run's summary).  A run that ends always tells ``stopped``, last.
* A listener is called on the event loop, in order, and must not block; one that raises
  is logged once and dropped - the run goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["LOG", "Event", "EventStream", "Events", "Listener"]

LOG = logging.getLogger("asnackq.worker")


@dataclass(frozen=True)
class Event:
    """One change of a run's state."""

    name: str
    message: str
    level: int = logging.INFO
    fields: Mapping[str, object] = field(default_factory=dict)


Listener = Callable[[Event], object]


class Events:
    """Where a run's events go: its logger, and every listener."""

    def __init__(self, owner: str, logger: logging.Logger = LOG) -> None:
        self.owner, self.logger = owner, logger
        self.listeners: list[Listener] = []

    def emit(self, name: str, message: str, level: int = logging.INFO, **fields: object) -> None:
        event = Event(name, message, level, {"owner": self.owner, **fields})
        if self.logger.isEnabledFor(level):
            extra = {**event.fields, "event": name, "fields": event.fields}
            self.logger.log(level, message, extra=extra)
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:
                self.listeners.remove(listener)
                self.logger.exception("a listener of the run failed and was dropped")


class EventStream:
    """``async for event in dispatcher.events()``: every event from its creation on,
    ending after ``stopped``; created before the run starts, it sees the run's start."""

    def __init__(self, events: Events) -> None:
        self._events = events
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._ended = False
        events.listeners.append(self._queue.put_nowait)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        if self._ended:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event.name == "stopped":
            self._ended = True
            self.close()
        return event

    def close(self) -> None:
        """Stop listening (an iteration left early)."""
        if self._queue.put_nowait in self._events.listeners:
            self._events.listeners.remove(self._queue.put_nowait)
