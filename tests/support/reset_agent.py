"""An agent process of tests/test_agent_reset.py: turns of one shared session served by
the plain agent layer (``agent``) or the LangGraph adapter (``langgraph``), on the sync
or the asyncio face, the conversation shared by every process (a JSON file the plain
agent commits after each turn; a SQLite checkpointer for LangGraph). One JSON request a
line in (``{"turn": n}``), one JSON row out: the turn's drift, the ledger's occupancy
against the real prompt, the epoch the turn found reset (or None), or the error.

    python tests/support/reset_agent.py URL PREFIX SID KIND FACE STATE_FILE

``ALWAYS_RAISES`` is the worker's compactor: every compaction attempt fails, so the
session reaches the hard reset (docs/rules.md) after ``max_failed_compactions``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Annotated, Any, TypedDict

from ledger import Agent, AsyncAgent, AsyncLedger, Ledger, LedgerSettings, SessionBudget
from ledger.workers.compactors import CompactionPlan, CompactionRequest

SYSTEM = "You answer briefly."


def words(text: str) -> int:
    return len(text.split())


# H = 0.8 x (10_000 - 3 - 500) = 7_597: a turn whose prompt holds the first question
# (7_600 words) ends over it, so every turn makes a compaction due
BUDGET = SessionBudget(window=10_000, system_prompt=words(SYSTEM), output_reserve=500)


def always_raises(request: CompactionRequest) -> CompactionPlan:
    raise RuntimeError("summarizer down")


ALWAYS_RAISES = "tests.support.reset_agent:always_raises"


def question(n: int) -> str:
    return f"question {n} " + ("about the quarterly numbers " * 1_900 if n == 1 else "again")


def answer_text(n: int) -> str:
    return f"answer {n}: north up, south flat"


class PlainServer:
    """The agent layer alone: the app's conversation in a JSON file, committed after each
    turn (the turn's commit), reconciled after a hard reset (docs/agent.md)."""

    def __init__(self, url: str, prefix: str, sid: str, face: str, state: Path) -> None:
        self.url, self.prefix, self.sid, self.face, self.state = url, prefix, sid, face, state

    def load(self) -> list[dict[str, str]]:
        return json.loads(self.state.read_text()) if self.state.exists() else []

    def save(self, history: list[dict[str, str]]) -> None:
        tmp = self.state.with_suffix(f".{os.getpid()}")
        tmp.write_text(json.dumps(history))
        tmp.replace(self.state)

    def start_sync(self) -> None:
        self.led = Ledger.from_settings(LedgerSettings(redis_url=self.url, prefix=self.prefix))
        self.agent = Agent(self.led.open_session(self.sid, BUDGET), words, await_compaction=0)

    async def start_async(self) -> None:
        self.aled = AsyncLedger.from_settings(
            LedgerSettings(redis_url=self.url, prefix=self.prefix)
        )
        session = await self.aled.open_session(self.sid, BUDGET)
        self.aagent = AsyncAgent(session, words, await_compaction=0)

    def turn_sync(self, n: int) -> dict[str, Any]:
        history = self.load()
        user = {"id": f"u{n}", "content": question(n)}
        with self.agent.turn(0, admit={"working_memory": [user]}) as t:
            history = t.apply(history)
            # (read so on the version before it, whose begin raised StaleEpoch)
            if getattr(t, "reset_from_epoch", None) is not None:  # the ledger holds none
                self.agent.reconcile({"working_memory": [*history, user]})
            answer = {"id": f"a{n}", "content": answer_text(n)}
            t.admit("working_memory", [answer])
            history = [*history, user, answer]
            t.end([SYSTEM, *history])
        self.save(history)
        return row(n, t, [SYSTEM, *history])

    async def turn_async(self, n: int) -> dict[str, Any]:
        history = self.load()
        user = {"id": f"u{n}", "content": question(n)}
        async with self.aagent.turn(0, admit={"working_memory": [user]}) as t:
            history = t.apply(history)
            if getattr(t, "reset_from_epoch", None) is not None:
                await self.aagent.reconcile({"working_memory": [*history, user]})
            answer = {"id": f"a{n}", "content": answer_text(n)}
            await t.admit("working_memory", [answer])
            history = [*history, user, answer]
            await t.end([SYSTEM, *history])
        self.save(history)
        return row(n, t, [SYSTEM, *history])


def row(n: int, t: Any, prompt: list[Any]) -> dict[str, Any]:
    """What the test checks of a turn: the real prompt's words against the ledger."""
    counted = sum(words(p if isinstance(p, str) else str(p["content"])) for p in prompt)
    return {
        "turn": n,
        "pid": os.getpid(),
        "reset_from_epoch": getattr(t.state, "reset_from_epoch", None),
        "drift": t.report.drift,
        "flag": t.report.flag,
        "occupancy": t.report.occupancy,  # (read at end_turn: a reset may follow at once)
        "counted": counted,
        "epoch": t.report.epoch,
        "compaction_due": t.report.compaction_due,
    }


class GraphServer:
    """The LangGraph adapter: one node calling a stub chat model, the conversation in a
    SQLite checkpointer every process opens."""

    def __init__(self, url: str, prefix: str, sid: str, face: str, state: Path) -> None:
        self.url, self.prefix, self.sid, self.face, self.db = url, prefix, sid, face, state
        self.config = {"configurable": {"thread_id": sid}}
        self.seen: list[list[Any]] = []

    def build(self, gov: Any) -> Any:
        from langchain_core.language_models import BaseChatModel
        from langchain_core.messages import AIMessage, AnyMessage, SystemMessage
        from langchain_core.outputs import ChatGeneration, ChatResult
        from langgraph.graph import END, START, StateGraph
        from langgraph.graph.message import add_messages

        # (the functional form: its annotations are objects, not strings to resolve)
        State = TypedDict("State", {"messages": Annotated[list[AnyMessage], add_messages]})  # noqa: UP013
        seen = self.seen

        class Stub(BaseChatModel):
            @property
            def _llm_type(self) -> str:
                return "stub"

            def _generate(
                self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any
            ) -> ChatResult:
                seen.append(list(messages))
                n = sum(1 for m in messages if m.type == "human")
                msg = AIMessage(content=answer_text(n), id=uuid.uuid4().hex)
                return ChatResult(generations=[ChatGeneration(message=msg)])

            async def _agenerate(
                self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any
            ) -> ChatResult:
                return self._generate(messages)

        model = gov.model(Stub())

        def answer(state: State) -> dict[str, Any]:
            return {"messages": [model.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

        async def aanswer(state: State) -> dict[str, Any]:
            got = await model.ainvoke([SystemMessage(SYSTEM), *state["messages"]])
            return {"messages": [got]}

        builder = StateGraph(State)
        builder.add_node("answer", answer if self.face == "sync" else aanswer)
        builder.add_edge(START, "answer")
        builder.add_edge("answer", END)
        return gov.govern(builder)

    def start_sync(self) -> None:
        import sqlite3

        from langgraph.checkpoint.sqlite import SqliteSaver

        from ledger.adapters.langgraph import LedgerGraph

        conn = sqlite3.connect(str(self.db), check_same_thread=False, timeout=30)
        self.saver = SqliteSaver(conn)
        self.led = Ledger.from_settings(LedgerSettings(redis_url=self.url, prefix=self.prefix))
        agent = Agent(self.led.open_session(self.sid, BUDGET), words, await_compaction=0)
        self.gov = LedgerGraph(agent, checkpointer=self.saver)
        self.graph = self.build(self.gov).compile(checkpointer=self.saver)

    async def start_async(self) -> None:
        import aiosqlite
        from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

        from ledger.adapters.langgraph import AsyncLedgerGraph

        self.conn = await aiosqlite.connect(str(self.db), timeout=30)
        self.saver = AsyncSqliteSaver(self.conn)
        self.aled = AsyncLedger.from_settings(
            LedgerSettings(redis_url=self.url, prefix=self.prefix)
        )
        session = await self.aled.open_session(self.sid, BUDGET)
        self.gov = AsyncLedgerGraph(
            AsyncAgent(session, words, await_compaction=0), checkpointer=self.saver
        )
        self.graph = self.build(self.gov).compile(checkpointer=self.saver)

    def _row(self, n: int, t: Any) -> dict[str, Any]:
        last = self.seen[-1]
        prompt = [SYSTEM, *({"content": str(m.content)} for m in last[1:])]
        out = row(n, t, prompt)
        out["counted"] += words(answer_text(n))  # the answer the turn ended with
        return out

    def turn_sync(self, n: int) -> dict[str, Any]:
        from langchain_core.messages import HumanMessage

        q = HumanMessage(content=question(n), id=f"q{n}")
        with self.gov.turn(config=self.config) as t:
            self.graph.invoke({"messages": [q]}, t.config)
        return self._row(n, t)

    async def turn_async(self, n: int) -> dict[str, Any]:
        from langchain_core.messages import HumanMessage

        q = HumanMessage(content=question(n), id=f"q{n}")
        async with self.gov.turn(config=self.config) as t:
            await self.graph.ainvoke({"messages": [q]}, t.config)
        return self._row(n, t)


def serve(url: str, prefix: str, sid: str, kind: str, face: str, state: str) -> None:
    cls = PlainServer if kind == "agent" else GraphServer
    server: Any = cls(url, prefix, sid, face, Path(state))

    def answer(req: dict[str, Any], out: dict[str, Any] | Exception) -> None:
        if isinstance(out, Exception):  # a failed turn: reported, not hidden
            out = {"turn": req["turn"], "error": f"{type(out).__name__}: {out}"}
        print(json.dumps(out), flush=True)

    if face == "sync":
        server.start_sync()
        print(json.dumps({"ready": os.getpid()}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            try:
                answer(req, server.turn_sync(req["turn"]))
            except Exception as exc:
                answer(req, exc)
        return

    async def main() -> None:
        await server.start_async()
        loop = asyncio.get_running_loop()
        print(json.dumps({"ready": os.getpid()}), flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            req = json.loads(line)
            try:
                answer(req, await server.turn_async(req["turn"]))
            except Exception as exc:
                answer(req, exc)
        if isinstance(server, GraphServer):
            await server.conn.close()

    asyncio.run(main())


if __name__ == "__main__":
    serve(*sys.argv[1:7])
