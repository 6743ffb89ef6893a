"""``python -m asnackq``: the same as the ``asnackq`` command."""

import sys

from asnackq.command import main

sys.exit(main())
