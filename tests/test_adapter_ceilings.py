"""A tenant's ceilings in every adapter (docs/ceilings.md#in-an-adapter), with the real
framework packages and stub models on a real redis-server: each model call holds its
worst case (the prompt counted plus the output reserve) in the session and the tenant in
one script before the call, is settled with the usage the model reports billed after it
(more than held: charged and reported), and is voided when the call raises; a call that
would pass the ceiling is refused with ``CeilingReached`` before the model is called.
With no tenant named, a turn makes no call it did not make before."""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from ledger import (
    Agent,
    AsyncAgent,
    AsyncLedger,
    CeilingReached,
    InvalidArgument,
    Ledger,
    ScopeBudget,
    SessionBudget,
    TiktokenCounter,
)
from ledger.models import ScopeUsage

DAY = 86_400_000
RESERVE = 100  # the output reserve: what a hold adds to the prompt
OUT = 150  # what the stub bills for its answer: 50 past the hold, charged all the same
CEILING = 700  # turn 1 (a short question) fits, turn 2 (a 600-token one) does not

pytestmark = pytest.mark.redis
tokens = TiktokenCounter()
SYSTEM = "Answer in one word."
LONG = "word " * 600


class Stub(BaseChatModel):
    """Answers each prompt with one message reporting its billed usage: the prompt's
    tokens as the agent counts them (``count``) and ``OUT`` output tokens; raises when
    told to. ``calls`` counts the prompts it was sent."""

    count: Any = None
    fail: bool = False
    calls: int = 0

    @property
    def _llm_type(self) -> str:
        return "stub"

    def bind_tools(self, tools: Any, **kw: Any) -> Any:
        return self

    def _generate(
        self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> ChatResult:
        self.calls += 1
        if self.fail:
            raise RuntimeError("the provider is down")
        n = self.count(messages)
        usage = {"input_tokens": n, "output_tokens": OUT, "total_tokens": n + OUT}
        msg = AIMessage("Yes", id=f"ai-{self.calls}", usage_metadata=usage)  # type: ignore[arg-type]
        return ChatResult(generations=[ChatGeneration(message=msg)])


def tenant_ledger(url: str) -> tuple[Ledger, str]:
    """A ledger and a fresh tenant with a token ceiling of CEILING a day."""
    led = Ledger.from_url(url)
    tenant = f"t{uuid.uuid4().hex[:10]}"
    led.set_scope(tenant, ScopeBudget(window_ms=DAY, tokens=CEILING))
    return led, tenant


def budget() -> SessionBudget:
    return SessionBudget(window=8_000, system_prompt=tokens(SYSTEM), output_reserve=RESERVE)


def settled_as_billed(usage: ScopeUsage, billed_input: int) -> None:
    assert usage.charged["input"] == billed_input and usage.charged["output"] == OUT
    assert usage.open_holds == 0 and usage.held.get("input", 0) == 0
    assert usage.over == OUT - RESERVE  # billed past the hold: charged and reported
    assert usage.remaining["tokens"] == CEILING - billed_input - OUT


def nothing_held(led: Ledger, tenant: str, sid: str, remaining: int) -> None:
    usage = led.scope_usage(tenant)
    assert usage.open_holds == 0 and usage.remaining["tokens"] == remaining
    assert not any(k.startswith(b"r:") for k in led.client.hkeys(led.session(sid).keys.session))


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def langgraph_app(led: Ledger, sid: str, **tenant: Any) -> tuple[Any, Any, Stub]:
    from ledger.adapters.langgraph import LedgerGraph

    session = led.open_session(sid, budget())
    gov = LedgerGraph(Agent(session, tokens, **tenant))
    stub = Stub(count=gov.core.prompt_tokens)
    model = gov.model(stub)

    def answer(state: State) -> dict[str, Any]:
        return {"messages": [model.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

    builder = StateGraph(State)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    builder.add_edge("answer", END)
    return gov, gov.govern(builder).compile(), stub


def test_langgraph_tenant_ceiling_holds_settles_refuses_and_voids(redis_server: Any) -> None:
    led, tenant = tenant_ledger(redis_server.url)
    sid = f"@{tenant}/lg"
    gov, graph, stub = langgraph_app(led, sid, tenant=tenant)
    q1 = HumanMessage("Is it?", id="q1")
    with gov.turn() as turn:
        graph.invoke({"messages": [q1]})
    billed = gov.core.prompt_tokens([SystemMessage(SYSTEM), q1])
    settled_as_billed(led.scope_usage(tenant), billed)
    (done,) = turn.state.settled
    assert done.over == OUT - RESERVE and done.item == "ai-1"  # the answer's item
    left = CEILING - billed - OUT
    with pytest.raises(CeilingReached) as refused, gov.turn():
        graph.invoke({"messages": [HumanMessage(LONG, id="q2")]})
    assert refused.value.scope == tenant and refused.value.quantity == "tokens"
    assert refused.value.free == left and stub.calls == 1  # refused before the call
    nothing_held(led, tenant, sid, left)
    stub.fail = True
    with pytest.raises(RuntimeError, match="provider is down"), gov.turn():
        graph.invoke({"messages": [HumanMessage("Again?", id="q3")]})
    assert stub.calls == 2
    nothing_held(led, tenant, sid, left)  # the failed call's hold was voided
    assert led.scope_usage(tenant).refused == 1
    with pytest.raises(InvalidArgument, match="belongs inside"):  # outside a turn: refused
        gov.model(stub).invoke([HumanMessage("Outside?", id="q4")])
    assert stub.calls == 2


def test_langchain_create_agent_tenant_ceiling(redis_server: Any) -> None:
    from langchain.agents import create_agent

    from ledger.adapters.langchain import LedgerMiddleware

    led, tenant = tenant_ledger(redis_server.url)
    sid = f"@{tenant}/lc"
    session = led.open_session(sid, budget())
    middleware = LedgerMiddleware(Agent(session, tokens), tenant=tenant)
    stub = Stub(count=middleware.agent.core.prompt_tokens)
    agent = create_agent(stub, tools=[], system_prompt=SYSTEM, middleware=[middleware])
    q1 = HumanMessage("Is it?", id="q1")
    with middleware.turn() as turn:
        agent.invoke({"messages": [q1]})
    billed = middleware.agent.core.prompt_tokens([SystemMessage(SYSTEM), q1])
    settled_as_billed(led.scope_usage(tenant), billed)
    assert [s.item for s in turn.state.settled] == ["ai-1"]
    left = CEILING - billed - OUT
    with pytest.raises(CeilingReached), middleware.turn():
        agent.invoke({"messages": [HumanMessage(LONG, id="q2")]})
    assert stub.calls == 1
    nothing_held(led, tenant, sid, left)
    stub.fail = True
    with pytest.raises(RuntimeError, match="provider is down"), middleware.turn():
        agent.invoke({"messages": [HumanMessage("Again?", id="q3")]})
    nothing_held(led, tenant, sid, left)


def test_agents_sdk_tenant_ceiling(redis_server: Any) -> None:
    from agents import Agent as SdkAgent
    from agents import Model, ModelResponse, Runner, Usage, set_tracing_disabled
    from agents.testing import assistant_message

    from ledger.adapters.openai_agents import LedgerAgents

    set_tracing_disabled(True)
    sent: list[int] = []

    class SdkStub(Model):
        fail = False

        async def get_response(self, *a: Any, **k: Any) -> ModelResponse:
            sent.append(gov.last_counted or 0)
            if self.fail:
                raise RuntimeError("the provider is down")
            n = gov.last_counted or 0
            usage = Usage(requests=1, input_tokens=n, output_tokens=OUT, total_tokens=n + OUT)
            out = [assistant_message("Yes", item_id=f"msg-{len(sent)}")]
            return ModelResponse(output=out, usage=usage, response_id=None)

        def stream_response(self, *a: Any, **k: Any) -> Any:
            raise NotImplementedError

    async def main() -> None:
        nonlocal gov
        tenant = f"t{uuid.uuid4().hex[:10]}"
        async with AsyncLedger.from_url(redis_server.url) as led:
            await led.set_scope(tenant, ScopeBudget(window_ms=DAY, tokens=CEILING))
            session = await led.open_session(f"@{tenant}/sdk", budget())
            gov = LedgerAgents(AsyncAgent(session, tokens), tenant=tenant)
            model = SdkStub()
            agent = SdkAgent(name="a", instructions=SYSTEM, model=model)

            async def ask(text: str) -> None:
                async with gov.turn():
                    await Runner.run(
                        agent,
                        text,
                        session=gov.session,
                        run_config=gov.run_config(),
                        hooks=gov.hooks,
                    )

            await ask("Is it?")
            usage = await led.scope_usage(tenant)
            settled_as_billed(usage, sent[0])
            left = usage.remaining["tokens"]
            with pytest.raises(CeilingReached):
                await ask(LONG)
            assert len(sent) == 1  # refused before the call
            usage = await led.scope_usage(tenant)
            assert usage.open_holds == 0 and usage.remaining["tokens"] == left
            model.fail = True
            with pytest.raises(RuntimeError, match="provider is down"):
                await ask("Again?")
            assert len(sent) == 2
            usage = await led.scope_usage(tenant)
            assert usage.open_holds == 0 and usage.remaining["tokens"] == left
            await session.delete()

    gov: Any = None
    asyncio.run(main())


def test_no_tenant_named_makes_no_extra_call(redis_server: Any) -> None:
    """The same turn on a session of a tenant, with and without the tenant named, every
    round trip counted (the ledger's scripts, batches and other reads and writes): those of
    before, plus a hold per model call, its settle in place of the answer's admission, and
    the answer's text stored for the worker's compactor (a worker-owned session)."""
    led, tenant = tenant_ledger(redis_server.url)
    counts = []
    for named in ({}, {"tenant": tenant}):
        gov, graph, _ = langgraph_app(led, f"@{tenant}/n{len(counts)}", **named)
        sent: list[str] = []
        run, run_many, io = led.run, led.run_many, gov.agent._io

        def counting(call: Any, run: Any = run, sent: list[str] = sent) -> Any:
            sent.append(call.script)
            return run(call)

        def batch(
            calls: Any, *a: Any, run_many: Any = run_many, sent: list[str] = sent, **k: Any
        ) -> Any:
            sent.append("batch:" + "+".join(c.script for c in calls))
            return run_many(calls, *a, **k)

        def effect(e: Any, io: Any = io, sent: list[str] = sent) -> Any:
            sent.append(type(e).__name__)
            return io(e)

        led.run, led.run_many, gov.agent._io = counting, batch, effect  # type: ignore[method-assign]
        with gov.turn():
            graph.invoke({"messages": [HumanMessage("Is it?", id="q1")]})
        led.run, led.run_many = run, run_many  # type: ignore[method-assign]
        counts.append(sent)
    plain, charged = counts
    assert not any("reserve" in x or "settle" in x for x in plain), plain
    # the answer's admission is gone: its settle made it the item, in the same step
    answered = list(plain)
    answered.remove("admit")
    assert sorted(charged) == sorted([*answered, "reserve", "settle", "Store"]), charged
    assert led.scope_usage(tenant).open_holds == 0
    print(f"round trips of a one-call turn: {len(plain)} without a tenant, {len(charged)} with")


def test_a_tenant_is_checked_against_the_session() -> None:
    led = Ledger.from_url(f"embedded://{uuid.uuid4().hex}")
    s = led.open_session("@acme/x", budget())
    with pytest.raises(InvalidArgument, match="needs a session of that tenant"):
        Agent(s, tokens, tenant="other")
    with pytest.raises(InvalidArgument, match="not within tenant"):
        Agent(s, tokens, tenant="acme", scopes=("other/key",))
    with pytest.raises(InvalidArgument, match="name tenant="):
        Agent(s, tokens, scopes=("acme/key",))
    assert Agent(s, tokens, tenant="acme", scopes=("acme/key",)).core.scopes == ("acme/key",)


def test_an_adapters_scopes_need_its_tenant_and_keep_the_agents_hold_ms() -> None:
    """``scopes=``/``model=`` on an adapter without ``tenant=`` were dropped without a word
    (the calls then charged the tenant alone, never the key), and an adapter's ``tenant=``
    put the agent's ``hold_ms`` back to 10 minutes (an adapter has no ``hold_ms`` of its own)."""
    from agents import set_tracing_disabled

    from ledger.adapters.langchain import AsyncLedgerMiddleware, LedgerMiddleware
    from ledger.adapters.langgraph import AsyncLedgerGraph, LedgerGraph
    from ledger.adapters.openai_agents import LedgerAgents

    set_tracing_disabled(True)
    led = Ledger.from_url(f"embedded://{uuid.uuid4().hex}")
    aled = AsyncLedger.from_url(f"embedded://{uuid.uuid4().hex}")
    s = led.open_session("@acme/x", budget())
    a = asyncio.run(aled.open_session("@acme/y", budget()))

    def sync_agent() -> Any:
        return Agent(s, tokens, tenant="acme", hold_ms=5_000)

    def async_agent() -> Any:
        return AsyncAgent(a, tokens, tenant="acme", hold_ms=5_000)

    faces: list[tuple[Any, Any]] = [(LedgerGraph, sync_agent), (LedgerMiddleware, sync_agent)]
    faces += [(f, async_agent) for f in (AsyncLedgerGraph, AsyncLedgerMiddleware, LedgerAgents)]
    for face, agent in faces:
        with pytest.raises(InvalidArgument, match="name tenant="):
            face(agent(), scopes=("acme/key-7",))
        with pytest.raises(InvalidArgument, match="name tenant="):
            face(agent(), model="small")
        named = agent()
        face(named, tenant="acme", scopes=("acme/key-7",), model="small")
        core = named.core
        assert (core.tenant, core.scopes, core.model, core.hold_ms) == (
            "acme",
            ("acme/key-7",),
            "small",
            5_000,
        ), face.__name__


class NamedStub(Stub):
    model_name: str = "stub-1"


def test_a_call_is_priced_by_the_models_name_and_charged_to_a_key(redis_server: Any) -> None:
    """The chat model's own name prices the call in the tenant's table (no price for it
    would be refused before the call), and a key within the tenant is charged with it."""
    from ledger import Price
    from ledger.adapters.langgraph import LedgerGraph

    led = Ledger.from_url(redis_server.url)
    tenant = f"t{uuid.uuid4().hex[:10]}"
    led.set_scope(tenant, ScopeBudget(window_ms=DAY, cents=10, prices={"stub-1": Price(100, 400)}))
    led.set_scope(f"{tenant}/key-7", ScopeBudget(window_ms=DAY, output=1_000))
    session = led.open_session(f"@{tenant}/m", budget())
    gov = LedgerGraph(Agent(session, tokens), tenant=tenant, scopes=(f"{tenant}/key-7",))
    stub = NamedStub(count=gov.core.prompt_tokens)
    q1 = [SystemMessage(SYSTEM), HumanMessage("Is it?", id="q1")]
    with gov.turn() as turn:
        gov.model(stub).invoke(q1)
    (done,) = turn.state.settled
    n = gov.core.prompt_tokens(q1)
    assert done.billed_money == n * 100 + OUT * 400  # micro-cents, priced as 'stub-1'
    assert led.scope_usage(f"{tenant}/key-7").charged["output"] == OUT
    assert led.scope_usage(tenant).charged["money"] == n * 100 + OUT * 400
    other = led.open_session(f"@{tenant}/u", budget())
    gov = LedgerGraph(Agent(other, tokens, tenant=tenant))
    with pytest.raises(InvalidArgument), gov.turn():  # no price for 'stub' in the table
        gov.model(Stub(count=gov.core.prompt_tokens)).invoke(q1)
    assert led.scope_usage(tenant).open_holds == 0


def test_agents_sdk_run_without_its_hooks_is_charged_the_worst_case(redis_server: Any) -> None:
    """A run not given ``hooks=gov.hooks`` reports no bill to the adapter: the hold is
    charged as held (the worst case) when the turn ends, never dropped, and the session
    keeps no item of it."""
    from agents import Agent as SdkAgent
    from agents import Model, ModelResponse, Runner, Usage, set_tracing_disabled
    from agents.testing import assistant_message

    from ledger.adapters.openai_agents import LedgerAgents

    set_tracing_disabled(True)

    class SdkStub(Model):
        async def get_response(self, *a: Any, **k: Any) -> ModelResponse:
            usage = Usage(requests=1, input_tokens=1, output_tokens=1, total_tokens=2)
            out = [assistant_message("Yes", item_id="msg-1")]
            return ModelResponse(output=out, usage=usage, response_id=None)

        def stream_response(self, *a: Any, **k: Any) -> Any:
            raise NotImplementedError

    async def main() -> None:
        tenant = f"t{uuid.uuid4().hex[:10]}"
        async with AsyncLedger.from_url(redis_server.url) as led:
            await led.set_scope(tenant, ScopeBudget(window_ms=DAY, tokens=100_000))
            session = await led.open_session(f"@{tenant}/sdk", budget())
            gov = LedgerAgents(AsyncAgent(session, tokens), tenant=tenant)
            agent = SdkAgent(name="a", instructions=SYSTEM, model=SdkStub())
            async with gov.turn() as turn:
                await Runner.run(agent, "Is it?", session=gov.session, run_config=gov.run_config())
                held = gov.last_counted
            usage = await led.scope_usage(tenant)
            assert usage.charged["input"] == held and usage.charged["output"] == RESERVE
            assert usage.open_holds == 0 and turn.state is not None
            (done,) = turn.state.settled
            fields = await led.client.hkeys(session.keys.session)
            assert not any(f.decode().endswith(done.item) for f in fields), fields
            await session.delete()

    asyncio.run(main())


def test_langchain_create_agent_asyncio_tenant_ceiling(redis_server: Any) -> None:
    """The middleware's asyncio face (``AsyncLedgerMiddleware``, ``ainvoke``): the same."""
    from langchain.agents import create_agent

    from ledger.adapters.langchain import AsyncLedgerMiddleware

    async def main() -> None:
        tenant = f"t{uuid.uuid4().hex[:10]}"
        async with AsyncLedger.from_url(redis_server.url) as led:
            await led.set_scope(tenant, ScopeBudget(window_ms=DAY, tokens=CEILING))
            session = await led.open_session(f"@{tenant}/lca", budget())
            mw = AsyncLedgerMiddleware(AsyncAgent(session, tokens), tenant=tenant)
            stub = Stub(count=mw.agent.core.prompt_tokens)
            agent = create_agent(stub, tools=[], system_prompt=SYSTEM, middleware=[mw])
            q1 = HumanMessage("Is it?", id="q1")
            async with mw.turn() as turn:
                await agent.ainvoke({"messages": [q1]})
            billed = mw.agent.core.prompt_tokens([SystemMessage(SYSTEM), q1])
            settled_as_billed(await led.scope_usage(tenant), billed)
            assert [s.item for s in turn.state.settled] == ["ai-1"]
            with pytest.raises(CeilingReached):
                async with mw.turn():
                    await agent.ainvoke({"messages": [HumanMessage(LONG, id="q2")]})
            stub.fail = True
            with pytest.raises(RuntimeError, match="provider is down"):
                async with mw.turn():
                    await agent.ainvoke({"messages": [HumanMessage("Again?", id="q3")]})
            assert stub.calls == 2
            usage = await led.scope_usage(tenant)
            assert usage.open_holds == 0 and usage.remaining["tokens"] == CEILING - billed - OUT
            await session.delete()

    asyncio.run(main())
