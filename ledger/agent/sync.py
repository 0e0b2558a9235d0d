"""The agent layer's synchronous face: :class:`Agent` and :class:`Turn` (generated in
``ledger/_sync/agent.py`` from ``ledger/_async/agent.py``)."""

from ledger._sync.agent import Agent, Turn

__all__ = ["Agent", "Turn"]
