"""An asyncio LangGraph agent whose context the ledger governs: ``AsyncLedgerGraph``
over an ``AsyncAgent``, async nodes, ``graph.ainvoke``, the conversation in an
``AsyncSqliteSaver`` file every process opens. The chat model is a stub (no network) that
counts every prompt it is sent, independently of the ledger.

Two nodes: think (a long note) -> answer (the model). Between turns an operator adds a
note to the conversation the framework's own way (``graph.aupdate_state``): the next
turn, on whichever process serves it, admits it, so it is in that turn's prompt and in
the ledger.

    python examples/langgraph_async_agent.py                  # embedded, one process
    python examples/langgraph_async_agent.py --serve --url redis://... --session S --db F

``--serve`` is one agent process of a fleet (tests/test_fleet_async.py runs two on a real
Redis with a ``ledger worker``): one JSON request a line in, ``{"turn": n, "crash": 0/1,
"wait": seconds}`` (``crash``: kill -9 inside the answer node, mid-turn) or ``{"note":
text, "id": id}`` (``aupdate_state`` between turns), one JSON row out. Lines marked
`# ledger` are the glue (8 lines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import uuid
from typing import Annotated, Any, TypedDict

import aiosqlite
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from ledger import AsyncAgent, AsyncLedger, SessionBudget, TiktokenCounter  # ledger
from ledger.adapters.langgraph import AsyncLedgerGraph  # ledger

SYSTEM = "You are a data analyst. Answer briefly."
TOKENS = TiktokenCounter()  # the stub model's own count (the glue makes its own counter)
SEEN: list[list[AnyMessage]] = []  # every prompt the model was sent
DRILL: dict[str, bool] = {}  # this turn's drill: crash (kill -9 in the answer node)
BUDGET = SessionBudget(window=2_000, system_prompt=TOKENS(SYSTEM), output_reserve=200, framing_tolerance=0)  # ledger


def counted(messages: list[AnyMessage]) -> int:
    """The real prompt's tokens, as the model is sent it (independent of the ledger)."""
    return sum(TOKENS(str(m.content)) for m in messages)


class StubModel(BaseChatModel):
    """A chat model with a canned answer, billing what it was sent; asyncio only."""

    @property
    def _llm_type(self) -> str:
        return "stub"

    def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any) -> ChatResult:
        raise NotImplementedError("this agent runs on asyncio")

    async def _agenerate(self, messages: list[Any], stop: Any = None, run_manager: Any = None,
                         **kw: Any) -> ChatResult:
        await asyncio.sleep(0.01)  # the provider's latency: the event loop serves others meanwhile
        SEEN.append(list(messages))
        usage = {"input_tokens": counted(messages), "output_tokens": 9, "total_tokens": counted(messages) + 9}
        msg = AIMessage(content="By region: north up, south flat, west down.", usage_metadata=usage)
        return ChatResult(generations=[ChatGeneration(message=msg)])


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def build(model: Any) -> StateGraph:
    async def think(state: State) -> dict[str, Any]:
        note = "(thinking) " + "compare the regions quarter by quarter; " * 20
        return {"messages": [AIMessage(content=note, id=uuid.uuid4().hex)]}

    async def answer(state: State) -> dict[str, Any]:
        if DRILL.get("crash"):  # a fleet drill: the process dies mid-turn (think checkpointed)
            os.kill(os.getpid(), signal.SIGKILL)
        return {"messages": [await model.ainvoke([SystemMessage(SYSTEM), *state["messages"]])]}

    builder = StateGraph(State)
    builder.add_node("think", think)
    builder.add_node("answer", answer)
    builder.add_edge(START, "think")
    builder.add_edge("think", "answer")
    builder.add_edge("answer", END)
    return builder


class Server:
    """One process's agent: its ledger session, the governed graph, the shared checkpointer."""

    async def start(self, url: str, session_id: str, saver: AsyncSqliteSaver) -> Server:
        self.config = {"configurable": {"thread_id": session_id}}
        session = await AsyncLedger.from_url(url).open_session(session_id, BUDGET)  # ledger
        self.gov = AsyncLedgerGraph(AsyncAgent(session, TiktokenCounter()), checkpointer=saver)  # ledger
        self.graph = self.gov.govern(build(self.gov.model(StubModel()))).compile(checkpointer=saver)  # ledger
        return self

    async def turn(self, n: int, wait: float = 0.0) -> dict[str, Any]:
        SEEN.clear()
        question = HumanMessage(content=f"Q{n}: revenue by region?", id=f"q{n}")
        async with self.gov.turn(config=self.config, wait=wait) as t:  # ledger
            await self.graph.ainvoke({"messages": [question]}, t.config)  # ledger
        assert t.report is not None and t.state is not None
        snap = await self.gov.agent.session.snapshot()
        last = SEEN[-1]
        answer = (await self.graph.aget_state(self.config)).values["messages"][-1]
        return {"turn": n, "ledger_turn": t.number, "pid": os.getpid(), "drift": t.report.drift,
                "flag": t.report.flag, "occupancy": snap.occupancy, "turn_open": snap.turn_open,
                "counted": counted(last) + TOKENS(str(answer.content)),
                "prompt_ids": [str(m.id) for m in last], "rolled_back": t.rolled_back,
                "delivered": [str(s.id) for s in t.summaries],
                "audit_clean": (await self.gov.agent.session.audit()).clean}

    async def note(self, text: str, note_id: str) -> dict[str, Any]:
        """An operator's note, added between turns the framework's own way."""
        await self.graph.aupdate_state(self.config, {"messages": [HumanMessage(content=text, id=note_id)]})
        return {"note": note_id, "pid": os.getpid()}


async def serve(url: str, session_id: str, db: str) -> None:
    # every process writes the one file: wait up to 30 s for its lock (sqlite's default is 5)
    async with aiosqlite.connect(db, timeout=30) as conn:
        saver = AsyncSqliteSaver(conn)
        server = await Server().start(url, session_id, saver)
        loop = asyncio.get_running_loop()
        print(json.dumps({"ready": os.getpid()}), flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            req = json.loads(line)
            DRILL.clear()
            DRILL["crash"] = bool(req.get("crash"))
            if "note" in req:
                row = await server.note(req["note"], req["id"])
            else:
                row = await server.turn(req["turn"], float(req.get("wait", 0)))
            print(json.dumps(row), flush=True)


async def demo(turns: int) -> None:
    async with AsyncSqliteSaver.from_conn_string(":memory:") as saver:
        server = await Server().start("embedded://langgraph-async-example", "lga", saver)
        for n in range(1, turns + 1):
            if n == 4:
                await server.note("Operator: report amounts in euros.", "note-1")
            row = await server.turn(n)
            print(f"turn {n}: ledger {row['occupancy']} = prompt {row['counted']} "
                  f"(drift {row['drift']}); note in prompt: {'note-1' in row['prompt_ids']}")
        await server.gov.agent.session.delete()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="embedded://langgraph-async-example")
    ap.add_argument("--session", default=None)
    ap.add_argument("--db", default=None)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--serve", action="store_true")
    a = ap.parse_args()
    if a.serve:
        asyncio.run(serve(a.url, a.session or f"lga-{uuid.uuid4().hex[:12]}", a.db))
    else:
        asyncio.run(demo(a.turns))


if __name__ == "__main__":
    main()
