"""One process of a fleet serving turns of sessions of tenants through the LangGraph
adapter with the tenant named (tests/test_fleet_ceilings.py runs two of them, turns
alternating between them): ``--face sync`` (LedgerGraph, a SqliteSaver on one file) or
``--face asyncio`` (AsyncLedgerGraph, an async node, ainvoke, an AsyncSqliteSaver on the
same kind of file). The conversation is shared the framework's way: every process opens
the same checkpoint file and each turn starts from the checkpoint the last one committed.

Requests on stdin, one JSON object a line: ``{"session": id, "turn": n}`` serves that turn
(with ``"crash": 1`` the process kills itself with SIGKILL inside the model call, its hold
taken, nothing billed) and answers with one JSON line: the tokens the stub model was
billed (``billed``: input plus output, each call), or the refusal (``refused``: the
error's type, scope, quantity and what was left), with this process's pid."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sqlite3
import sys
import uuid
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from pydantic import Field

from ledger import (
    Agent,
    AsyncAgent,
    AsyncLedger,
    CeilingReached,
    Ledger,
    LedgerError,
    LedgerSettings,
    TiktokenCounter,
)
from ledger.keys import tenant_of

TOKENS = TiktokenCounter()
SYSTEM = "Answer from the conversation."
OUT = 40  # what the stub bills for each answer (within the output reserve)
HOLD_MS = 3_000  # a hold's deadline: what a process killed inside its model call holds
CRASH = {"now": False}


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


class Stub(BaseChatModel):
    """Bills the prompt as the agent counts it (``count``) and OUT output tokens, and
    keeps each bill in ``billed``."""

    count: Any = None
    billed: list[int] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "stub"

    def _generate(
        self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> ChatResult:
        if CRASH["now"]:  # the hold is taken: the process dies before anything is billed
            os.kill(os.getpid(), signal.SIGKILL)
        n = self.count(messages)
        self.billed.append(n + OUT)
        usage = {"input_tokens": n, "output_tokens": OUT, "total_tokens": n + OUT}
        text = "The figures are in the ledger. " * 4
        msg = AIMessage(text, id=f"ai-{uuid.uuid4().hex[:12]}", usage_metadata=usage)  # type: ignore[arg-type]
        return ChatResult(generations=[ChatGeneration(message=msg)])


def question(n: int) -> HumanMessage:
    return HumanMessage(f"Question {n}: " + "what did the quarter bring " * 16, id=f"q{n}")


def builder_for(answer: Any) -> StateGraph:
    b = StateGraph(State)
    b.add_node("answer", answer)
    b.add_edge(START, "answer")
    b.add_edge("answer", END)
    return b


def refusal(exc: LedgerError) -> dict[str, Any]:
    row: dict[str, Any] = {"refused": type(exc).__name__}
    if isinstance(exc, CeilingReached):
        row.update(scope=exc.scope, quantity=exc.quantity, free=exc.free)
    return row


def serve_sync(settings: LedgerSettings, db: str) -> None:
    from langgraph.checkpoint.sqlite import SqliteSaver

    from ledger.adapters.langgraph import LedgerGraph

    led = Ledger.from_settings(settings)
    # (the fleet's processes share the file: each waits up to 30 s for its lock)
    saver = SqliteSaver(sqlite3.connect(db, check_same_thread=False, timeout=30))
    govs: dict[str, tuple[Any, Any, Stub]] = {}

    def build(sid: str) -> tuple[Any, Any, Stub]:
        agent = Agent(led.session(sid), TOKENS, tenant=tenant_of(sid), hold_ms=HOLD_MS)
        gov = LedgerGraph(agent, checkpointer=saver)
        stub = Stub(count=gov.core.prompt_tokens, billed=[])
        model = gov.model(stub)

        def answer(state: State) -> dict[str, Any]:
            return {"messages": [model.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

        return gov, gov.govern(builder_for(answer)).compile(checkpointer=saver), stub

    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sid = req["session"]
        CRASH["now"] = bool(req.get("crash"))
        gov, graph, stub = govs.get(sid) or govs.setdefault(sid, build(sid))
        config = {"configurable": {"thread_id": sid}}
        before = len(stub.billed)
        row: dict[str, Any] = {"pid": os.getpid(), "session": sid, "turn": req["turn"]}
        try:
            with gov.turn(config=config, wait=req.get("wait", 5.0)) as turn:
                graph.invoke({"messages": [question(req["turn"])]}, turn.config)
            row["over"] = sum(s.over for s in turn.state.settled)
        except LedgerError as exc:
            row.update(refusal(exc))
        row["billed"] = sum(stub.billed[before:])
        print(json.dumps(row), flush=True)
    led.close()


async def serve_async(settings: LedgerSettings, db: str) -> None:
    import aiosqlite
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    from ledger.adapters.langgraph import AsyncLedgerGraph

    loop = asyncio.get_running_loop()
    async with (
        AsyncLedger.from_settings(settings) as led,
        # (the fleet's processes share the file: each waits up to 30 s for its lock; under
        # load the default 5 s ran out in CI: "database is locked")
        aiosqlite.connect(db, timeout=30) as conn,
    ):
        saver = AsyncSqliteSaver(conn)
        govs: dict[str, tuple[Any, Any, Stub]] = {}

        async def build(sid: str) -> tuple[Any, Any, Stub]:
            tenant = tenant_of(sid)
            agent = AsyncAgent(await led.session(sid), TOKENS, tenant=tenant, hold_ms=HOLD_MS)
            gov = AsyncLedgerGraph(agent, checkpointer=saver)
            stub = Stub(count=gov.core.prompt_tokens, billed=[])
            model = gov.model(stub)

            async def answer(state: State) -> dict[str, Any]:
                msgs = [SystemMessage(SYSTEM), *state["messages"]]
                return {"messages": [await model.ainvoke(msgs)]}

            return gov, gov.govern(builder_for(answer)).compile(checkpointer=saver), stub

        print(json.dumps({"ready": os.getpid()}), flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            req = json.loads(line)
            sid = req["session"]
            CRASH["now"] = bool(req.get("crash"))
            if sid not in govs:
                govs[sid] = await build(sid)
            gov, graph, stub = govs[sid]
            config = {"configurable": {"thread_id": sid}}
            before = len(stub.billed)
            row: dict[str, Any] = {"pid": os.getpid(), "session": sid, "turn": req["turn"]}
            try:
                async with gov.turn(config=config, wait=req.get("wait", 5.0)) as turn:
                    await graph.ainvoke({"messages": [question(req["turn"])]}, turn.config)
                row["over"] = sum(s.over for s in turn.state.settled)
            except LedgerError as exc:
                row.update(refusal(exc))
            row["billed"] = sum(stub.billed[before:])
            print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--db", required=True)
    ap.add_argument("--face", choices=("sync", "asyncio"), required=True)
    a = ap.parse_args()
    settings = LedgerSettings(redis_url=a.url, prefix=a.prefix)
    if a.face == "sync":
        serve_sync(settings, a.db)
    else:
        asyncio.run(serve_async(settings, a.db))


if __name__ == "__main__":
    main()
