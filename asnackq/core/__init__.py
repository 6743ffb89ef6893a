"""The I/O-free state machine of asnackq and its sqlite3 driver (``worker.py``)."""
