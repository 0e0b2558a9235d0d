"""The synchronous face: :class:`Ledger` and :class:`Session` (generated in
``ledger/_sync/client.py`` from ``ledger/_async/client.py``)."""

from ledger._sync.client import Ledger, Session

__all__ = ["Ledger", "Session"]
