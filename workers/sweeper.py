"""Reservation expiry: release every lease whose Redis-clock deadline has passed.

Each partition keeps a sorted set of reservation deadlines, written by the same
script that opens the reservation, so no expiry can be lost to a crash. A sweep
reads the due members of each partition (no scan of session keys) and calls
``expire.lua`` per session, which checks the deadline again on Redis's clock.
"""

from __future__ import annotations

import signal
import threading
import time

from rich.console import Console

from ledger.client import Ledger
from ledger.errors import BackendUnavailable
from ledger.settings import LedgerSettings


def sweep_once(ledger: Ledger) -> int:
    """One pass over every partition; returns how many reservations were released."""
    return sum(ledger.expire_due(p) for p in range(ledger.keyspace.partitions))


def run_forever(
    settings: LedgerSettings,
    interval: float = 1.0,
    once: bool = False,
    console: Console | None = None,
) -> int:
    """Sweep every `interval` seconds until SIGTERM or SIGINT; returns an exit code."""
    out = console or Console(stderr=True)
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    with Ledger.from_settings(settings) as ledger:
        out.print(
            f"ledger worker: sweeping {ledger.keyspace.partitions} partitions of prefix "
            f"{settings.prefix!r} every {interval}s"
        )
        while True:
            t0 = time.monotonic()
            try:
                released = sweep_once(ledger)
                if released:
                    out.print(f"released {released} expired reservation(s)")
            except BackendUnavailable as exc:
                out.print(f"redis unavailable, retrying: {exc}")
            if once or stop.wait(max(0.0, interval - (time.monotonic() - t0))):
                break
    out.print("ledger worker: stopped")
    return 0
