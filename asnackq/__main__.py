"""``python -m asnackq``: the same as the ``asnackq`` command."""

import sys

from asnackq.cli import main

sys.exit(main())
