"""The LangGraph adapter's turns and the graph's checkpointer (a real InMemorySaver):
each turn starts from the checkpoint the last ended turn committed, whatever died in
between, and commits the checkpoint it wrote itself."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from ledger import Agent, Ledger, SessionBudget, TiktokenCounter
from ledger.adapters.langgraph import LedgerGraph

TOK = TiktokenCounter()
SYSTEM = "Be brief."


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def make(
    saver: InMemorySaver, sid: str, url: str, fail: dict[str, bool]
) -> tuple[LedgerGraph, Any]:
    session = Ledger.from_url(url).open_session(
        sid,
        SessionBudget(
            window=8_000, system_prompt=TOK(SYSTEM), output_reserve=500, framing_tolerance=0
        ),
    )
    gov = LedgerGraph(Agent(session, TOK), checkpointer=saver)
    answers = iter([AIMessage(f"answer {i}", id=f"a{uuid.uuid4().hex[:6]}") for i in range(50)])
    model = gov.model(GenericFakeChatModel(messages=answers))

    def answer(state: State) -> dict[str, Any]:
        if fail.get("now"):
            raise RuntimeError("the model provider answered 500")
        return {"messages": [model.invoke([SystemMessage(SYSTEM), *state["messages"]])]}

    def think(state: State) -> dict[str, Any]:
        return {
            "messages": [HumanMessage("(thinking) " + "step " * 40, id=f"t{uuid.uuid4().hex[:6]}")]
        }

    builder = StateGraph(State)
    builder.add_node("think", think)
    builder.add_node("answer", answer)
    builder.add_edge(START, "think")
    builder.add_edge("think", "answer")
    builder.add_edge("answer", END)
    return gov, gov.govern(builder).compile(checkpointer=saver)


def ask(gov: LedgerGraph, graph: Any, config: Any, q: str) -> Any:
    with gov.turn(config=config) as turn:
        graph.invoke({"messages": [HumanMessage(q, id=q)]}, turn.config)
    return turn


@pytest.mark.embedded
def test_a_dead_first_turn_leaves_nothing_for_the_next(tmp_path: Any) -> None:
    """The first turn dies after a node checkpointed (the model call failed): rolled back
    by its abort; the next turn starts from the empty thread, not from the dead branch."""
    saver, fail = InMemorySaver(), {"now": True}
    url, sid = f"embedded://{uuid.uuid4().hex}", "lg-dead-first"
    gov, graph = make(saver, sid, url, fail)
    config = {"configurable": {"thread_id": sid}}
    with pytest.raises(RuntimeError), gov.turn(config=config) as dead:
        graph.invoke({"messages": [HumanMessage("q1", id="q1")]}, dead.config)
    assert gov.agent.session.snapshot().occupancy == TOK(SYSTEM)  # rolled back
    fail["now"] = False
    turn = ask(gov, graph, config, "q2")
    assert turn.rolled_back is None  # the abort had rolled it back already
    assert turn.report.drift == 0 and gov.agent.session.audit().clean
    ids = [m.id for m in saver.get_tuple(config).checkpoint["channel_values"]["messages"]]
    assert "q1" not in ids and "q2" in ids


@pytest.mark.embedded
def test_the_mark_is_the_checkpoint_this_turn_wrote_not_a_zombies() -> None:
    saver, fail = InMemorySaver(), {}
    url, sid = f"embedded://{uuid.uuid4().hex}", "lg-zombie"
    gov_a, graph_a = make(saver, sid, url, fail)
    gov_b, graph_b = make(saver, sid, url, fail)
    config = {"configurable": {"thread_id": sid}}
    ask(gov_a, graph_a, config, "q1")
    with gov_b.turn(config=config) as turn:
        graph_b.invoke({"messages": [HumanMessage("q2", id="q2")]}, turn.config)
        # A zombie of turn 1 (its process was only slow) writes a checkpoint on its own
        # branch, after B's last one and before B's turn ends: the thread's newest.
        dead_branch = {
            "configurable": {"thread_id": sid, "checkpoint_ns": "", "checkpoint_id": turn.mark}
        }
        graph_a.update_state(dead_branch, {"messages": [HumanMessage("zombie", id="z1")]})
    t4 = ask(gov_b, graph_b, config, "q4")
    assert t4.report.drift == 0 and gov_b.agent.session.audit().clean
    ids = [m.id for m in saver.get_tuple(config).checkpoint["channel_values"]["messages"]]
    assert "z1" not in ids and {"q1", "q2", "q4"} <= set(ids)
