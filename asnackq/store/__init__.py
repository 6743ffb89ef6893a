"""Reaching a database: the drivers that run the core's plans, and the places they run.

Rules of this wing:

* A driver runs a plan whole inside one transaction and never decides anything itself:
  the sqlite3 driver is the core's, ``sqlite_aio`` runs plans through aiosqlite, ``pg``
  through psycopg (sync and async) with the texts of ``pg_sql`` keyed to the core's.
* One connection and one lock per store in async code: two coroutines' transactions never
  interleave, and a cancelled caller never splits a write.  Concurrent ``enqueue`` calls
  share one transaction, each judged as if alone (``intakes``).
* A target is a path or a ``postgresql://`` URL (``targets``); a writer never converts a
  file that belongs to someone else (``files``); readers never write (``readers``).
* Imports: ``asnackq.core`` only.
"""

from asnackq.store.outage import CommitUnknown, StoreUnavailable

__all__ = ["CommitUnknown", "StoreUnavailable"]
