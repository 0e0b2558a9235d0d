"""A LangGraph agent whose context the ledger governs.

Five nodes: ask -> retrieve (12-18 chunks with URL ids) -> plan (the model asks for
SQL) -> sql (a tool whose result is sometimes ~22k tokens) -> answer. The chat model is
a stub (no network); it counts every prompt it is sent, independently of the ledger.

    python examples/langgraph_agent.py                       # embedded, 30 turns
    python examples/langgraph_agent.py --url redis://localhost:6379/0 --workers 2
    python examples/langgraph_agent.py --drift-at 17         # add a note behind the ledger's back

Lines marked `# ledger` are the glue that plugs the ledger in (9 lines).
"""

from __future__ import annotations

import argparse
import base64
import json
import pickle
import random
import subprocess
import sys
import uuid
import warnings
from typing import Annotated, Any, TypedDict

from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from ledger import Agent, Ledger, SessionBudget, TiktokenCounter  # ledger
from ledger.adapters.langgraph import LedgerGraph, merge_docs  # ledger
from ledger.errors import ContextDriftWarning  # the example's report

WINDOW = 16_000
OVERHEAD = 4  # tokens of chat framing per message, counted for items and prompts alike
SYSTEM = "You are a data analyst. Answer from the documents and the SQL results."  # 15 tokens + 4
TOKENS = TiktokenCounter()  # the stub model's own count (the glue makes its own counter)
SEEN: list[int] = []  # every prompt the model was sent, in tokens
WORDS = ["revenue", "margin", "churn", "cohort", "region", "quarter", "pipeline", "forecast", "segment"]


def counted(messages: list[AnyMessage]) -> int:
    """The real prompt's tokens, as the model is sent it (independent of the ledger)."""
    return sum(TOKENS(str(m.content)) + TOKENS(json.dumps(getattr(m, "tool_calls", []) or [],
               sort_keys=True, default=str) if getattr(m, "tool_calls", None) else "") + OVERHEAD
               for m in messages)


class StubModel(BaseChatModel):
    """A chat model with canned answers: asks for SQL after a question, answers after it."""

    @property
    def _llm_type(self) -> str:
        return "stub"

    def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None,
                  **kw: Any) -> ChatResult:
        SEEN.append(counted(messages))
        last = messages[-1]
        if isinstance(last, HumanMessage):
            n = str(last.content).split(":")[0]
            msg = AIMessage(content="", tool_calls=[{"name": "sql", "args": {"q": n}, "id": f"sql-{n}"}])
        else:
            msg = AIMessage(content="Based on the rows and documents: " + " ".join(WORDS[:6]))
        return ChatResult(generations=[ChatGeneration(message=msg)])


class State(TypedDict, total=False):
    question: str
    messages: Annotated[list[AnyMessage], add_messages]
    docs: Annotated[list[Document], merge_docs]  # ledger
    inject: bool


def chunk(i: int) -> Document:
    rnd = random.Random(i)
    text = " ".join(rnd.choice(WORDS) for _ in range(390))
    return Document(page_content=text, id=f"https://wiki.example.com/analytics/handbook?page={i // 8}&chunk={i}#section-{i % 8}")


def sql_rows(turn: int) -> str:
    rows = 2_600 if turn % 4 == 3 else random.Random(turn).randint(60, 220)
    return "\n".join(f"{r},{WORDS[r % 9]},{r * 37 % 1000}.{r % 100:02d}" for r in range(rows))


def build(model: Any, gov: LedgerGraph | None) -> Any:
    def prompt(state: State) -> list[AnyMessage]:
        docs = [SystemMessage(content=d.page_content, id=d.id) for d in state.get("docs", [])]
        extra = [SystemMessage(content="NOTE " + "unlogged context " * 150)] if state.get("inject") else []
        return [SystemMessage(content=SYSTEM), *docs, *extra, *state["messages"]]

    def ask(state: State) -> dict[str, Any]:
        return {"messages": [HumanMessage(content=state["question"], id=uuid.uuid4().hex)]}

    def retrieve(state: State) -> dict[str, Any]:
        turn = int(state["question"].split(":")[0][1:])
        rnd = random.Random(turn)
        return {"docs": [chunk(i) for i in rnd.sample(range(400), rnd.randint(12, 18))]}

    def plan(state: State) -> dict[str, Any]:
        return {"messages": [model.invoke(prompt(state))]}

    def sql(state: State) -> dict[str, Any]:
        call = state["messages"][-1].tool_calls[0]
        turn = int(call["args"]["q"][1:])
        return {"messages": [ToolMessage(content=sql_rows(turn), tool_call_id=call["id"])]}

    def answer(state: State) -> dict[str, Any]:
        return {"messages": [model.invoke(prompt(state))]}

    builder = StateGraph(State)
    for name, fn in [("ask", ask), ("retrieve", retrieve), ("plan", plan), ("sql", sql), ("answer", answer)]:
        builder.add_node(name, fn)
    builder.add_edge(START, "ask")
    for a, b in [("ask", "retrieve"), ("retrieve", "plan"), ("plan", "sql"), ("sql", "answer"), ("answer", END)]:
        builder.add_edge(a, b)
    if gov is not None:
        gov.govern(builder)  # ledger
    return builder.compile()


def summarize(objs: list[Any]) -> str:
    return f"Summary of {len(objs)} earlier messages and documents: " + " ".join(WORDS)


BUDGET = SessionBudget(window=16_000, system_prompt=19, output_reserve=1_000, working_memory_floor=1_500, framing_tolerance=8, compaction="agent")  # ledger


class Worker:
    """One process's agent: the ledger session, the governed model and graph."""

    def __init__(self, url: str, session_id: str) -> None:
        session = Ledger.from_url(url).open_session(session_id, BUDGET)  # ledger
        self.gov = LedgerGraph(Agent(session, TiktokenCounter(), item_overhead=4), summarize=summarize)  # ledger
        self.model = StubModel()
        self.graph = build(self.gov.model(self.model), self.gov)  # ledger

    def turn(self, n: int, state: dict[str, Any], inject: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        SEEN.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ContextDriftWarning)
            with self.gov.turn(working_set=1_500) as t:  # ledger
                state = self.graph.invoke({**state, "question": f"Q{n}: {WORDS[n % 9]} by region?", "inject": inject})
        snap = self.gov.agent.session.snapshot()
        assert t.report is not None
        tool = t.state.tools[-1] if t.state and t.state.tools else None
        row = {"turn": n, "prompt": t.report.occupancy + t.report.drift, "occupancy": snap.occupancy,
               "drift": t.report.drift, "flag": t.report.flag, "warned": len(caught),
               "max_sent": max(SEEN), "window": WINDOW, "docs": len(state.get("docs", [])),
               "spilled": bool(tool and tool.spilled), "tool_tokens": tool.tokens if tool else 0,
               "dropped": len(t.dropped), "compaction_due": t.report.compaction_due}
        state.pop("inject", None)
        return state, row


def serve(url: str, session_id: str) -> None:
    """Worker process: one JSON line in per turn, one out."""
    w = Worker(url, session_id)
    for line in sys.stdin:
        req = json.loads(line)
        state = pickle.loads(base64.b64decode(req["state"]))
        state, row = w.turn(req["turn"], state, req["inject"])
        print(json.dumps({"row": row, "state": base64.b64encode(pickle.dumps(state)).decode()}), flush=True)


def run(url: str, turns: int, drift_at: int | None, workers: int, session_id: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    state: dict[str, Any] = {"messages": [], "docs": []}
    if workers <= 1:
        w = Worker(url, session_id)
        for n in range(1, turns + 1):
            state, row = w.turn(n, state, n == drift_at)
            rows.append(row)
        return rows
    procs = [subprocess.Popen([sys.executable, __file__, "--serve", "--url", url, "--session", session_id],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(workers)]
    try:
        for n in range(1, turns + 1):
            p = procs[n % workers]
            assert p.stdin and p.stdout
            p.stdin.write(json.dumps({"turn": n, "inject": n == drift_at,
                                      "state": base64.b64encode(pickle.dumps(state)).decode()}) + "\n")
            p.stdin.flush()
            out = json.loads(p.stdout.readline())
            state = pickle.loads(base64.b64decode(out["state"]))
            rows.append({**out["row"], "worker": n % workers})
    finally:
        for p in procs:
            assert p.stdin
            p.stdin.close()
            p.wait(timeout=30)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="embedded://langgraph-example")
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--drift-at", type=int, default=None)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--session", default=None)
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sid = a.session or f"lg-{uuid.uuid4().hex[:12]}"
    if a.serve:
        return serve(a.url, sid)
    rows = run(a.url, a.turns, a.drift_at, a.workers, sid)
    if a.json:
        print(json.dumps(rows))
        return
    print("turn  worker  prompt  occupancy  drift  flag         max_sent/window  docs  tool(spilled)  dropped")
    for r in rows:
        print(f"{r['turn']:>4}  {r.get('worker', 0):>6}  {r['prompt']:>6}  {r['occupancy']:>9}  {r['drift']:>5}  "
              f"{r['flag']:<11}  {r['max_sent']:>6}/{r['window']:<6}  {r['docs']:>4}  "
              f"{r['tool_tokens']:>6}({'y' if r['spilled'] else 'n'})  {r['dropped']:>7}")
    ok = all(r["max_sent"] <= r["window"] for r in rows)
    print(f"max prompt sent {max(r['max_sent'] for r in rows)} <= window {WINDOW}: {ok}; "
          f"max |drift| outside injected turns {max(abs(r['drift']) for r in rows if r['turn'] != a.drift_at)}; "
          f"flagged turns {[r['turn'] for r in rows if r['flag'] != 'none']}")


if __name__ == "__main__":
    main()
