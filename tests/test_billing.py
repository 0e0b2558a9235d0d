"""What the model billed (docs/agent.md#what-the-model-billed): the input tokens each
response reports, against the ledger's count of the prompt it answered, through the
LangGraph adapter and a real graph with a stub chat model that reports usage.

An exact counter that agrees with the provider is never flagged; an estimating counter
22% under what is billed is flagged on the first turn and calibrated (the factor kept in
Redis, taken by every process), after which the turns are within the tolerance and the
ledger still equals the prompt; a report covering what the count never saw (a hidden
system prompt) is flagged on every turn and learned from never."""

from __future__ import annotations

import math
import uuid
import warnings
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from ledger import (
    Agent,
    BillingDriftWarning,
    EstimatingCounter,
    Ledger,
    SessionBudget,
    TiktokenCounter,
)
from ledger.adapters.langgraph import LedgerGraph

SYSTEM = "You answer briefly."


class Billing(BaseChatModel):
    """A stub chat model whose usage reports ``rate`` x the estimate, plus ``hidden``
    tokens (a system prompt the app never sent through the ledger)."""

    rate: float = 1.0
    hidden: int = 0
    exact: bool = False

    @property
    def _llm_type(self) -> str:
        return "billing-stub"

    def _generate(
        self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> ChatResult:
        if self.exact:
            tok = TiktokenCounter()
            n = sum(tok(str(m.content)) for m in messages)
        else:
            n = sum(math.ceil(len(str(m.content)) / 4) for m in messages)
        billed = math.ceil(n * self.rate) + self.hidden
        usage = {"input_tokens": billed, "output_tokens": 5, "total_tokens": billed + 5}
        return ChatResult(
            generations=[ChatGeneration(message=AIMessage("ok " * 5, usage_metadata=usage))]
        )


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def graph(gov: LedgerGraph, chat: BaseChatModel) -> Any:
    model = gov.model(chat)

    def answer(state: State) -> dict[str, Any]:
        return {"messages": [model.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

    builder = StateGraph(State)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    builder.add_edge("answer", END)
    return gov.govern(builder).compile()


def turns(gov: LedgerGraph, g: Any, n: int) -> list[Any]:
    """n turns carrying the state; each turn's TurnState."""
    state: dict[str, Any] = {"messages": []}
    out = []
    for i in range(n):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", BillingDriftWarning)
            with gov.turn() as t:
                question = HumanMessage(
                    f"question {i}: " + "tell me about the ledger " * (20 + 7 * i), id=f"q{i}"
                )
                state = g.invoke({"messages": [*state["messages"], question]})
        assert t.report is not None and abs(t.report.drift) <= 8, (
            t.report
        )  # the ledger is the prompt
        assert len(caught) == sum(c.flagged for c in t.state.billing)
        out.append(t.state)
    return out


def make(ledger_url: str, counter: Any, budget_counter: Any) -> tuple[Ledger, Any]:
    led = Ledger.from_url(ledger_url)
    s = led.open_session(
        f"bill-{uuid.uuid4().hex[:8]}",
        SessionBudget(
            window=20_000,
            system_prompt=budget_counter(SYSTEM),
            output_reserve=500,
            framing_tolerance=8,
        ),
    )
    return led, s


@pytest.mark.parametrize("kind", ["embedded", "redis"])
def test_an_estimate_22_percent_under_is_flagged_once_then_calibrated(
    kind: str, request: pytest.FixtureRequest
) -> None:
    from tests.conftest import backend_url

    url = backend_url(request, kind)
    est = EstimatingCounter()
    led, s = make(url, est, est)
    gov = LedgerGraph(Agent(s, est))
    states = turns(gov, graph(gov, Billing(rate=1.22)), 5)
    first, rest = states[0], states[1:]
    assert first.billing[0].flagged and first.billing[0].plausible
    assert first.billing[0].learned == {"prose": pytest.approx(1.22, abs=0.02)}
    assert rest[0].recalibrated  # (later ones refine the factor from larger reports)
    for c in (c for st in rest for c in st.billing if c.learned):
        assert c.learned == {"prose": pytest.approx(1.22, abs=0.01)} and not c.flagged
    for st in rest:  # within the tolerance from the next turn on
        assert not any(c.flagged for c in st.billing), st.billing
    assert s.audit().clean
    # Another process's agent takes the same factor from Redis.
    other = Agent(led.session(s.id), EstimatingCounter())
    with other.turn() as t:
        assert t.state is not None and t.state.recalibrated
        assert other.core.counter.factors == {"prose": pytest.approx(1.22, abs=0.02)}
        t.abort()
    s.delete()


def test_a_report_that_covers_more_than_was_counted_is_flagged_not_learned() -> None:
    est = EstimatingCounter()
    _led, s = make(f"embedded://{uuid.uuid4().hex}", est, est)
    gov = LedgerGraph(Agent(s, est))
    states = turns(gov, graph(gov, Billing(hidden=4_000)), 3)
    for st in states:
        (check,) = st.billing
        assert check.flagged and not check.plausible and check.learned is None
        assert check.difference >= 4_000 - check.counted  # (counted at the bound)
    assert gov.agent.core.counter.factors == {}  # nothing learned


def test_an_exact_counter_that_agrees_with_the_provider_is_never_flagged() -> None:
    tok = TiktokenCounter()
    _led, s = make(f"embedded://{uuid.uuid4().hex}", tok, tok)
    gov = LedgerGraph(Agent(s, tok))
    assert not gov.agent.core.calibrate  # an exact counter is not calibrated
    for st in turns(gov, graph(gov, Billing(exact=True)), 3):
        assert [c.flagged for c in st.billing] == [False]
