"""The agent layer: govern a real agent's context with the ledger, in a few lines.

``Agent`` (sync) and ``AsyncAgent`` (asyncio) wrap a session; ``agent.turn()`` runs
begin_turn / end_turn around a turn; ``turn.admit``, ``turn.tool_result``,
``turn.compact`` take and give back the app's own objects. See docs/agent.md.
Importing this package imports no agent framework and no tokenizer.
"""

from ledger.agent.aio import AsyncAgent, AsyncTurn
from ledger.agent.core import (
    Admission,
    AgentCore,
    BillingCheck,
    CallHold,
    Compacted,
    ToolOutcome,
    TurnState,
    default_id,
    default_text,
    ledger_id,
)
from ledger.agent.counters import Calibrated, EstimatingCounter, TiktokenCounter, TokenCounter
from ledger.agent.sync import Agent, Turn

__all__ = [
    "Admission",
    "Agent",
    "BillingCheck",
    "CallHold",
    "AgentCore",
    "AsyncAgent",
    "AsyncTurn",
    "Calibrated",
    "Compacted",
    "EstimatingCounter",
    "TiktokenCounter",
    "TokenCounter",
    "ToolOutcome",
    "Turn",
    "TurnState",
    "default_id",
    "default_text",
    "ledger_id",
]
