"""An OpenAI Agents SDK agent whose context the ledger governs, served by a fleet.

Each turn: retrieved chunks (12-18, URL ids) go in as documents, the model asks a SQL
tool whose result is sometimes ~22k tokens, then answers. The model is a stub
implementing the SDK's ``Model`` interface (no network); it counts every prompt it is
sent with o200k_base, independently of the ledger, and reports that count as billed.

The conversation lives in the SDK's own ``Session``, here the ledger's governed one
(``gov.session``: history in Redis, each ended turn committing a version), so any
process serves any turn; compaction is the background worker's (``ledger worker`` with
an LLM summarizer over a stub model, ``COMPACTOR`` below).

    python examples/openai_agents_agent.py                         # embedded, one process
    python examples/openai_agents_agent.py --url redis://localhost:6379/0 --processes 2
    python examples/openai_agents_agent.py --drift-at 17           # instructions grow behind the ledger's back
    python examples/openai_agents_agent.py --url ... --processes 2 --kill-at 9 --race-at 5

Lines marked `# ledger` are the glue that plugs the ledger in (9 lines, the repair of a
flagged drift included).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import warnings
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import fleet
from agents import Agent, Model, ModelResponse, Runner, Usage, function_tool, set_tracing_disabled
from agents.testing import assistant_message, function_call

from ledger import AsyncAgent, AsyncLedger, SessionBudget, TiktokenCounter  # ledger
from ledger.adapters.openai_agents import LedgerAgents  # ledger
from ledger.adapters.summarizer import LLMSummarizer
from ledger.errors import ContextDriftWarning  # the example's report

WINDOW = 16_000
OVERHEAD = 4
SYSTEM = "You are a data analyst. Answer from the documents and the SQL results."
TOKENS = TiktokenCounter("o200k_base")  # the stub model's own count
WORDS = ["revenue", "margin", "churn", "cohort", "region", "quarter", "pipeline", "forecast", "segment"]
SEEN: list[tuple[int, list[str]]] = []  # every prompt the model was sent: tokens, item ids
INJECT = {"on": False}
set_tracing_disabled(True)


def text_of(item: dict[str, Any]) -> str:
    out = item.get("content", item.get("output", ""))
    if isinstance(out, list):
        out = "\n".join(p.get("text", "") for p in out)
    if item.get("type") == "function_call":
        out += f"\n{item['name']}({item['arguments']})"
    return str(out)


def schema_tokens(tools: Any) -> int:
    """The tool schemas a call sends: name, description and parameters of each."""
    return sum(TOKENS(json.dumps({"name": t.name, "description": t.description,
                                  "parameters": t.params_json_schema}, sort_keys=True)) for t in tools or [])


class StubModel(Model):
    """Asks for SQL after a question, answers after the SQL result; reports its count."""

    async def get_response(self, system_instructions: Any, input: Any, model_settings: Any, tools: Any,
                           *a: Any, **k: Any) -> ModelResponse:
        fleet.hold_here()  # a fleet drill: a slow model call, holding the turn
        items = [input] if isinstance(input, str) else [dict(i) for i in input]
        n_in = (TOKENS(system_instructions or "") + OVERHEAD + schema_tokens(tools)
                + sum(TOKENS(text_of(i)) + OVERHEAD for i in items))
        SEEN.append((n_in, [str(i.get("id", "")) for i in items]))
        last = items[-1]
        if last.get("role") == "user":
            n = str(last["content"]).split(":")[0]
            out = [function_call("sql", {"q": n}, call_id=f"sql-{n}")]
        else:
            n = str(last.get("call_id", "x")).removeprefix("sql-")
            out = [assistant_message("Based on the rows and documents: " + " ".join(WORDS[:6]), item_id=f"msg-{n}")]
        return ModelResponse(output=out, usage=Usage(requests=1, input_tokens=n_in, output_tokens=20,
                                                     total_tokens=n_in + 20), response_id=None)

    def stream_response(self, *a: Any, **k: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the stub model does not stream")


class StubSummarizer:
    """The worker's summarizer model (anything with ``ainvoke``)."""

    async def ainvoke(self, messages: list[dict[str, str]]) -> Any:
        body = messages[-1]["content"]
        return SimpleNamespace(content=f"Summary of {body.count('[')} earlier items: " + " ".join(WORDS))


# The background worker's compactor: `ledger worker --compactor openai_agents_agent:COMPACTOR`.
COMPACTOR = LLMSummarizer(StubSummarizer(), TOKENS, item_overhead=OVERHEAD)


def sql_rows(turn: int) -> str:
    rows = 2_600 if turn % 4 == 3 else random.Random(turn).randint(60, 220)
    return "\n".join(f"{r},{WORDS[r % 9]},{r * 37 % 1000}.{r % 100:02d}" for r in range(rows))


@function_tool
def sql(q: str) -> str:
    """Run the analytics query for question q."""
    fleet.crash_here()  # a fleet drill: the process dies inside the tool
    return sql_rows(int(q[1:]))


def instructions(ctx: Any, agent: Any) -> str:
    return SYSTEM + (" NOTE " + "unlogged context " * 150 if INJECT["on"] else "")


def chunk_text(i: int) -> str:
    return " ".join(random.Random(i).choice(WORDS) for _ in range(390))


def retrieve(turn: int) -> list[tuple[str, str]]:
    rnd = random.Random(turn)
    return [(f"https://wiki.example.com/analytics/handbook?page={i // 8}&chunk={i}#section-{i % 8}", chunk_text(i))
            for i in rnd.sample(range(400), rnd.randint(12, 18))]


BUDGET = SessionBudget(window=16_000, system_prompt=TOKENS(SYSTEM) + OVERHEAD, tool_framing=schema_tokens([sql]), output_reserve=1_000, working_memory_floor=1_500, framing_tolerance=8)  # ledger


class Server:
    """One process's agent: its ledger session and governed SDK session."""

    def __init__(self, url: str, session_id: str, db: str = "") -> None:
        self.loop = asyncio.new_event_loop()
        self.agent = Agent(name="analyst", instructions=instructions, model=StubModel(), tools=[sql])
        self.loop.run_until_complete(self._start(url, session_id))

    async def _start(self, url: str, session_id: str) -> None:
        session = await AsyncLedger.from_url(url).open_session(session_id, BUDGET)  # ledger
        self.gov = LedgerAgents(AsyncAgent(session, TiktokenCounter("o200k_base"), item_overhead=4))  # ledger

    def turn(self, n: int, inject: bool = False, wait: float = 0.0) -> dict[str, Any]:
        return self.loop.run_until_complete(self._turn(n, inject, wait))

    async def _turn(self, n: int, inject: bool, wait: float) -> dict[str, Any]:
        SEEN.clear()
        INJECT["on"] = inject
        started = time.monotonic()
        docs = [self.gov.document(i, text) for i, text in retrieve(n)]  # ledger
        question = {"role": "user", "content": f"Q{n}: {WORDS[n % 9]} by region?"}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ContextDriftWarning)
            async with self.gov.turn(working_set=1_500, wait=wait) as t:  # ledger
                await Runner.run(self.agent, [*docs, question], session=self.gov.session, run_config=self.gov.run_config(), hooks=self.gov.hooks)  # ledger
        assert t.report is not None and t.state is not None
        history = await self.gov.session.get_items()
        if t.report.flagged:  # the prompt drifted from the ledger: set it to the history
            await self.gov.reconcile(history)  # ledger
        snap = await self.gov.agent.session.snapshot()
        tool = t.state.tools[-1] if t.state.tools else None
        return {"turn": n, "ledger_turn": t.number, "pid": os.getpid(),
                "prompt": t.report.occupancy + t.report.drift, "occupancy": snap.occupancy,
                "drift": t.report.drift, "flag": t.report.flag, "warned": len(caught),
                "counted": SEEN[-1][0], "max_sent": max(s for s, _ in SEEN), "window": WINDOW,
                "docs": sum(1 for h in history if str(h.get("content", "")).startswith("<document")),
                "spilled": bool(tool and tool.spilled), "tool_tokens": tool.tokens if tool else 0,
                "dropped": len(t.state.drop_refs), "delivered": [str(s["id"]) for s in t.summaries],
                "summaries_in_prompt": [i for i in SEEN[-1][1] if i.startswith("summary-")],
                "high": snap.occupancy > BUDGET.high_water_tokens, "rolled_back": t.rolled_back,
                "waited_s": round(time.monotonic() - started, 3),
                "billed": t.state.billing[-1].billed if t.state.billing else None,
                "billing_flagged": [c.flagged for c in t.state.billing],
                "audit_clean": (await self.gov.agent.session.audit()).clean}


def main() -> None:
    fleet.main(__file__, Server, COMPACTOR, "openai_agents_agent:COMPACTOR", "embedded://agents-example", "oa")


if __name__ == "__main__":
    main()
