"""What the ``ledger`` commands share: the exit codes, the settings a command line
names, and the age of a timestamp as the views print it."""

from __future__ import annotations

import argparse

from ledger.settings import LedgerSettings, require_url

EXIT_OK, EXIT_VIOLATION, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


def _settings(args: argparse.Namespace) -> LedgerSettings:
    overrides: dict[str, str] = {}
    if args.url:
        overrides["redis_url"] = args.url
    if args.prefix:
        overrides["prefix"] = args.prefix
    return LedgerSettings(**overrides)


def _embedded(settings: LedgerSettings) -> bool:
    from ledger.backends import parse_url

    return parse_url(require_url(settings)).kind == "embedded"


def _age(ms: int) -> str:
    s = max(ms, 0) // 1000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"
