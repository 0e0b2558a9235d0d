"""The asyncio face: :class:`AsyncLedger` and :class:`AsyncSession` (written in
``ledger/_async/client.py``, the source of the sync face)."""

from ledger._async.client import AsyncLedger, AsyncSession

__all__ = ["AsyncLedger", "AsyncSession"]
