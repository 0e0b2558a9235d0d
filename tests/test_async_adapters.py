"""The LangGraph and LangChain adapters on both faces, against the real packages with a
stub chat model: ``LedgerGraph`` / ``LedgerMiddleware`` (an ``Agent``, ``invoke``) and
``AsyncLedgerGraph`` / ``AsyncLedgerMiddleware`` (an ``AsyncAgent``: async nodes,
``ainvoke``, ``astream``, ``AsyncSqliteSaver``, the middleware's asyncio hooks).

A message written the framework's own way between turns (``update_state`` /
``aupdate_state``) is in the next turn's prompt and in the ledger (each test shows it
lost without the rule that admits it); the asyncio face never blocks the event loop
(a ticker keeps ticking through a turn whose every Redis reply is slow; the sync face
driven from the loop stops it)."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langchain.agents import create_agent
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

import ledger._async.langgraph
import ledger._sync.langgraph
from ledger import (
    Agent,
    AsyncAgent,
    AsyncLedger,
    InvalidArgument,
    Ledger,
    SessionBudget,
    TiktokenCounter,
)
from ledger.adapters.langchain import AsyncLedgerMiddleware, LedgerMiddleware
from ledger.adapters.langgraph import AsyncLedgerGraph, LedgerGraph, merge_docs
from ledger.errors import LostWriteWarning
from tests.support import servers
from tests.support.tcp_proxy import TcpProxy

ROOT = Path(__file__).resolve().parent.parent
TOK = TiktokenCounter()
SYSTEM = "Answer from the documents."
BUDGET = SessionBudget(
    window=8_000, system_prompt=TOK(SYSTEM), output_reserve=500, framing_tolerance=0
)
FACES = ["sync", "asyncio"]
SEEN: list[list[Any]] = []  # every prompt the stub model was sent


def tokens(messages: list[Any]) -> int:
    """The prompt's tokens as the stub model counts them (independent of the ledger):
    each message's text and the tool calls it carries."""
    calls = [json.dumps(m.tool_calls, sort_keys=True, default=str) for m in messages
             if getattr(m, "tool_calls", None)]  # fmt: skip
    return sum(TOK(str(m.content)) for m in messages) + sum(TOK(c) for c in calls)


def schema_tokens(tools: list[Any]) -> int:
    """The tool schemas' tokens, billed with every prompt (the budget's tool_framing)."""
    return sum(TOK(json.dumps(convert_to_openai_tool(t), sort_keys=True)) for t in tools)


class Stub(BaseChatModel):
    """Records every prompt; asks for the search tool after a question (when tools are
    bound), answers otherwise; bills what it was sent. Its asyncio path awaits."""

    tools: int = 0  # the tokens of the tool schemas bound (billed with every prompt)
    pause: float = 0.0
    fail: bool = False  # the provider answers 500

    @property
    def _llm_type(self) -> str:
        return "stub"

    def bind_tools(self, tools: Any, **kw: Any) -> Any:
        return self.model_copy(update={"tools": schema_tokens(tools)})

    def _answer(self, messages: list[Any]) -> ChatResult:
        if self.fail:
            raise RuntimeError("the model provider answered 500")
        SEEN.append(list(messages))
        billed = tokens(messages) + self.tools
        usage = {"input_tokens": billed, "output_tokens": 5, "total_tokens": billed + 5}
        last = messages[-1]
        if self.tools and isinstance(last, HumanMessage):
            call = {"name": "search", "args": {"q": str(last.content)}, "id": uuid.uuid4().hex}
            msg = AIMessage("", tool_calls=[call], usage_metadata=usage, id=uuid.uuid4().hex)
        else:
            msg = AIMessage("It is 42.", usage_metadata=usage, id=uuid.uuid4().hex)
        return ChatResult(generations=[ChatGeneration(message=msg)])

    def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any) -> Any:
        time.sleep(self.pause)
        return self._answer(messages)

    async def _agenerate(
        self, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        await asyncio.sleep(self.pause)
        return self._answer(messages)


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    docs: Annotated[list[Document], merge_docs]


def retrieve(state: State) -> dict[str, Any]:  # a sync node, on both faces
    n = len(state["messages"])
    return {"docs": [Document(f"Fact {n}: the answer is 42.", id=f"https://kb.example/{n}")]}


def prompt_of(state: State) -> list[Any]:
    docs = [SystemMessage(d.page_content) for d in state["docs"]]
    return [SystemMessage(SYSTEM), *docs, *state["messages"]]


def graph_of(gov: Any, saver: Any, pause: float = 0.0, fail: bool = False) -> Any:
    model = gov.model(Stub(pause=pause, fail=fail))
    if isinstance(gov, AsyncLedgerGraph):

        async def answer(state: State) -> dict[str, Any]:  # an async node
            return {"messages": [await model.ainvoke(prompt_of(state))]}
    else:

        def answer(state: State) -> dict[str, Any]:
            return {"messages": [model.invoke(prompt_of(state))]}

    builder = StateGraph(State)
    builder.add_node("retrieve", retrieve)
    builder.add_node("answer", answer)
    builder.add_edge(START, "retrieve")
    builder.add_edge("retrieve", "answer")
    builder.add_edge("answer", END)
    return gov.govern(builder).compile(checkpointer=saver)


@asynccontextmanager
async def saver_of(face: str, path: Path) -> AsyncIterator[Any]:
    if face == "asyncio":
        async with AsyncSqliteSaver.from_conn_string(str(path)) as saver:
            yield saver
    else:
        conn = sqlite3.connect(str(path), check_same_thread=False)
        try:
            yield SqliteSaver(conn)
        finally:
            conn.close()


@asynccontextmanager
async def governed(
    face: str, url: str, sid: str, saver: Any, budget: SessionBudget = BUDGET, **options: Any
) -> AsyncIterator[Any]:
    if face == "asyncio":
        async with AsyncLedger.from_url(url) as aled:
            session = await aled.open_session(sid, budget)
            yield AsyncLedgerGraph(AsyncAgent(session, TOK), checkpointer=saver, **options)
            await session.delete()
    else:
        with Ledger.from_url(url) as led:
            session = led.open_session(sid, budget)
            yield LedgerGraph(Agent(session, TOK), checkpointer=saver, **options)
            session.delete()


async def ask(gov: Any, graph: Any, config: Any, q: str, stream: bool = False) -> Any:
    question = {"messages": [HumanMessage(q, id=q)], "docs": []}
    if isinstance(gov, AsyncLedgerGraph):
        async with gov.turn(config=config) as turn:
            if stream:
                async for _ in graph.astream(question, turn.config):
                    pass
            else:
                await graph.ainvoke(question, turn.config)
    else:
        with gov.turn(config=config) as turn:
            graph.invoke(question, turn.config)
    return turn


async def occupancy(gov: Any) -> int:
    snap = gov.agent.session.snapshot()
    return int((await snap if asyncio.iscoroutine(snap) else snap).occupancy)


async def update(graph: Any, config: Any, values: dict[str, Any]) -> None:
    if isinstance(graph.checkpointer, AsyncSqliteSaver):
        await graph.aupdate_state(config, values)
    else:
        graph.update_state(config, values)


def url_of(request: pytest.FixtureRequest, backend: str) -> str:
    if backend == "redis":
        return str(request.getfixturevalue("redis_server").url)
    if backend == "cluster":
        nodes = request.getfixturevalue("redis_cluster")
        return f"redis+cluster://127.0.0.1:{nodes[0].port}"
    return f"embedded://{uuid.uuid4().hex}"


BACKENDS = [
    pytest.param("embedded", marks=pytest.mark.embedded),
    pytest.param("redis", marks=pytest.mark.redis),
]


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("cluster", marks=pytest.mark.cluster)])
@pytest.mark.parametrize("face", FACES)
async def test_langgraph_turns_on_both_faces(
    face: str, backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Three turns (the last streamed on asyncio) through a sync and an async node; each
    turn's ledger equals the stub's own count of the prompt it was sent, plus its answer."""
    sid = f"lg-{face}-{uuid.uuid4().hex[:6]}"
    config = {"configurable": {"thread_id": sid}}
    async with (
        saver_of(face, tmp_path / "db.sqlite") as saver,
        governed(face, url_of(request, backend), sid, saver) as gov,
    ):
        graph = graph_of(gov, saver)
        for i in range(3):
            SEEN.clear()
            turn = await ask(gov, graph, config, f"q{i}", stream=i == 2)
            assert turn.report.drift == 0 and turn.report.flag == "none"
            assert await occupancy(gov) == tokens(SEEN[-1]) + TOK("It is 42.")
        last = SEEN[-1]  # the whole conversation, from the checkpointer
        assert [m.id for m in last if isinstance(m, HumanMessage)] == ["q0", "q1", "q2"]
        assert sum(isinstance(m, AIMessage) for m in last) == 2


@pytest.mark.embedded
async def test_parallel_async_nodes_start_the_turn_once(tmp_path: Path) -> None:
    """Two async retrieval nodes run in one step (asyncio.gather): the turn's deliveries
    and input are taken once, both nodes' documents are admitted, the ledger equals the
    prompt."""
    sid = f"par-{uuid.uuid4().hex[:6]}"
    config = {"configurable": {"thread_id": sid}}
    async with (
        saver_of("asyncio", tmp_path / "db.sqlite") as saver,
        governed("asyncio", f"embedded://{sid}", sid, saver) as gov,
    ):
        model = gov.model(Stub())

        def fetch(source: str) -> Callable[[State], Awaitable[dict[str, Any]]]:
            async def node(state: State) -> dict[str, Any]:
                await asyncio.sleep(0.01)
                n = len(state["messages"])
                return {"docs": [Document(f"{source} says 42 ({n}).", id=f"{source}-{n}")]}

            return node

        async def answer(state: State) -> dict[str, Any]:
            return {"messages": [await model.ainvoke(prompt_of(state))]}

        builder = StateGraph(State)
        builder.add_node("wiki", fetch("wiki"))
        builder.add_node("sql", fetch("sql"))
        builder.add_node("answer", answer)
        builder.add_edge(START, "wiki")
        builder.add_edge(START, "sql")
        builder.add_edge(["wiki", "sql"], "answer")
        builder.add_edge("answer", END)
        graph = gov.govern(builder).compile(checkpointer=saver)
        for q in ("q1", "q2"):
            SEEN.clear()
            turn = await ask(gov, graph, config, q)
            assert turn.report.drift == 0
            assert await occupancy(gov) == tokens(SEEN[-1]) + TOK("It is 42.")
        assert {d.id for d in (await graph.aget_state(config)).values["docs"]} == {
            "wiki-1", "sql-1", "wiki-3", "sql-3"
        }  # fmt: skip


@pytest.mark.embedded
@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("rule", ["admitted", "without the rule"])
async def test_what_update_state_writes_between_turns_is_the_next_turns(
    face: str, rule: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the checkpointer (each turn pinned to the checkpoint the last turn committed),
    a message added with update_state between turns is in the next turn's prompt and in
    the ledger, and one removed that way leaves both. Without the rule (the turn pinned
    to the committed checkpoint itself) the note never reaches a prompt and the removed
    message stays in it, and nothing says so."""
    if rule != "admitted":
        for face_module in (ledger._async.langgraph, ledger._sync.langgraph):
            monkeypatch.setattr(face_module, "start_after", lambda mark, newer: mark)
    sid = f"upd-{face}-{uuid.uuid4().hex[:6]}"
    config = {"configurable": {"thread_id": sid}}
    note = HumanMessage("Note from the operator: amounts are in euros.", id="note-1")
    async with (
        saver_of(face, tmp_path / "db.sqlite") as saver,
        governed(face, f"embedded://{sid}", sid, saver) as gov,
    ):
        graph = graph_of(gov, saver)
        await ask(gov, graph, config, "q1")
        await update(graph, config, {"messages": [note]})
        sent: list[list[str | None]] = []
        for q in ("q2", "q3"):
            SEEN.clear()
            turn = await ask(gov, graph, config, q)
            sent.append([m.id for m in SEEN[-1]])
            assert turn.report.drift == 0  # the ledger holds what the prompt holds, either way
            assert await occupancy(gov) == tokens(SEEN[-1]) + TOK("It is 42.")
            if q == "q2":  # between turns 2 and 3: the first question taken out
                await update(graph, config, {"messages": [RemoveMessage(id="q1")]})
        if rule == "admitted":
            assert sent[0][-2:] == ["note-1", "q2"] and sent[0].index("q1") < sent[0].index(
                "note-1"
            )
            assert "q1" not in sent[1] and sent[1][-1] == "q3"  # removed: given back
        else:
            assert "note-1" not in sent[0] and "q1" in sent[1]  # lost, silently


@pytest.mark.embedded
@pytest.mark.parametrize("face", FACES)
async def test_a_write_on_a_dead_turns_branch_is_flagged(face: str, tmp_path: Path) -> None:
    """A turn dies after its first node checkpointed (rolled back); a note written then
    with update_state goes on top of the dead turn's checkpoint. The next turn starts
    from the committed state without it, and says so (LostWriteWarning) instead of
    dropping it silently; written again once that turn ended, it is admitted."""
    sid = f"dead-{face}-{uuid.uuid4().hex[:6]}"
    config = {"configurable": {"thread_id": sid}}
    async with (
        saver_of(face, tmp_path / "db.sqlite") as saver,
        governed(face, f"embedded://{sid}", sid, saver) as gov,
    ):
        graph = graph_of(gov, saver)
        await ask(gov, graph, config, "q1")
        broken = graph_of(gov, saver, fail=True)  # its model call fails: the turn dies
        with pytest.raises(RuntimeError):
            await ask(gov, broken, config, "q2")
        note = HumanMessage("Note from the operator: amounts are in euros.", id="note-1")
        await update(graph, config, {"messages": [note]})
        SEEN.clear()
        with pytest.warns(LostWriteWarning, match="rolled back") as caught:
            turn = await ask(gov, graph, config, "q3")
        assert len(caught[0].message.checkpoints) == 1  # type: ignore[union-attr]
        sent = [m.id for m in SEEN[-1]]
        assert "note-1" not in sent and "q2" not in sent and turn.report.drift == 0
        await update(graph, config, {"messages": [note]})  # on the committed state now
        SEEN.clear()
        await ask(gov, graph, config, "q4")
        assert [m.id for m in SEEN[-1]][-2:] == ["note-1", "q4"]


@pytest.mark.embedded
@pytest.mark.parametrize("face", FACES)
async def test_inline_compaction_on_both_faces(face: str, tmp_path: Path) -> None:
    """An agent-owned session with ``summarize=``: once a compaction is pending, the next
    turn's first node replaces the old messages by one summary message (turn.compact),
    which is in that turn's prompt; the ledger equals the prompt on every turn."""
    sid = f"inline-{face}-{uuid.uuid4().hex[:6]}"
    config = {"configurable": {"thread_id": sid}}
    budget = BUDGET.model_copy(update={"window": 1_200, "output_reserve": 100})
    budget = budget.model_copy(update={"compaction": "agent"})
    async with (
        saver_of(face, tmp_path / "db.sqlite") as saver,
        governed(
            face, f"embedded://{sid}", sid, saver, budget,
            summarize=lambda objs: f"Summary of {len(objs)} earlier items.", keep_messages=2,
        ) as gov,
    ):  # fmt: skip
        graph = graph_of(gov, saver)
        for n in range(12):
            SEEN.clear()
            turn = await ask(gov, graph, config, f"q{n}: " + "the figures by region " * 20)
            assert turn.report.drift == 0
            assert await occupancy(gov) == tokens(SEEN[-1]) + TOK("It is 42.")
            sent = [str(m.id) for m in SEEN[-1]]
            if any(i.startswith("summary-") for i in sent):
                asked = [i.split(":")[0] for i in sent if i.startswith("q")]
                assert "q0" not in asked and asked[-1] == f"q{n}", sent
                break
        else:
            raise AssertionError("no compaction in 12 turns")


@pytest.mark.embedded
@pytest.mark.parametrize("name", ["langgraph", "langchain"])
def test_the_async_examples_run_as_their_docstrings_say(name: str) -> None:
    """examples/<name>_async_agent.py on embedded: every turn's ledger equals the stub's
    count of the prompt, and the note added with aupdate_state before turn 4 is in the
    prompts from turn 4 on; its glue is the number of lines its docstring says."""
    example = ROOT / "examples" / f"{name}_async_agent.py"
    out = subprocess.run(
        [sys.executable, str(example), "--turns", "5"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 5, lines
    for n, line in enumerate(lines, 1):
        got = re.fullmatch(
            r"turn \d+: ledger (\d+) = prompt (\d+) \(drift 0\); note in prompt: (\w+)", line
        )
        assert got and got[1] == got[2] and got[3] == str(n >= 4), line
    glue = [x for x in example.read_text().splitlines() if x.endswith("# ledger")]
    assert f"are the glue ({len(glue)} lines)" in example.read_text()


@pytest.mark.embedded
async def test_each_face_refuses_the_other_agent() -> None:
    url = f"embedded://{uuid.uuid4().hex}"
    async with AsyncLedger.from_url(url) as aled:
        async_agent = AsyncAgent(await aled.open_session("faces", BUDGET), TOK)
        with Ledger.from_url(url) as led:
            agent = Agent(led.session("faces"), TOK)
            pairs: list[tuple[Any, Any]] = [
                (AsyncLedgerGraph, agent),
                (AsyncLedgerMiddleware, agent),
                (LedgerGraph, async_agent),
                (LedgerMiddleware, async_agent),
            ]
            for face, other in pairs:
                with pytest.raises(InvalidArgument, match="AsyncLedgerGraph an AsyncAgent"):
                    face(other)


# --- LangChain create_agent --------------------------------------------------------------


@tool
def search(q: str) -> str:
    """Search the knowledge base."""
    return f"Found for {q}: the answer is 42."


@tool
async def asearch(q: str) -> str:
    """Search the knowledge base."""
    await asyncio.sleep(0)
    return f"Found for {q}: the answer is 42."


asearch.name = "search"


async def run_agent(mw: Any, agent: Any, config: Any, q: str) -> Any:
    question = {"messages": [HumanMessage(q, id=q)]}
    if isinstance(mw, AsyncLedgerMiddleware):
        async with mw.turn(config=config) as turn:
            await agent.ainvoke(question, turn.config)
    else:
        with mw.turn(config=config) as turn:
            agent.invoke(question, turn.config)
    return turn


LC_BUDGET = SessionBudget(
    window=8_000,
    system_prompt=TOK(SYSTEM),
    tool_framing=schema_tokens([search]),
    output_reserve=500,
    framing_tolerance=0,
)


@asynccontextmanager
async def lc_governed(
    face: str, url: str, sid: str, saver: Any, pause: float = 0.0
) -> AsyncIterator[tuple[Any, Any]]:
    """The middleware of the face (its session opened) and a create_agent agent with it."""
    if face == "asyncio":
        async with AsyncLedger.from_url(url) as aled:
            session = await aled.open_session(sid, LC_BUDGET)
            mw: Any = AsyncLedgerMiddleware(AsyncAgent(session, TOK), checkpointer=saver)
            yield mw, create_agent(
                Stub(pause=pause), [asearch], system_prompt=SYSTEM, checkpointer=saver,
                middleware=[mw],
            )  # fmt: skip
            await session.delete()
    else:
        with Ledger.from_url(url) as led:
            sync_session = led.open_session(sid, LC_BUDGET)
            mw = LedgerMiddleware(Agent(sync_session, TOK), checkpointer=saver)
            yield mw, create_agent(
                Stub(pause=pause), [search], system_prompt=SYSTEM, checkpointer=saver,
                middleware=[mw],
            )  # fmt: skip
            sync_session.delete()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("rule", ["admitted", "without the rule"])
async def test_langchain_middleware_on_both_faces(
    face: str,
    backend: str,
    rule: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """create_agent with the middleware: a tool call and its answer each turn (the
    asyncio face through ainvoke, an async tool and the a* hooks); a message added with
    update_state between turns is in the next prompt and the ledger."""
    if rule != "admitted":
        for face_module in (ledger._async.langgraph, ledger._sync.langgraph):
            monkeypatch.setattr(face_module, "start_after", lambda mark, newer: mark)
    sid = f"lc-{face}-{uuid.uuid4().hex[:6]}"
    config = {"configurable": {"thread_id": sid}}
    note = HumanMessage("Note from the operator: amounts are in euros.", id="note-1")
    async with (
        saver_of(face, tmp_path / "db.sqlite") as saver,
        lc_governed(face, url_of(request, backend), sid, saver) as (mw, agent),
    ):
        await run_agent(mw, agent, config, "q1")
        await update(agent, config, {"messages": [note]})
        SEEN.clear()
        turn = await run_agent(mw, agent, config, "q2")
        assert turn.report.drift == 0 and turn.report.flag == "none"
        last = SEEN[-1]
        assert isinstance(last[-1], ToolMessage)  # the second call: after the tool
        assert mw.tool_tokens([search]) == LC_BUDGET.tool_framing
        assert await occupancy(mw.graph) == tokens(last) + TOK("It is 42.") + LC_BUDGET.tool_framing
        sent = [m.id for m in last]
        assert ("note-1" in sent) is (rule == "admitted"), sent


# --- the event loop ----------------------------------------------------------------------


@contextmanager
def slow_redis(server: servers.RedisProcess, delay: float) -> Iterator[str]:
    """The server behind a proxy that holds every reply back ``delay`` seconds."""
    with TcpProxy(server.port, delay=delay, delay_rate=1.0) as proxy:
        yield proxy.url


@asynccontextmanager
async def adapter(
    kind: str, face: str, url: str, sid: str, saver: Any, pause: float
) -> AsyncIterator[Callable[[str], Awaitable[Any]]]:
    """One turn of the LangGraph graph or the LangChain agent, as a function of its question."""
    config = {"configurable": {"thread_id": sid}}
    if kind == "langgraph":
        async with governed(face, url, sid, saver) as gov:
            graph = graph_of(gov, saver, pause=pause)
            yield lambda q: ask(gov, graph, config, q)
    else:
        async with lc_governed(face, url, sid, saver, pause) as (mw, agent):
            yield lambda q: run_agent(mw, agent, config, q)


@pytest.mark.redis
@pytest.mark.parametrize("kind", ["langgraph", "langchain"])
async def test_the_asyncio_face_never_blocks_the_event_loop(
    kind: str, redis_server: servers.RedisProcess, tmp_path: Path
) -> None:
    """A ticker task ticks every 5 ms while a turn runs whose every Redis reply takes
    40 ms and whose model calls take 100 ms: on the asyncio face it keeps ticking
    through the turn; the sync face, driven from the same loop, stops it."""
    delay = 0.04
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.005)

    async def timed(face: str) -> tuple[int, float]:
        sid = f"tick-{face}-{uuid.uuid4().hex[:6]}"
        with slow_redis(redis_server, delay) as url:
            async with (
                saver_of(face, tmp_path / f"{face}.sqlite") as saver,
                adapter(kind, face, url, sid, saver, 0.1) as turn,
            ):
                await turn("warm-up")  # scripts loaded, connections made
                task = asyncio.create_task(ticker())
                await asyncio.sleep(0.02)
                ticks.clear()
                start = time.monotonic()
                await turn("q1")
                took = time.monotonic() - start
                task.cancel()
                return len(ticks), took

    ticked, took = await timed("asyncio")
    assert took > 0.1 + 5 * delay  # the turn waited on Redis, at least a few round trips
    assert ticked >= 0.3 * took / 0.005, (ticked, took)  # kept ticking (5 ms each, with margin)
    held, took_sync = await timed("sync")
    assert took_sync > 0.1 + 5 * delay and held <= 2, (held, took_sync)  # the loop was held
    print(f"{kind}: asyncio turn {took:.2f} s, {ticked} ticks; sync {took_sync:.2f} s, {held}")
