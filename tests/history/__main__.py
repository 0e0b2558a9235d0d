"""``python -m tests.history --seed N [--long] [--failover]``: one history run, checked."""

import sys

from tests.history.run import main

sys.exit(main())
