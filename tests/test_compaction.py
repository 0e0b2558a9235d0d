"""Compaction end to end: the agent layer stores content, the worker's LLM summarizer
reads it, the summary reaches the agent's next turn, and summaries run concurrently."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.memory import MemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from ledger import Agent, Ledger, SessionBudget
from ledger.adapters.langgraph import LedgerGraph
from ledger.adapters.summarizer import LLMSummarizer
from ledger.models import Consumer, HeldItem
from ledger.workers.compactors import CompactionRequest
from tests.support import jobs


def words(text: str) -> int:
    """The counter of these tests: one token per word (the agent and the summarizer
    count alike)."""
    return len(text.split())


SYSTEM = "You are a helpful assistant."
BUDGET = SessionBudget(
    window=4_000, system_prompt=words(SYSTEM), output_reserve=200, framing_tolerance=0
)


class StubModel:
    """A chat model stub: answers a summary of the words it was given after ``delay``
    seconds; counts calls in flight."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.in_flight = 0
        self.most = 0
        self.calls = 0
        self.lock = threading.Lock()

    async def ainvoke(self, messages: list[dict[str, str]]) -> AIMessage:
        with self.lock:
            self.in_flight += 1
            self.calls += 1
            self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            n = words(messages[-1]["content"])
            return AIMessage(f"summary of {n} words " + "gist " * 20)
        finally:
            with self.lock:
                self.in_flight -= 1


stub = StubModel()
summarizer = LLMSummarizer(stub, words)
slow_stub = StubModel(delay=1.0)
slow_summarizer = LLMSummarizer(slow_stub, words)


def message(n: int) -> dict[str, str]:
    return {"id": f"m{n}", "role": "user", "content": f"turn {n} " + "word " * 600}


def test_summarizer_over_a_langchain_chat_model() -> None:
    model = GenericFakeChatModel(messages=iter([AIMessage("the gist: 42")]))
    s = LLMSummarizer(model, words, keep_last=1)
    items = tuple(
        HeldItem(
            consumer=Consumer.WORKING_MEMORY, id=f"m{k}", tokens=100, turn=k, priority=0, seq=k + 1
        )
        for k in range(3)
    )
    req = CompactionRequest(
        session_id="s",
        epoch=1,
        turn=3,
        items=items,
        occupancy=300,
        high_water_mark=200,
        window=1000,
        contents={"w:m0": "zero", "w:m1": "one", "w:m2": "two"},
    )
    plan = asyncio.run(s(req))
    assert plan.replaced == ((Consumer.WORKING_MEMORY, "m0"), (Consumer.WORKING_MEMORY, "m1"))
    assert plan.summary_text == "the gist: 42" and plan.summary is not None
    assert plan.summary.tokens == words("the gist: 42") and plan.summary.priority == 1000
    # items whose text was never stored are not replaced: nothing to summarize
    bare = dataclasses.replace(req, contents={})
    assert asyncio.run(s(bare)).replaced == ()


def test_summary_reaches_the_next_turn(ledger: Ledger) -> None:
    """A worker-owned session: every compaction's summary is in the next turn's prompt,
    what it replaced is out, and the ledger equals the real prompt after every turn."""
    session = ledger.open_session("comp/e2e", BUDGET)
    agent = Agent(session, words)
    worker = jobs.new_worker(ledger, compactor="tests.test_compaction:summarizer")
    prompt: list[Any] = []
    compactions = applied = 0
    for n in range(12):
        with agent.turn() as turn:
            gone = {id(o) for o in turn.dropped}
            if turn.summaries:
                applied += len(turn.summaries)
                assert gone, "a summary replaces something"
            prompt = [o for o in prompt if id(o) not in gone] + list(turn.summaries)
            got = turn.admit("working_memory", [message(n)])
            prompt += list(got.kept)
            turn.prompt([SYSTEM, *prompt])
        assert turn.report is not None and turn.report.drift == 0, turn.report
        if turn.report.compaction_due:
            compactions += 1
            jobs.drain(ledger, worker)
        held = {i.id for i in ledger.items("comp/e2e")}
        in_prompt = {o["id"] for o in prompt}
        if not turn.report.compaction_due:
            assert held == in_prompt
    assert compactions >= 2 and applied == compactions
    assert session.audit().clean
    worker.close()


def test_agent_owned_sessions_store_no_content(ledger: Ledger) -> None:
    b = BUDGET.model_copy(update={"compaction": "agent"})
    session = ledger.open_session("comp/agent", b)
    agent = Agent(session, words)
    with agent.turn() as turn:
        turn.admit("working_memory", [message(0)])
        turn.prompt([SYSTEM, message(0)])
    assert not ledger.client.exists(session.keys.content)
    owned = ledger.open_session("comp/worker", BUDGET)
    with Agent(owned, words).turn() as turn:
        turn.admit("working_memory", [message(0)])
        turn.prompt([SYSTEM, message(0)])
    assert ledger.client.hget(owned.keys.content, "w:m0") == message(0)["content"].encode()
    assert 0 < ledger.client.pttl(owned.keys.content) <= BUDGET.idle_ttl_seconds * 1000


@pytest.mark.slow
@pytest.mark.redis
def test_summaries_run_concurrently(redis_server: Any) -> None:
    """32 due compactions, a 1 s summarizer, one worker: the summaries overlap (up to
    max_in_flight), they do not queue one after the other."""
    from ledger import LedgerSettings

    settings = LedgerSettings(redis_url=redis_server.url, prefix="conc32")
    with Ledger.from_settings(settings) as led:
        for k in range(32):
            s = led.open_session(f"c{k}", BUDGET)
            agent = Agent(s, words)
            with agent.turn() as turn:
                msgs = [message(10 * k + j) for j in range(6)]
                turn.admit("working_memory", msgs)
                turn.prompt([SYSTEM, *msgs])
            assert turn.report is not None and turn.report.compaction_due
        worker = jobs.new_worker(
            led, compactor="tests.test_compaction:slow_summarizer", max_in_flight=32
        )
        slow_stub.most = slow_stub.calls = 0
        t0 = time.perf_counter()
        jobs.drain(led, worker, timeout=60)
        wall = time.perf_counter() - t0
        worker.close()
        print(f"32 compactions with a 1 s summarizer: {wall:.2f} s wall, {slow_stub.most} at once")
        assert slow_stub.calls == 32
        assert slow_stub.most >= 16  # sequential would be 1
        assert all(led.session(f"c{k}").snapshot().raw["kn"] == 1 for k in range(32))


@pytest.mark.slow
@pytest.mark.redis
def test_e2e_two_agent_processes_worker_killed(redis_server: Any) -> None:
    """bench/compaction_e2e.py, shortened: two agent processes alternate turns, a stub
    LLM summarizer (0.5-2 s) in a worker process killed with SIGKILL once."""
    from bench import compaction_e2e

    res = compaction_e2e.run(redis_server.url, turns=24, kills=1)
    assert res["failures"] == [], res
    assert res["agent_processes"] == 2 and res["worker_kills"] == 1
    assert res["compactions"] >= 2 and res["max_abs_drift"] == 0 and res["resets"] == 0


def test_openai_compatible_chat_and_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """openai_from_env: refuses without its settings; with them, one POST per summary to
    an OpenAI-compatible endpoint (a stub transport here)."""
    import httpx

    from ledger.adapters import summarizer as mod
    from ledger.errors import ConfigurationError

    monkeypatch.delenv("LEDGER_SUMMARIZER_BASE_URL", raising=False)
    with pytest.raises(ConfigurationError, match="LEDGER_SUMMARIZER_BASE_URL"):
        mod._FromEnv().make()
    seen: list[dict[str, Any]] = []

    def reply(request: httpx.Request) -> httpx.Response:
        import json

        seen.append({"url": str(request.url), **json.loads(request.content)})
        return httpx.Response(200, json={"choices": [{"message": {"content": "short gist"}}]})

    real = httpx.AsyncClient
    monkeypatch.setattr(
        httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(reply), **kw)
    )
    chat = mod.OpenAICompatibleChat("http://llm.local/v1/", "m1", api_key="k")
    s = LLMSummarizer(chat, words, keep_last=0)
    items = (
        HeldItem(consumer=Consumer.WORKING_MEMORY, id="m0", tokens=100, turn=1, priority=0, seq=1),
    )
    plan = asyncio.run(
        s(
            CompactionRequest(
                session_id="s",
                epoch=1,
                turn=2,
                items=items,
                occupancy=100,
                high_water_mark=50,
                window=1000,
                contents={"w:m0": "x"},
            )
        )
    )
    assert plan.summary_text == "short gist" and plan.summary is not None
    assert seen[0]["url"] == "http://llm.local/v1/chat/completions" and seen[0]["model"] == "m1"


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def test_langgraph_applies_the_workers_summary(ledger: Ledger) -> None:
    """A LangGraph agent on a worker-owned session: the worker's summary enters the
    graph's state as a system message, the messages it replaced leave it, drift 0."""
    session = ledger.open_session("comp/lg", BUDGET)
    gov = LedgerGraph(Agent(session, words))
    model = gov.model(
        GenericFakeChatModel(messages=iter([AIMessage("ok", id=f"a{i}") for i in range(20)]))
    )

    def answer(state: State) -> dict[str, Any]:
        return {"messages": [model.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

    builder = StateGraph(State)  # the first node's update carries the ledger's changes
    builder.add_node("plan", lambda state: {})
    builder.add_node("answer", answer)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "answer")
    builder.add_edge("answer", END)
    graph = gov.govern(builder).compile(checkpointer=MemorySaver())
    config: Any = {"configurable": {"thread_id": "t"}}
    worker = jobs.new_worker(ledger, compactor="tests.test_compaction:summarizer")
    compacted_at = None
    for n in range(8):
        with gov.turn() as turn:
            graph.invoke({"messages": [HumanMessage("word " * 500, id=f"q{n}")]}, config)
        assert turn.report is not None and turn.report.drift == 0, turn.report
        ids = [m.id for m in graph.get_state(config).values["messages"]]
        if compacted_at is not None and n == compacted_at + 1:
            assert any(str(i).startswith("summary-") for i in ids), ids
            assert "q0" not in ids
        if turn.report.compaction_due and compacted_at is None:
            compacted_at = n
            jobs.drain(ledger, worker)
    assert compacted_at is not None
    assert {i.id for i in ledger.items("comp/lg")} == set(
        str(m.id) for m in graph.get_state(config).values["messages"]
    )
    worker.close()
