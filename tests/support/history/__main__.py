"""``python -m tests.support.history --seed N [--long] [--failover]``: one history run, checked."""

import sys

from tests.support.history.run import main

sys.exit(main())
