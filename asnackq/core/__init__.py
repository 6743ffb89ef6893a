"""The state machines: every transition as a plan (a generator of SQL steps and hook points).

Rules of this wing:

* Standard library only; nothing here does I/O but ``worker``'s own sqlite3 driver.
* ``worker.py`` is the contract: one file, loadable by path, its graded functions exact.
* ``outbox`` and ``inbox`` are the other two sets of plans (ordered delivery from an
  application's DB; each effect once at the sink). Drivers in ``asnackq.store`` run them all.
"""

VERSION = "0.4.0"  # the package's (``asnackq.__version__``), and its spans' instrumentation
