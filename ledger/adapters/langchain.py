"""LangChain 1.x adapter: an ``AgentMiddleware`` that governs a ``create_agent`` agent.

Two faces, one logic: :class:`LedgerMiddleware` (an :class:`~ledger.agent.Agent`, the
sync hooks: ``agent.invoke``) and :class:`AsyncLedgerMiddleware` (an
:class:`~ledger.agent.AsyncAgent`, the asyncio hooks ``abefore_model``,
``awrap_model_call``, ``aafter_model``, ``awrap_tool_call``: ``await agent.ainvoke``,
``agent.astream``; ``async with ledger_mw.turn()``). The second is written by hand
(``ledger/_async/langchain.py``), the first generated from it.

Glue, beyond the agent itself::

    ledger_mw = LedgerMiddleware(Agent(session, TiktokenCounter()), checkpointer=saver)
    agent = create_agent(model, tools, system_prompt=SYSTEM, checkpointer=saver,
                         middleware=[ledger_mw])
    with ledger_mw.turn(working_set=2_000, config=config) as turn:
        agent.invoke({"messages": [question]}, turn.config)

The agent's conversation is its state, kept by its checkpointer: each ended turn records
the checkpoint it committed (its commit mark) and the next turn, on any process, starts
from it (``turn.config``). Before each model call the turn's deliveries reach the state
(what the ledger reclaimed and what the worker's summary replaced leave it, the summary
enters where that history began) and every message of the state is admitted (what
another middleware removed, e.g. ``SummarizationMiddleware`` or
``ContextEditingMiddleware``, is given back); each model call's real prompt (system
message, tool schemas, messages) is counted and refused before the call when it is over
the window minus the output reserve, and the input tokens its answer reports are checked
against that count; a tool's result is admitted whole or spilled (its content becomes
the preview naming the handle) before it reaches the state.

Compaction: with the session worker-owned (the default), the ledger's worker summarizes
off the request path and ``SummarizationMiddleware`` is not needed; beside it, the ledger
follows what it removes. ``summarize=`` compacts inline on an agent-owned session, as
:class:`~ledger.adapters.langgraph.LedgerGraph` does.
"""

from __future__ import annotations

from ledger.extras import missing

try:
    from ledger._async.langchain import AsyncLedgerMiddleware
    from ledger._sync.langchain import LedgerMiddleware
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("langchain", "langchain", "the LangChain middleware") from exc

__all__ = ["AsyncLedgerMiddleware", "LedgerMiddleware"]
