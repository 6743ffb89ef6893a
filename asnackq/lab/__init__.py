"""The fault and load lab: real processes, real faults, and a judge that reads the files.

Rules of this wing:

* The lab is a user of every other wing; nothing below it knows experiments exist.
* Every child process is started and stopped through ``procs``; every namespace and link
  the lab makes (``hosts``) is removed when it ends, also after SIGTERM or Ctrl-C.
* Verdicts come from the evidence alone (``evidence``): the queue, the inbox, the sinks'
  counters and the workers' traces.
* Imports: everything but ``asnackq.cli``.
"""

from asnackq.lab.config import LabConfig
from asnackq.lab.experiment import run_lab
from asnackq.lab.result import LabResult, report_rows

__all__ = ["LabConfig", "LabResult", "report_rows", "run_lab"]
