"""A LangGraph agent whose context the ledger governs, served by a fleet.

Five nodes: ask -> retrieve (12-18 chunks with URL ids) -> plan (the model asks for
SQL) -> sql (a tool whose result is sometimes ~22k tokens) -> answer. The chat model is
a stub (no network); it counts every prompt it is sent, independently of the ledger.

The conversation lives in the graph's own checkpointer (a SqliteSaver file every
process opens), the budget in the ledger; compaction is the background worker's
(``ledger worker`` with an LLM summarizer over a stub chat model, ``COMPACTOR`` below).
Any process may serve any turn: each turn starts from the checkpoint the last ended turn
committed, and a turn whose process died is rolled back.

    python examples/langgraph_agent.py                           # embedded, one process
    python examples/langgraph_agent.py --url redis://localhost:6379/0 --processes 2
    python examples/langgraph_agent.py --drift-at 17             # context behind the ledger's back
    python examples/langgraph_agent.py --url ... --processes 2 --kill-at 9   # kill -9 mid-tool
    python examples/langgraph_agent.py --url ... --processes 2 --race-at 5   # one turn started twice

With a redis:// URL the example starts its own ``ledger worker`` process; on embedded a
worker runs in this process. Lines marked `# ledger` are the glue (10 lines, the repair of a
flagged drift included).
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import time
import uuid
import warnings
from typing import Annotated, Any, TypedDict

import fleet
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from ledger import Agent, Ledger, SessionBudget, TiktokenCounter  # ledger
from ledger.adapters.langgraph import LedgerGraph, merge_docs  # ledger
from ledger.adapters.summarizer import LLMSummarizer
from ledger.errors import ContextDriftWarning  # the example's report

WINDOW = 16_000
OVERHEAD = 4  # tokens of chat framing per message, counted for items and prompts alike
SYSTEM = "You are a data analyst. Answer from the documents and the SQL results."  # 15 tokens + 4
TOKENS = TiktokenCounter()  # the stub model's own count (the glue makes its own counter)
SEEN: list[list[AnyMessage]] = []  # every prompt the model was sent
WORDS = ["revenue", "margin", "churn", "cohort", "region", "quarter", "pipeline", "forecast", "segment"]


def counted(messages: list[AnyMessage]) -> int:
    """The real prompt's tokens, as the model is sent it (independent of the ledger)."""
    return sum(TOKENS(str(m.content)) + TOKENS(json.dumps(getattr(m, "tool_calls", []) or [],
               sort_keys=True, default=str) if getattr(m, "tool_calls", None) else "") + OVERHEAD
               for m in messages)


class StubModel(BaseChatModel):
    """A chat model with canned answers: asks for SQL after a question, answers after it."""

    @property
    def _llm_type(self) -> str:
        return "stub"

    def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None,
                  **kw: Any) -> ChatResult:
        SEEN.append(list(messages))
        last = messages[-1]
        usage = {"input_tokens": counted(messages), "output_tokens": 20, "total_tokens": counted(messages) + 20}
        if isinstance(last, HumanMessage):
            n = str(last.content).split(":")[0]
            msg = AIMessage(content="", tool_calls=[{"name": "sql", "args": {"q": n}, "id": f"sql-{n}"}], usage_metadata=usage)
        else:
            msg = AIMessage(content="Based on the rows and documents: " + " ".join(WORDS[:6]), usage_metadata=usage)
        return ChatResult(generations=[ChatGeneration(message=msg)])


class StubSummarizer(BaseChatModel):
    """The worker's summarizer model: a short summary naming how much it read."""

    @property
    def _llm_type(self) -> str:
        return "stub-summarizer"

    def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None,
                  **kw: Any) -> ChatResult:
        body = str(messages[-1].content)
        text = f"Summary of {body.count('[')} earlier items ({len(body)} characters): " + " ".join(WORDS)
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text))])


# The background worker's compactor: `ledger worker --compactor langgraph_agent:COMPACTOR`.
COMPACTOR = LLMSummarizer(StubSummarizer(), TOKENS, item_overhead=OVERHEAD)


class State(TypedDict, total=False):
    question: str
    messages: Annotated[list[AnyMessage], add_messages]
    docs: Annotated[list[Document], merge_docs]  # ledger
    inject: bool


def chunk(i: int) -> Document:
    rnd = random.Random(i)
    text = " ".join(rnd.choice(WORDS) for _ in range(390))
    return Document(page_content=text, id=f"https://wiki.example.com/analytics/handbook?page={i // 8}&chunk={i}#section-{i % 8}")


def sql_rows(turn: int) -> str:
    rows = 2_600 if turn % 4 == 3 else random.Random(turn).randint(60, 220)
    return "\n".join(f"{r},{WORDS[r % 9]},{r * 37 % 1000}.{r % 100:02d}" for r in range(rows))


def build(model: Any) -> StateGraph:
    def prompt(state: State) -> list[AnyMessage]:
        docs = [SystemMessage(content=d.page_content, id=d.id) for d in state.get("docs", [])]
        extra = [SystemMessage(content="NOTE " + "unlogged context " * 150)] if state.get("inject") else []
        return [SystemMessage(content=SYSTEM), *docs, *extra, *state["messages"]]

    def ask(state: State) -> dict[str, Any]:
        return {"messages": [HumanMessage(content=state["question"], id=uuid.uuid4().hex)]}

    def retrieve(state: State) -> dict[str, Any]:
        turn = int(state["question"].split(":")[0][1:])
        rnd = random.Random(turn)
        return {"docs": [chunk(i) for i in rnd.sample(range(400), rnd.randint(12, 18))]}

    def plan(state: State) -> dict[str, Any]:
        fleet.hold_here()  # a fleet drill: a slow model call, holding the turn
        return {"messages": [model.invoke(prompt(state))]}

    def sql(state: State) -> dict[str, Any]:
        fleet.crash_here()  # a fleet drill: the process dies inside the tool
        call = state["messages"][-1].tool_calls[0]
        turn = int(call["args"]["q"][1:])
        return {"messages": [ToolMessage(content=sql_rows(turn), tool_call_id=call["id"])]}

    def answer(state: State) -> dict[str, Any]:
        return {"messages": [model.invoke(prompt(state))]}

    builder = StateGraph(State)
    for name, fn in [("ask", ask), ("retrieve", retrieve), ("plan", plan), ("sql", sql), ("answer", answer)]:
        builder.add_node(name, fn)
    builder.add_edge(START, "ask")
    for a, b in [("ask", "retrieve"), ("retrieve", "plan"), ("plan", "sql"), ("sql", "answer"), ("answer", END)]:
        builder.add_edge(a, b)
    return builder


BUDGET = SessionBudget(window=16_000, system_prompt=19, output_reserve=1_000, working_memory_floor=1_500, framing_tolerance=8)  # ledger


class Server:
    """One process's agent: its ledger session, the governed model and graph, and the
    checkpointer every process shares."""

    def __init__(self, url: str, session_id: str, db: str) -> None:
        saver = SqliteSaver(sqlite3.connect(db, check_same_thread=False, timeout=30))
        self.config = {"configurable": {"thread_id": session_id}}
        session = Ledger.from_url(url).open_session(session_id, BUDGET)  # ledger
        self.gov = LedgerGraph(Agent(session, TiktokenCounter(), item_overhead=4), checkpointer=saver)  # ledger
        self.graph = self.gov.govern(build(self.gov.model(StubModel()))).compile(checkpointer=saver)  # ledger

    def turn(self, n: int, inject: bool = False, wait: float = 0.0) -> dict[str, Any]:
        SEEN.clear()
        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ContextDriftWarning)
            with self.gov.turn(working_set=1_500, config=self.config, wait=wait) as t:  # ledger
                state = self.graph.invoke({"question": f"Q{n}: {WORDS[n % 9]} by region?", "inject": inject}, t.config)  # ledger
        assert t.report is not None and t.state is not None
        if t.report.flagged:  # the prompt drifted from the ledger: set it to what the state holds
            self.gov.reconcile(self.config)  # ledger
        snap = self.gov.agent.session.snapshot()
        tool = t.state.tools[-1] if t.state.tools else None
        last = SEEN[-1] if SEEN else []
        summaries = [str(m.id) for m in last if str(m.id).startswith("summary-")]
        return {"turn": n, "ledger_turn": t.number, "pid": os.getpid(),
                "prompt": t.report.occupancy + t.report.drift, "occupancy": snap.occupancy,
                "drift": t.report.drift, "flag": t.report.flag, "warned": len(caught),
                "counted": counted(last), "max_sent": max(map(counted, SEEN)), "window": WINDOW,
                "docs": len(state.get("docs", [])), "messages": len(state["messages"]),
                "spilled": bool(tool and tool.spilled), "tool_tokens": tool.tokens if tool else 0,
                "dropped": len(t.state.drop_refs), "delivered": [str(s.id) for s in t.summaries],
                "summaries_in_prompt": summaries, "high": snap.occupancy > BUDGET.high_water_tokens,
                "rolled_back": t.rolled_back, "waited_s": round(time.monotonic() - started, 3),
                "billed": t.state.billing[-1].billed if t.state.billing else None,
                "billing_flagged": [c.flagged for c in t.state.billing],
                "audit_clean": self.gov.agent.session.audit().clean}


def main() -> None:
    fleet.main(__file__, Server, COMPACTOR, "langgraph_agent:COMPACTOR", "embedded://langgraph-example", "lg")


if __name__ == "__main__":
    main()
