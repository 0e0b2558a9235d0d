"""A LangChain 1.x agent (``create_agent``) whose context the ledger governs, in a fleet.

Each turn: the model asks a search tool (12-18 chunks with URL ids, one result), then a
SQL tool whose result is sometimes ~22k tokens, then answers. The chat model is a stub
(no network); it counts every prompt it is sent, independently of the ledger, and
reports that count as billed.

The conversation is the agent's state in its checkpointer (a SqliteSaver file every
process opens); the ledger's ``LedgerMiddleware`` governs it beside the agent's other
middleware, and compaction is the background worker's (``ledger worker`` with an LLM
summarizer over a stub model, ``COMPACTOR`` below), in place of SummarizationMiddleware.

    python examples/langchain_agent.py                             # embedded, one process
    python examples/langchain_agent.py --url redis://localhost:6379/0 --processes 2
    python examples/langchain_agent.py --drift-at 17               # context behind the ledger's back
    python examples/langchain_agent.py --url ... --processes 2 --kill-at 9 --race-at 5

Lines marked `# ledger` are the glue (9 lines, the repair of a flagged drift included).
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import time
import warnings
from typing import Any

import fleet
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.sqlite import SqliteSaver
from pydantic import Field

from ledger import Agent, Ledger, SessionBudget, TiktokenCounter  # ledger
from ledger.adapters.langchain import LedgerMiddleware  # ledger
from ledger.adapters.summarizer import LLMSummarizer
from ledger.errors import ContextDriftWarning  # the example's report

WINDOW = 16_000
OVERHEAD = 4
SYSTEM = "You are a data analyst. Answer from the search results and the SQL rows."
TOKENS = TiktokenCounter()  # the stub model's own count
WORDS = ["revenue", "margin", "churn", "cohort", "region", "quarter", "pipeline", "forecast", "segment"]
SEEN: list[tuple[int, list[str]]] = []  # every prompt the model was sent: tokens, message ids
INJECT = {"on": False}


def counted(messages: list[AnyMessage], tools: list[Any]) -> int:
    """The real prompt's tokens, as the model is sent it (independent of the ledger)."""
    schemas = sum(TOKENS(json.dumps(convert_to_openai_tool(t), sort_keys=True)) for t in tools)
    return schemas + sum(TOKENS(str(m.content)) + TOKENS(json.dumps(getattr(m, "tool_calls", []) or [],
                         sort_keys=True, default=str) if getattr(m, "tool_calls", None) else "") + OVERHEAD
                         for m in messages)


class StubModel(BaseChatModel):
    """Searches after a question, runs SQL after the search, answers after the rows."""

    tools: list[Any] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "stub"

    def bind_tools(self, tools: Any, **kw: Any) -> Any:
        return self.model_copy(update={"tools": list(tools)})

    def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any) -> ChatResult:
        fleet.hold_here()  # a fleet drill: a slow model call, holding the turn
        n_in = counted(messages, self.tools)
        SEEN.append((n_in, [str(m.id) for m in messages]))
        usage = {"input_tokens": n_in, "output_tokens": 20, "total_tokens": n_in + 20}
        last = messages[-1]
        q = next(str(m.content).split(":")[0] for m in reversed(messages) if isinstance(m, HumanMessage))
        if isinstance(last, HumanMessage):
            calls = [{"name": "search", "args": {"q": q}, "id": f"search-{q}"}]
        elif isinstance(last, ToolMessage) and last.name == "search":
            calls = [{"name": "sql", "args": {"q": q}, "id": f"sql-{q}"}]
        else:
            calls = []
        text = "" if calls else "Based on the rows and search results: " + " ".join(WORDS[:6])
        msg = AIMessage(content=text, tool_calls=calls, usage_metadata=usage, id=f"ai-{q}-{len(calls)}")
        return ChatResult(generations=[ChatGeneration(message=msg)])


class StubSummarizer(BaseChatModel):
    """The worker's summarizer model: a short summary naming how much it read."""

    @property
    def _llm_type(self) -> str:
        return "stub-summarizer"

    def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any) -> ChatResult:
        body = str(messages[-1].content)
        text = f"Summary of {body.count('[')} earlier items ({len(body)} characters): " + " ".join(WORDS)
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text))])


# The background worker's compactor: `ledger worker --compactor langchain_agent:COMPACTOR`.
COMPACTOR = LLMSummarizer(StubSummarizer(), TOKENS, item_overhead=OVERHEAD)


def chunk(i: int) -> str:
    url = f"https://wiki.example.com/analytics/handbook?page={i // 8}&chunk={i}#section-{i % 8}"
    return f"[{url}] " + " ".join(random.Random(i).choice(WORDS) for _ in range(390))


@tool
def search(q: str) -> str:
    """Search the analytics handbook for question q."""
    rnd = random.Random(int(q[1:]))
    return "\n\n".join(chunk(i) for i in rnd.sample(range(400), rnd.randint(12, 18)))


@tool
def sql(q: str) -> str:
    """Run the analytics query for question q."""
    fleet.crash_here()  # a fleet drill: the process dies inside the tool
    turn = int(q[1:])
    rows = 2_600 if turn % 4 == 3 else random.Random(turn).randint(60, 220)
    return "\n".join(f"{r},{WORDS[r % 9]},{r * 37 % 1000}.{r % 100:02d}" for r in range(rows))


class Inject(AgentMiddleware):  # type: ignore[misc]
    """Context added to the prompt behind the ledger's back, on the drift turn."""

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        if INJECT["on"]:
            request = request.override(messages=[SystemMessage(content="NOTE " + "unlogged context " * 150), *request.messages])
        return handler(request)


TOOLS = [search, sql]
BUDGET = SessionBudget(window=16_000, system_prompt=TOKENS(SYSTEM) + OVERHEAD, tool_framing=counted([], TOOLS), output_reserve=1_000, working_memory_floor=1_500, framing_tolerance=8)  # ledger


class Server:
    """One process's agent: its ledger session, the agent and the checkpointer every
    process shares."""

    def __init__(self, url: str, session_id: str, db: str) -> None:
        saver = SqliteSaver(sqlite3.connect(db, check_same_thread=False, timeout=30))
        self.config = {"configurable": {"thread_id": session_id}}
        session = Ledger.from_url(url).open_session(session_id, BUDGET)  # ledger
        self.mw = LedgerMiddleware(Agent(session, TiktokenCounter(), item_overhead=4), checkpointer=saver)  # ledger
        self.agent = create_agent(StubModel(), TOOLS, system_prompt=SYSTEM, checkpointer=saver, middleware=[Inject(), self.mw])  # ledger
        self.gov = self.mw.graph

    def turn(self, n: int, inject: bool = False, wait: float = 0.0) -> dict[str, Any]:
        SEEN.clear()
        INJECT["on"] = inject
        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ContextDriftWarning)
            with self.mw.turn(working_set=1_500, config=self.config, wait=wait) as t:  # ledger
                state = self.agent.invoke({"messages": [HumanMessage(f"Q{n}: {WORDS[n % 9]} by region?")]}, t.config)  # ledger
        assert t.report is not None and t.state is not None
        if t.report.flagged:  # the prompt drifted from the ledger: set it to what the state holds
            self.mw.reconcile(self.config)  # ledger
        snap = self.gov.agent.session.snapshot()
        tool = max(t.state.tools, key=lambda o: o.tokens) if t.state.tools else None
        return {"turn": n, "ledger_turn": t.number, "pid": os.getpid(),
                "prompt": t.report.occupancy + t.report.drift, "occupancy": snap.occupancy,
                "drift": t.report.drift, "flag": t.report.flag, "warned": len(caught),
                "counted": SEEN[-1][0], "max_sent": max(s for s, _ in SEEN), "window": WINDOW,
                "docs": sum(1 for m in state["messages"] if isinstance(m, ToolMessage) and m.name == "search"),
                "messages": len(state["messages"]),
                "spilled": any(o.spilled for o in t.state.tools), "tool_tokens": tool.tokens if tool else 0,
                "dropped": len(t.state.drop_refs), "delivered": [str(s.id) for s in t.summaries],
                "summaries_in_prompt": [i for i in SEEN[-1][1] if i.startswith("summary-")],
                "high": snap.occupancy > BUDGET.high_water_tokens, "rolled_back": t.rolled_back,
                "waited_s": round(time.monotonic() - started, 3),
                "billed": t.state.billing[-1].billed if t.state.billing else None,
                "billing_flagged": [c.flagged for c in t.state.billing],
                "audit_clean": self.gov.agent.session.audit().clean}


def main() -> None:
    fleet.main(__file__, Server, COMPACTOR, "langchain_agent:COMPACTOR", "embedded://langchain-example", "lc")


if __name__ == "__main__":
    main()
