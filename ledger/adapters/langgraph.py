"""LangGraph / langchain-core adapter: the ledger governs a graph's context.

Two faces, one logic: :class:`LedgerGraph` governs with an
:class:`~ledger.agent.Agent` (``graph.invoke``), :class:`AsyncLedgerGraph` with an
:class:`~ledger.agent.AsyncAgent` (``await graph.ainvoke``, ``graph.astream``, async
nodes, async checkpointers such as ``AsyncSqliteSaver``; ``async with gov.turn()``,
``await model.ainvoke()``). The second is written by hand (``ledger/_async/langgraph.py``),
the first generated from it; what needs no I/O is in :mod:`ledger.adapters.graph_core`.

Glue, beyond the graph itself::

    gov = LedgerGraph(Agent(session, TiktokenCounter()), checkpointer=saver)
    docs: Annotated[list[Document], merge_docs]      # in the graph's state
    model = gov.model(chat_model)                    # measures every real prompt
    graph = gov.govern(builder).compile(checkpointer=saver)
    with gov.turn(working_set=2_000, config=config) as turn:   # around each invoke
        graph.invoke({...}, turn.config)

In a fleet every process serves any turn: the conversation lives in the graph's
checkpointer, the budget in the ledger, and each ended turn records the checkpoint it
committed in the ledger (its commit mark). The next turn, on any process, starts from
that checkpoint (``turn.config`` pins it), or from a checkpoint written on top of it
between turns (``graph.update_state``: what it added is admitted by the turn's first
node): a turn whose process died mid-way is rolled back in the ledger and its
checkpoints are left on a dead branch, so both start again from the last committed turn.

Every node's update passes through the ledger before it reaches the state: new
messages are admitted to working memory, ``ToolMessage`` results are admitted whole
or spilled (their content becomes the preview, naming the handle), documents under
the retrieval keys are admitted (those refused never reach the state), and items the
ledger reclaimed, evicted or compacted away leave the state (``RemoveMessage`` /
:class:`Removed`). The model wrapper counts each prompt actually sent; the turn ends
with the last prompt plus the answer it produced, so drift shows on that turn.
"""

from __future__ import annotations

from ledger.extras import missing

try:
    from ledger._async.langgraph import AsyncLedgerGraph
    from ledger._sync.langgraph import LedgerGraph
    from ledger.adapters.graph_core import GraphTurn, Removed, doc_id, merge_docs
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("langgraph", "langgraph", "the LangGraph adapter") from exc
from ledger.errors import WorkingMemoryStarvation

__all__ = [
    "AsyncLedgerGraph",
    "GraphTurn",
    "LedgerGraph",
    "Removed",
    "WorkingMemoryStarvation",
    "doc_id",
    "merge_docs",
]
