"""``python -m ledger.cli``: the ``ledger`` command."""

import sys

from ledger.cli import main

sys.exit(main())
