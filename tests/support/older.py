"""A client as protocol 1 clients from before the reclaim-order index speak: the same calls,
without the optional key `<tag>:order:<session id>` (docs/protocol.md#the-reclaim-order-index)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ledger import Ledger
from ledger.protocol import Call


class OldClient(Ledger):
    """A :class:`Ledger` whose calls leave out the reclaim-order index."""

    def check_call(self, call: object) -> Call[Any]:
        checked = super().check_call(call)
        keys = tuple(k for k in checked.keys if ":order:" not in k)
        return dataclasses.replace(checked, keys=keys)

    def check_batch(self, calls: Any) -> list[Call[Any]]:
        return [self.check_call(c) for c in super().check_batch(calls)]
