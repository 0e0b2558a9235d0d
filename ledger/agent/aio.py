"""The agent layer's asyncio face: :class:`AsyncAgent` and :class:`AsyncTurn` (written
in ``ledger/_async/agent.py``, the source of the sync face)."""

from ledger._async.agent import AsyncAgent, AsyncTurn

__all__ = ["AsyncAgent", "AsyncTurn"]
