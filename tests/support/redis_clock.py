"""Redis's clock, as the scripts read it (``TIME``): the tests of deadlines and leases
(tests/test_child_pools.py, tests/test_reset_staged.py, tests/test_worker_once.py) wait
on it rather than on this process's clock."""

from __future__ import annotations

import time

from ledger import Ledger


def redis_ms(led: Ledger) -> int:
    """Redis's clock now, in ms."""
    sec, usec = led.client.time()
    return int(sec) * 1000 + int(usec) // 1000


def until_past(led: Ledger, ms: int) -> None:
    """Wait (polling Redis's clock, at most 10 s) until Redis's clock is past ``ms``."""
    deadline = time.monotonic() + 10
    while redis_ms(led) <= ms:
        assert time.monotonic() < deadline
        time.sleep(0.01)
