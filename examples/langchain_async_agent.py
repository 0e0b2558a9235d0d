"""An asyncio LangChain ``create_agent`` agent whose context the ledger governs:
``AsyncLedgerMiddleware`` over an ``AsyncAgent`` (the agent's asyncio hooks), an async
tool, ``agent.ainvoke``, the conversation in an ``AsyncSqliteSaver`` file every process
opens. The chat model is a stub (no network) that counts every prompt it is sent (its
messages and the tool schemas), independently of the ledger.

Each turn: the model asks for the search tool, the tool answers, the model answers.
Between turns an operator adds a note the framework's own way (``agent.aupdate_state``):
the next turn, on whichever process serves it, admits it.

    python examples/langchain_async_agent.py                  # embedded, one process
    python examples/langchain_async_agent.py --serve --url redis://... --session S --db F

``--serve`` is one agent process of a fleet, with the requests and rows of
examples/langgraph_async_agent.py (``crash``: kill -9 inside the tool, mid-turn).
Lines marked `# ledger` are the glue (8 lines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import uuid
from typing import Any

import aiosqlite
from langchain.agents import create_agent
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from pydantic import Field

from ledger import AsyncAgent, AsyncLedger, SessionBudget, TiktokenCounter  # ledger
from ledger.adapters.langchain import AsyncLedgerMiddleware  # ledger

SYSTEM = "You are a data analyst. Search, then answer briefly."
TOKENS = TiktokenCounter()  # the stub model's own count (the glue makes its own counter)
SEEN: list[list[AnyMessage]] = []  # every prompt the model was sent
DRILL: dict[str, bool] = {}  # this turn's drill: crash (kill -9 in the tool)


@tool
async def search(q: str) -> str:
    """Search the analytics handbook."""
    if DRILL.get("crash"):  # a fleet drill: the process dies mid-turn (the tool call checkpointed)
        os.kill(os.getpid(), signal.SIGKILL)
    await asyncio.sleep(0.01)
    return f"Handbook on {q}: " + "regions report revenue monthly; " * 15


def schemas(tools: list[Any]) -> int:
    return sum(TOKENS(json.dumps(convert_to_openai_tool(t), sort_keys=True)) for t in tools)


def counted(messages: list[AnyMessage], tools: list[Any]) -> int:
    """The real prompt's tokens, as the model is sent it (independent of the ledger)."""
    calls = [json.dumps(m.tool_calls, sort_keys=True, default=str) for m in messages
             if getattr(m, "tool_calls", None)]
    return schemas(tools) + sum(TOKENS(str(m.content)) for m in messages) + sum(map(TOKENS, calls))


BUDGET = SessionBudget(window=2_400, system_prompt=TOKENS(SYSTEM), tool_framing=schemas([search]), output_reserve=200, framing_tolerance=0)  # ledger


class StubModel(BaseChatModel):
    """Asks for the search tool after a question, answers after its result; asyncio only."""

    tools: list[Any] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "stub"

    def bind_tools(self, tools: Any, **kw: Any) -> Any:
        return self.model_copy(update={"tools": list(tools)})

    def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any) -> ChatResult:
        raise NotImplementedError("this agent runs on asyncio")

    async def _agenerate(self, messages: list[Any], stop: Any = None, run_manager: Any = None,
                         **kw: Any) -> ChatResult:
        await asyncio.sleep(0.01)  # the provider's latency: the event loop serves others meanwhile
        SEEN.append(list(messages))
        n_in = counted(messages, self.tools)
        usage = {"input_tokens": n_in, "output_tokens": 9, "total_tokens": n_in + 9}
        if isinstance(messages[-1], HumanMessage):
            call = {"name": "search", "args": {"q": str(messages[-1].content)[:12]}, "id": uuid.uuid4().hex}
            msg = AIMessage(content="", tool_calls=[call], usage_metadata=usage, id=uuid.uuid4().hex)
        else:
            msg = AIMessage(content="By region: north up, south flat.", usage_metadata=usage, id=uuid.uuid4().hex)
        return ChatResult(generations=[ChatGeneration(message=msg)])


class Server:
    """One process's agent: its ledger session, the middleware, the shared checkpointer."""

    async def start(self, url: str, session_id: str, saver: AsyncSqliteSaver) -> Server:
        self.config = {"configurable": {"thread_id": session_id}}
        session = await AsyncLedger.from_url(url).open_session(session_id, BUDGET)  # ledger
        self.mw = AsyncLedgerMiddleware(AsyncAgent(session, TiktokenCounter()), checkpointer=saver)  # ledger
        self.agent = create_agent(StubModel(), [search], system_prompt=SYSTEM, checkpointer=saver, middleware=[self.mw])  # ledger
        return self

    async def turn(self, n: int, wait: float = 0.0) -> dict[str, Any]:
        SEEN.clear()
        question = HumanMessage(content=f"Q{n}: revenue by region?", id=f"q{n}")
        async with self.mw.turn(config=self.config, wait=wait) as t:  # ledger
            await self.agent.ainvoke({"messages": [question]}, t.config)  # ledger
        assert t.report is not None
        snap = await self.mw.agent.session.snapshot()
        answer = (await self.agent.aget_state(self.config)).values["messages"][-1]
        return {"turn": n, "ledger_turn": t.number, "pid": os.getpid(), "drift": t.report.drift,
                "flag": t.report.flag, "occupancy": snap.occupancy, "turn_open": snap.turn_open,
                "counted": counted(SEEN[-1], [search]) + TOKENS(str(answer.content)),
                "prompt_ids": [str(m.id) for m in SEEN[-1]], "rolled_back": t.rolled_back,
                "delivered": [str(s.id) for s in t.summaries],
                "audit_clean": (await self.mw.agent.session.audit()).clean}

    async def note(self, text: str, note_id: str) -> dict[str, Any]:
        """An operator's note, added between turns the framework's own way."""
        await self.agent.aupdate_state(self.config, {"messages": [HumanMessage(content=text, id=note_id)]})
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
        server = await Server().start("embedded://langchain-async-example", "lca", saver)
        for n in range(1, turns + 1):
            if n == 4:
                await server.note("Operator: report amounts in euros.", "note-1")
            row = await server.turn(n)
            print(f"turn {n}: ledger {row['occupancy']} = prompt {row['counted']} "
                  f"(drift {row['drift']}); note in prompt: {'note-1' in row['prompt_ids']}")
        await server.mw.agent.session.delete()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="embedded://langchain-async-example")
    ap.add_argument("--session", default=None)
    ap.add_argument("--db", default=None)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--serve", action="store_true")
    a = ap.parse_args()
    if a.serve:
        asyncio.run(serve(a.url, a.session or f"lca-{uuid.uuid4().hex[:12]}", a.db))
    else:
        asyncio.run(demo(a.turns))


if __name__ == "__main__":
    main()
