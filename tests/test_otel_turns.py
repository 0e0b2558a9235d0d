"""A turn's billed usage reaches OpenTelemetry with no glue
(docs/ceilings.md#a-turns-usage-on-its-span): with a tenant named, the agent layer sums
the usage its model calls were billed (``turn.usage``) and sets it, with the window's
composition, on the span current at the turn's end, in every adapter. Checked with the
real opentelemetry-sdk (an in-memory exporter), the real LangGraph and LangChain packages
and a stub model that reports known usage, on a real redis-server, on both faces;
without a span, without a tenant, and without opentelemetry, a turn is as before."""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as semconv
from opentelemetry.trace import Tracer
from pydantic import Field

from ledger import (
    Agent,
    AsyncAgent,
    AsyncLedger,
    Ledger,
    ScopeBudget,
    SessionBudget,
    TiktokenCounter,
)
from ledger.agent import telemetry
from ledger.models import Consumer, Snapshot, Usage

pytestmark = pytest.mark.redis
DAY = 86_400_000
OUT = 30  # output tokens each stub answer reports billed
CACHED = 4  # input tokens each stub answer reports read from the provider's cache
tokens = TiktokenCounter()
SYSTEM = "Answer in one word."
GEN_AI = {
    semconv.GEN_AI_USAGE_INPUT_TOKENS,
    semconv.GEN_AI_USAGE_OUTPUT_TOKENS,
    semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
    semconv.GEN_AI_CONVERSATION_ID,
}


class Stub(BaseChatModel):
    """Answers each prompt with a message reporting its billed usage: the prompt's tokens
    as the agent counts them (``count``), CACHED of them cache reads, and OUT output
    tokens. ``billed`` keeps each call's input tokens."""

    count: Any = None
    billed: list[int] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "stub"

    def bind_tools(self, tools: Any, **kw: Any) -> Any:
        return self

    def _generate(
        self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> ChatResult:
        n = self.count(messages)
        assert n > CACHED
        self.billed.append(n)
        usage = {
            "input_tokens": n,
            "output_tokens": OUT,
            "total_tokens": n + OUT,
            "input_token_details": {"cache_read": CACHED},
        }
        msg = AIMessage(
            f"Yes {len(self.billed)}", id=f"ai-{len(self.billed)}", usage_metadata=usage
        )  # type: ignore[arg-type]
        return ChatResult(generations=[ChatGeneration(message=msg)])


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def budget() -> SessionBudget:
    return SessionBudget(window=8_000, system_prompt=tokens(SYSTEM), output_reserve=100)


def tracing() -> tuple[Tracer, InMemorySpanExporter]:
    """A tracer of the real SDK whose ended spans the exporter keeps (no global provider)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def two_calls(model: Any, asynchronous: bool) -> StateGraph[Any]:
    """A graph of two nodes, each calling the model once (a turn of two billed calls)."""
    builder = StateGraph(State)
    for name in ("first", "second"):
        if asynchronous:

            async def node(state: State) -> dict[str, Any]:
                return {
                    "messages": [await model.ainvoke([SystemMessage(SYSTEM), *state["messages"]])]
                }

        else:

            def node(state: State) -> dict[str, Any]:  # type: ignore[misc]
                return {"messages": [model.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

        builder.add_node(name, node)
    builder.add_edge(START, "first")
    builder.add_edge("first", "second")
    builder.add_edge("second", END)
    return builder


def summed(billed: list[int]) -> Usage:
    """What calls billed ``billed`` input tokens each (CACHED of them cached) sum to."""
    n = len(billed)
    return Usage(input=sum(billed) - n * CACHED, output=n * OUT, cached_input=n * CACHED)


def on_span(
    span: ReadableSpan, sid: str, billed: list[int], snap: Snapshot, committed: bool = True
) -> None:
    """The span holds the turn's summed usage, each quantity under one name, the turn's
    number, and the window's composition under ``ledger.window.`` as the ledger reads it
    after the turn (rolled back: holding none of the turn's items)."""
    got = dict(span.attributes or {})
    assert got.pop("ledger.turn") == 1  # each test's first turn
    assert got[semconv.GEN_AI_USAGE_INPUT_TOKENS] == sum(billed)  # cached reads included
    assert got[semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == CACHED * len(billed)
    assert got[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == OUT * len(billed)
    assert got[semconv.GEN_AI_CONVERSATION_ID] == sid
    assert {k for k in got if k.startswith("gen_ai.")} == GEN_AI
    assert all(k.startswith(("gen_ai.", "ledger.window.")) for k in got), got
    wm = Consumer.WORKING_MEMORY.value
    assert got["ledger.window.size"] == 8_000 and got["ledger.window.free"] == snap.free
    used = snap.used[Consumer.WORKING_MEMORY]
    assert got[f"ledger.window.{wm}.used"] == used and (used > 0) is committed  # rolled back: 0
    assert got[f"ledger.window.{wm}.reserved"] == 0  # every hold settled
    assert got["ledger.window.system_prompt"] == tokens(SYSTEM)


def new_tenant(led: Ledger) -> str:
    tenant = f"t{uuid.uuid4().hex[:10]}"
    led.set_scope(tenant, ScopeBudget(window_ms=DAY, tokens=100_000))
    return tenant


def test_langgraph_turn_sets_its_summed_usage_on_the_current_span(redis_server: Any) -> None:
    from ledger.adapters.langgraph import LedgerGraph

    led = Ledger.from_url(redis_server.url)
    tenant = new_tenant(led)
    session = led.open_session(f"@{tenant}/lg", budget())
    gov = LedgerGraph(Agent(session, tokens), tenant=tenant)
    stub = Stub(count=gov.core.prompt_tokens, billed=[])
    graph = gov.govern(two_calls(gov.model(stub), asynchronous=False)).compile()
    tracer, exporter = tracing()
    with tracer.start_as_current_span("turn"), gov.turn() as turn:
        graph.invoke({"messages": [HumanMessage("Is it?", id="q1")]})
    assert len(stub.billed) == 2 and turn.usage == summed(stub.billed)
    (span,) = exporter.get_finished_spans()
    on_span(span, session.id, stub.billed, session.snapshot())
    charged = led.scope_usage(tenant).charged
    assert charged["output"] == turn.usage.output  # what the tenant was charged, no more
    # the next turn has only its own calls; with no span current, nothing to set it on
    first = list(stub.billed)
    with gov.turn() as again:
        graph.invoke({"messages": [HumanMessage("And now?", id="q2")]})
    assert again.report is not None and again.usage == summed(stub.billed[len(first) :])
    assert len(exporter.get_finished_spans()) == 1


def test_langgraph_asyncio_turn_sets_its_summed_usage_on_the_current_span(
    redis_server: Any,
) -> None:
    from ledger.adapters.langgraph import AsyncLedgerGraph

    async def main() -> None:
        async with AsyncLedger.from_url(redis_server.url) as led:
            tenant = f"t{uuid.uuid4().hex[:10]}"
            await led.set_scope(tenant, ScopeBudget(window_ms=DAY, tokens=100_000))
            session = await led.open_session(f"@{tenant}/lga", budget())
            gov = AsyncLedgerGraph(AsyncAgent(session, tokens), tenant=tenant)
            stub = Stub(count=gov.core.prompt_tokens, billed=[])
            graph = gov.govern(two_calls(gov.model(stub), asynchronous=True)).compile()
            tracer, exporter = tracing()
            with tracer.start_as_current_span("turn"):
                async with gov.turn() as turn:
                    await graph.ainvoke({"messages": [HumanMessage("Is it?", id="q1")]})
            assert len(stub.billed) == 2 and turn.usage == summed(stub.billed)
            (span,) = exporter.get_finished_spans()
            on_span(span, session.id, stub.billed, await session.snapshot())
            async with gov.turn() as again:  # no span: the turn ends as before
                await graph.ainvoke({"messages": [HumanMessage("And now?", id="q2")]})
            assert again.report is not None and again.usage == summed(stub.billed[2:])
            await session.delete()

    asyncio.run(main())


def test_langchain_create_agent_turn_sets_its_usage_on_the_span_on_both_faces(
    redis_server: Any,
) -> None:
    """The middleware (``create_agent``) goes through the same turn: no glue either."""
    from langchain.agents import create_agent

    from ledger.adapters.langchain import AsyncLedgerMiddleware, LedgerMiddleware

    led = Ledger.from_url(redis_server.url)
    tenant = new_tenant(led)
    session = led.open_session(f"@{tenant}/lc", budget())
    middleware = LedgerMiddleware(Agent(session, tokens), tenant=tenant)
    stub = Stub(count=middleware.agent.core.prompt_tokens, billed=[])
    agent = create_agent(stub, tools=[], system_prompt=SYSTEM, middleware=[middleware])
    tracer, exporter = tracing()
    with tracer.start_as_current_span("turn"), middleware.turn() as turn:
        agent.invoke({"messages": [HumanMessage("Is it?", id="q1")]})
    assert turn.usage == summed(stub.billed) and len(stub.billed) == 1
    (span,) = exporter.get_finished_spans()
    on_span(span, session.id, stub.billed, session.snapshot())

    async def main() -> None:
        async with AsyncLedger.from_url(redis_server.url) as aled:
            s = await aled.open_session(f"@{tenant}/lca", budget())
            mw = AsyncLedgerMiddleware(AsyncAgent(s, tokens), tenant=tenant)
            astub = Stub(count=mw.agent.core.prompt_tokens, billed=[])
            agent = create_agent(astub, tools=[], system_prompt=SYSTEM, middleware=[mw])
            with tracer.start_as_current_span("async turn"):
                async with mw.turn() as turn:
                    await agent.ainvoke({"messages": [HumanMessage("Is it?", id="q1")]})
            assert turn.usage == summed(astub.billed) and len(astub.billed) == 1
            span = exporter.get_finished_spans()[-1]
            assert span.name == "async turn"
            on_span(span, s.id, astub.billed, await s.snapshot())
            await s.delete()

    asyncio.run(main())


def test_no_tenant_no_usage_and_no_read_on_the_span(redis_server: Any) -> None:
    """With no tenant named, no call is settled: ``usage`` is None, the span gets nothing
    and the turn's end makes no extra read."""
    from ledger.adapters.langgraph import LedgerGraph

    led = Ledger.from_url(redis_server.url)
    session = led.open_session(f"plain-{uuid.uuid4().hex[:8]}", budget())
    gov = LedgerGraph(Agent(session, tokens))
    stub = Stub(count=gov.core.prompt_tokens, billed=[])
    graph = gov.govern(two_calls(gov.model(stub), asynchronous=False)).compile()
    reads: list[int] = []
    snapshot = session.snapshot

    def counted() -> Snapshot:
        reads.append(1)
        return snapshot()

    session.snapshot = counted  # type: ignore[method-assign]
    tracer, exporter = tracing()
    with tracer.start_as_current_span("turn"), gov.turn() as turn:
        graph.invoke({"messages": [HumanMessage("Is it?", id="q1")]})
        before = len(reads)  # the adapter's own read as the turn began
    assert turn.report is not None and turn.usage is None and len(stub.billed) == 2
    assert len(reads) == before
    (span,) = exporter.get_finished_spans()
    assert not span.attributes


def test_without_opentelemetry_a_turn_ends_as_before(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """opentelemetry-api not importable: a recording span or not, the turn ends, its
    usage kept on the turn, and nothing is set (no OpenTelemetry import is attempted)."""
    from ledger.adapters.langgraph import LedgerGraph

    led = Ledger.from_url(redis_server.url)
    tenant = new_tenant(led)
    session = led.open_session(f"@{tenant}/none", budget())
    gov = LedgerGraph(Agent(session, tokens), tenant=tenant)
    stub = Stub(count=gov.core.prompt_tokens, billed=[])
    graph = gov.govern(two_calls(gov.model(stub), asynchronous=False)).compile()
    tracer, exporter = tracing()
    telemetry._trace.cache_clear()
    try:
        monkeypatch.setitem(sys.modules, "opentelemetry", None)  # import fails
        with tracer.start_as_current_span("turn"):
            assert telemetry.recording_span() is None
            with gov.turn() as turn:
                graph.invoke({"messages": [HumanMessage("Is it?", id="q1")]})
    finally:
        monkeypatch.undo()
        telemetry._trace.cache_clear()
    assert turn.report is not None and turn.usage == summed(stub.billed)
    (span,) = exporter.get_finished_spans()
    assert not span.attributes
    with tracer.start_as_current_span("again"):  # importable again: found
        assert telemetry.recording_span() is not None


def test_the_span_processor_does_not_record_a_turns_sum_as_a_call(redis_server: Any) -> None:
    """``LedgerSpanProcessor`` on the same provider records GenAI call spans; the turn's
    span, carrying its summed usage (``ledger.turn``), is not a call: not recorded again."""
    from ledger.adapters.langgraph import LedgerGraph
    from ledger.adapters.otel import LedgerSpanProcessor

    led = Ledger.from_url(redis_server.url)
    tenant = new_tenant(led)
    session = led.open_session(f"@{tenant}/proc", budget())
    gov = LedgerGraph(Agent(session, tokens), tenant=tenant)
    stub = Stub(count=gov.core.prompt_tokens, billed=[])
    graph = gov.govern(two_calls(gov.model(stub), asynchronous=False)).compile()
    exporter = InMemorySpanExporter()
    processor = LedgerSpanProcessor(session)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("test").start_as_current_span("turn"), gov.turn() as turn:
        graph.invoke({"messages": [HumanMessage("Is it?", id="q1")]})
    (span,) = exporter.get_finished_spans()
    assert turn.report is not None and turn.report.spans == 0
    on_span(span, session.id, stub.billed, session.snapshot())
    assert processor.recorded == 0 and not processor.errors
    with provider.get_tracer("test").start_as_current_span("chat") as call:  # a call's span
        call.set_attributes({semconv.GEN_AI_USAGE_INPUT_TOKENS: 10})
    assert processor.recorded + len(processor.errors) == 1  # what it does record


def test_agents_sdk_turn_sets_its_usage_on_the_span(redis_server: Any) -> None:
    """The Agents SDK adapter (``LedgerAgents``, asyncio) goes through the same turn."""
    from agents import Agent as SdkAgent
    from agents import Model, ModelResponse, Runner, set_tracing_disabled
    from agents import Usage as SdkUsage
    from agents.testing import assistant_message
    from openai.types.responses.response_usage import InputTokensDetails

    from ledger.adapters.openai_agents import LedgerAgents

    set_tracing_disabled(True)  # the SDK's own tracing; OpenTelemetry is the test's
    billed: list[int] = []

    class SdkStub(Model):
        async def get_response(self, *a: Any, **k: Any) -> ModelResponse:
            n = gov.last_counted or 0
            billed.append(n)
            usage = SdkUsage(
                requests=1,
                input_tokens=n,
                output_tokens=OUT,
                total_tokens=n + OUT,
                input_tokens_details=InputTokensDetails(cached_tokens=CACHED, cache_write_tokens=0),
            )
            out = [assistant_message("Yes", item_id=f"msg-{len(billed)}")]
            return ModelResponse(output=out, usage=usage, response_id=None)

        def stream_response(self, *a: Any, **k: Any) -> Any:
            raise NotImplementedError

    async def main() -> None:
        nonlocal gov
        tenant = f"t{uuid.uuid4().hex[:10]}"
        async with AsyncLedger.from_url(redis_server.url) as led:
            await led.set_scope(tenant, ScopeBudget(window_ms=DAY, tokens=100_000))
            session = await led.open_session(f"@{tenant}/sdk", budget())
            gov = LedgerAgents(AsyncAgent(session, tokens), tenant=tenant)
            agent = SdkAgent(name="a", instructions=SYSTEM, model=SdkStub())
            tracer, exporter = tracing()
            with tracer.start_as_current_span("run"):
                async with gov.turn() as turn:
                    await Runner.run(
                        agent,
                        "Is it?",
                        session=gov.session,
                        run_config=gov.run_config(),
                        hooks=gov.hooks,
                    )
            assert len(billed) == 1 and turn.usage == summed(billed)
            (span,) = exporter.get_finished_spans()
            on_span(span, session.id, billed, await session.snapshot())
            await session.delete()

    gov: Any = None
    asyncio.run(main())


def test_a_rolled_back_turn_sets_what_its_calls_were_billed(redis_server: Any) -> None:
    """A turn that raises after a billed call is rolled back, but the tenant keeps the
    call's charge: its usage is set on the span all the same, as the scope charged it."""
    from ledger.adapters.langgraph import LedgerGraph

    led = Ledger.from_url(redis_server.url)
    tenant = new_tenant(led)
    session = led.open_session(f"@{tenant}/rb", budget())
    gov = LedgerGraph(Agent(session, tokens), tenant=tenant)
    stub = Stub(count=gov.core.prompt_tokens, billed=[])
    model = gov.model(stub)

    def answer(state: State) -> dict[str, Any]:
        return {"messages": [model.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

    def tool(state: State) -> dict[str, Any]:
        raise RuntimeError("the tool is down")

    builder = StateGraph(State)
    builder.add_node("answer", answer)
    builder.add_node("tool", tool)
    builder.add_edge(START, "answer")
    builder.add_edge("answer", "tool")
    builder.add_edge("tool", END)
    graph = gov.govern(builder).compile()
    tracer, exporter = tracing()
    with (
        pytest.raises(RuntimeError, match="tool is down"),
        tracer.start_as_current_span("turn"),
        gov.turn() as turn,
    ):
        graph.invoke({"messages": [HumanMessage("Is it?", id="q1")]})
    assert turn.state is not None and turn.state.aborted is not None and turn.report is None
    assert len(stub.billed) == 1 and turn.usage == summed(stub.billed)
    assert led.scope_usage(tenant).charged["output"] == OUT  # the settle stays charged
    (span,) = exporter.get_finished_spans()
    on_span(span, session.id, stub.billed, session.snapshot(), committed=False)
