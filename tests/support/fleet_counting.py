"""A fleet counting with an estimate (tests/test_fleet_counting.py): one session's turns
served alternately by agent OS processes (examples/fleet.py), with a real ``ledger
worker`` compacting, through the Agents SDK's governed Session or a LangChain
``create_agent`` agent's middleware (``LEDGER_COUNTING_FRAMEWORK``: ``sdk`` or
``langchain``), counted by ``EstimatingCounter`` and calibrated from what the model bills.

The stub model bills by its own notion of content kinds, each at its own rate of chars/4
(prose 1.22x, CSV/JSON rows 2.4x, CJK 3x), and reports it as the input tokens. Each turn
asks a question (in Chinese/Japanese every fifth turn from turn 6), the model runs a SQL tool and
answers; the tool's result is ~20k billed tokens every fourth turn (a 16k window), the
first of them after three turns of prose. Every
prompt the model is sent is billed by the stub itself and kept in the turn's row with the
kinds it held, beside the ledger's count of it.

    python tests/support/fleet_counting.py --url redis://... --processes 2 --turns 24 --json
    LEDGER_COUNTING_FRAMEWORK=langchain python tests/support/fleet_counting.py --turns 40 --summary
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sqlite3
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import fleet

from ledger import EstimatingCounter, SessionBudget
from ledger.adapters.summarizer import LLMSummarizer

FRAMEWORK = os.environ.get("LEDGER_COUNTING_FRAMEWORK", "sdk")
WINDOW, RESERVE = 16_000, 1_000
RATES = {"prose": 1.22, "data": 2.4, "cjk": 3.0}
SYSTEM = "You are a data analyst. Answer from the SQL rows, briefly and exactly."
WORDS = ["revenue", "margin", "churn", "cohort", "region", "quarter", "pipeline", "forecast"]
CJK = "台北是台灣的首都也是最大的城市之一。東京は日本の首都であり世界最大の都市圏の一つです。"
SEEN: list[dict[str, Any]] = []  # this turn's prompts: the stub's bill and kinds


def kind(text: str) -> str:
    """The stub provider's notion of a text's kind, by its non-space characters: CJK (a
    fifth of them), rows and JSON (digits and their punctuation, three tenths), prose."""
    dense = [ch for ch in text if not ch.isspace()]
    if not dense:
        return "prose"
    if sum(1 for ch in dense if "\u3040" <= ch <= "\u9fff") * 5 >= len(dense):
        return "cjk"
    rowish = sum(1 for ch in dense if ch.isdigit() or ch in '{}[]",:|')
    return "data" if rowish * 10 >= 3 * len(dense) else "prose"


def bill(texts: list[str]) -> tuple[int, list[str]]:
    """What the stub bills for a prompt of these texts, and the kinds it held."""
    kinds = [kind(t) for t in texts if t]
    total = sum(math.ceil(len(t) / 4) * RATES[kind(t)] for t in texts if t)
    return math.ceil(total), sorted(set(kinds))


def rows(turn: int) -> str:
    """The SQL tool's result: prose on the first turns (no rows yet), then CSV rows, ~20k
    billed tokens every fourth turn (the first on turn 4, when a factor learned from prose
    alone would count it at half of that), ~600 otherwise."""
    if turn < 4:
        return f"No rows for Q{turn} yet: " + " ".join(WORDS[(turn + i) % 8] for i in range(60))
    n = 1_850 if turn % 4 == 0 else 40 + (turn * 13) % 40
    return "\n".join(f"{r},{WORDS[(r + turn) % 8]},{r * 37 % 1000}.{r % 100:02d}" for r in range(n))


def question(turn: int) -> str:
    if turn % 5 == 1 and turn > 1:  # turns 6, 11, 16...
        return f"Q{turn}: " + CJK * 12
    return f"Q{turn}: how did {WORDS[turn % 8]} move by region and quarter? " * 4


class Summarizer:
    """The worker's summarizer model (anything with ``ainvoke``)."""

    async def ainvoke(self, messages: list[dict[str, str]]) -> Any:
        from types import SimpleNamespace

        body = messages[-1]["content"]
        return SimpleNamespace(content=f"Summary of {body.count('[')} items: " + " ".join(WORDS))


COMPACTOR = LLMSummarizer(Summarizer(), EstimatingCounter())


def budget(system: int, framing: int) -> SessionBudget:
    return SessionBudget(window=WINDOW, system_prompt=system, tool_framing=framing,
                         output_reserve=RESERVE, working_memory_floor=1_500)  # fmt: skip


def row(n: int, t: Any, snap: Any) -> dict[str, Any]:
    """A turn's row: every prompt the model was sent (the stub's bill and kinds) beside
    the ledger's count of it, the tool results, and what the calibration did."""
    checks = [
        {"counted": c.counted, "billed": c.billed, "tolerance": c.tolerance,
         "flagged": c.flagged, "plausible": c.plausible}
        for c in t.state.billing
    ]  # fmt: skip
    unreconciled = getattr(t.state, "unreconciled", None)
    return {
        "turn": n, "pid": os.getpid(), "calls": list(SEEN), "checks": checks,
        "drift": t.report.drift, "window": WINDOW, "occupancy": snap.occupancy,
        "spilled": [o.spilled for o in t.state.tools],
        "tool_tokens": [o.tokens for o in t.state.tools],
        "delivered": len(t.summaries), "recalibrated": t.state.recalibrated,
        "factors": dict(getattr(t.agent.core.counter, "factors", {})),
        "unreconciled": repr(unreconciled) if unreconciled else None,
    }  # fmt: skip


# --- the Agents SDK -------------------------------------------------------------------------


def sdk_server(url: str, session_id: str, db: str) -> Any:
    from agents import (
        Agent,
        Model,
        ModelResponse,
        Runner,
        Usage,
        function_tool,
        set_tracing_disabled,
    )
    from agents.testing import assistant_message, function_call

    from ledger import AsyncAgent, AsyncLedger
    from ledger.adapters.openai_agents import LedgerAgents, item_text

    set_tracing_disabled(True)

    def schema_texts(tools: Any) -> list[str]:
        return [json.dumps({"name": t.name, "description": t.description,
                            "parameters": t.params_json_schema}, sort_keys=True)
                for t in tools or []]  # fmt: skip

    class Stub(Model):
        async def get_response(self, system_instructions: Any, input: Any, model_settings: Any,
                               tools: Any, *a: Any, **k: Any) -> ModelResponse:  # fmt: skip
            items = [dict(i) for i in input]
            billed, kinds = bill([system_instructions or "", *schema_texts(tools),
                                  *(item_text(i) for i in items)])  # fmt: skip
            SEEN.append({"billed": billed, "kinds": kinds})
            last = items[-1]
            if last.get("role") == "user":
                q = str(last["content"]).split(":")[0]
                out = [function_call("sql", {"q": q}, call_id=f"sql-{q}")]
            else:
                q = str(last.get("call_id", "x")).removeprefix("sql-")
                out = [assistant_message("The rows say: " + " ".join(WORDS), item_id=f"msg-{q}")]
            usage = Usage(requests=1, input_tokens=billed, output_tokens=10,
                          total_tokens=billed + 10)  # fmt: skip
            return ModelResponse(output=out, usage=usage, response_id=None)

        def stream_response(self, *a: Any, **k: Any) -> Any:
            raise NotImplementedError

    @function_tool
    def sql(q: str) -> str:
        """Run the analytics query for question q."""
        return rows(int(q[1:]))

    class Server:
        def __init__(self) -> None:
            self.loop = asyncio.new_event_loop()
            self.agent = Agent(name="analyst", instructions=SYSTEM, model=Stub(), tools=[sql])
            system, _ = bill([SYSTEM])
            framing, _ = bill(schema_texts([sql]))
            self.loop.run_until_complete(self._open(system, framing))

        async def _open(self, system: int, framing: int) -> None:
            s = await AsyncLedger.from_url(url).open_session(session_id, budget(system, framing))
            self.gov = LedgerAgents(AsyncAgent(s, EstimatingCounter()))

        def turn(self, n: int, inject: bool = False, wait: float = 0.0) -> dict[str, Any]:
            return self.loop.run_until_complete(self._turn(n, wait))

        async def _turn(self, n: int, wait: float) -> dict[str, Any]:
            SEEN.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                async with self.gov.turn(working_set=1_500, wait=wait) as t:
                    await Runner.run(self.agent, [{"role": "user", "content": question(n)}],
                                     session=self.gov.session, run_config=self.gov.run_config(),
                                     hooks=self.gov.hooks)  # fmt: skip
            return row(n, t, await self.gov.agent.session.snapshot())

    return Server()


# --- LangChain create_agent ------------------------------------------------------------------


def langchain_server(url: str, session_id: str, db: str) -> Any:
    from langchain.agents import create_agent
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.outputs import ChatGeneration, ChatResult
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langgraph.checkpoint.sqlite import SqliteSaver
    from pydantic import Field

    from ledger import Agent, Ledger
    from ledger.adapters.langchain import LedgerMiddleware
    from ledger.agent.core import default_text

    def schema_texts(tools: Any) -> list[str]:
        return [json.dumps(convert_to_openai_tool(t), sort_keys=True) for t in tools or []]

    class Stub(BaseChatModel):
        tools: list[Any] = Field(default_factory=list)

        @property
        def _llm_type(self) -> str:
            return "billing-stub"

        def bind_tools(self, tools: Any, **kw: Any) -> Any:
            return self.model_copy(update={"tools": list(tools)})

        def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None,
                      **kw: Any) -> ChatResult:  # fmt: skip
            billed, kinds = bill([*schema_texts(self.tools), *(default_text(m) for m in messages)])
            SEEN.append({"billed": billed, "kinds": kinds})
            last = messages[-1]
            q = next(str(m.content).split(":")[0] for m in reversed(messages)
                     if isinstance(m, HumanMessage))  # fmt: skip
            calls = [] if isinstance(last, ToolMessage) else [
                {"name": "sql", "args": {"q": q}, "id": f"sql-{q}"}]  # fmt: skip
            text = "" if calls else "The rows say: " + " ".join(WORDS)
            usage = {"input_tokens": billed, "output_tokens": 10, "total_tokens": billed + 10}
            msg = AIMessage(content=text, tool_calls=calls, usage_metadata=usage,
                            id=f"ai-{q}-{len(calls)}")  # fmt: skip
            return ChatResult(generations=[ChatGeneration(message=msg)])

    @tool
    def sql(q: str) -> str:
        """Run the analytics query for question q."""
        return rows(int(q[1:]))

    class Server:
        def __init__(self) -> None:
            saver = SqliteSaver(sqlite3.connect(db, check_same_thread=False, timeout=30))
            self.config = {"configurable": {"thread_id": session_id}}
            system, _ = bill([SYSTEM])
            framing, _ = bill(schema_texts([sql]))
            s = Ledger.from_url(url).open_session(session_id, budget(system, framing))
            self.mw = LedgerMiddleware(Agent(s, EstimatingCounter()), checkpointer=saver)
            self.gov = self.mw.graph
            self.agent = create_agent(Stub(), [sql], system_prompt=SYSTEM, checkpointer=saver,
                                      middleware=[self.mw])  # fmt: skip

        def turn(self, n: int, inject: bool = False, wait: float = 0.0) -> dict[str, Any]:
            SEEN.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with self.mw.turn(working_set=1_500, config=self.config, wait=wait) as t:
                    msg = HumanMessage(question(n), id=f"q-{n}")
                    self.agent.invoke({"messages": [msg]}, t.config)
            return row(n, t, self.mw.agent.session.snapshot())

    return Server()


def server(url: str, session_id: str, db: str) -> Any:
    return (sdk_server if FRAMEWORK == "sdk" else langchain_server)(url, session_id, db)


def summary(rows: list[dict[str, Any]]) -> str:
    """The figures of a run: the prompts sent against the window, and each prompt's count
    against its bill from the second turn that bills its kinds."""
    sent = [c["billed"] for r in rows for c in r["calls"]]
    seen: set[str] = set()
    judged = outside = 0
    worst = 0.0
    for r in rows:
        kinds = {k for c in r["calls"] for k in c["kinds"]}
        if kinds <= seen:
            for c in r["checks"]:
                judged += 1
                outside += abs(c["billed"] - c["counted"]) > c["tolerance"]
                worst = max(worst, abs(c["billed"] - c["counted"]) / max(c["counted"], 1))
        seen |= kinds
    return (
        f"{FRAMEWORK}: {len(rows)} turns, {len(sent)} prompts, largest sent {max(sent)} of a "
        f"{WINDOW} window, {sum(n > WINDOW for n in sent)} over it; {judged} prompts judged, "
        f"{outside} outside the billing tolerance, worst |billed - counted| {worst:.2%} of the "
        f"count; max |drift| after turn 1: {max(abs(r['drift']) for r in rows[1:])}; summaries "
        f"delivered {sum(r['delivered'] for r in rows)}; recounts refused "
        f"{sum(1 for r in rows if r['unreconciled'])}"
    )


if __name__ == "__main__":
    if "--summary" in sys.argv:  # the figures instead of the rows
        import contextlib
        import io

        sys.argv = [a for a in sys.argv if a != "--summary"] + ["--json"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            fleet.main(__file__, server, COMPACTOR, "fleet_counting:COMPACTOR",
                       "embedded://counting", "cnt")  # fmt: skip
        print(summary(json.loads(out.getvalue())))
    else:
        fleet.main(__file__, server, COMPACTOR, "fleet_counting:COMPACTOR",
                   "embedded://counting", "cnt")  # fmt: skip
