"""An OpenAI Agents SDK agent whose context the ledger governs.

Each turn: retrieved chunks (12-18, URL ids) go in as documents, the model asks a SQL
tool whose result is sometimes ~22k tokens, then answers. The model is a stub
implementing the SDK's ``Model`` interface (no network); it counts every prompt it is
sent, independently of the ledger.

    python examples/openai_agents_agent.py                     # embedded, 30 turns
    python examples/openai_agents_agent.py --url redis://localhost:6379/0 --processes 2
    python examples/openai_agents_agent.py --drift-at 17       # instructions grow behind the ledger's back

Lines marked `# ledger` are the glue that plugs the ledger in (9 lines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import uuid
import warnings
from collections.abc import AsyncIterator
from typing import Any

from agents import Agent, Model, ModelResponse, Runner, Usage, function_tool, set_tracing_disabled
from agents.testing import assistant_message, function_call

from ledger import AsyncAgent, AsyncLedger, SessionBudget, TiktokenCounter  # ledger
from ledger.adapters.openai_agents import LedgerAgents  # ledger
from ledger.errors import ContextDriftWarning  # the example's report

WINDOW = 16_000
OVERHEAD = 4
SYSTEM = "You are a data analyst. Answer from the documents and the SQL results."  # 15 tokens + 4
TOKENS = TiktokenCounter()  # the stub model's own count (the glue makes its own counter)
WORDS = ["revenue", "margin", "churn", "cohort", "region", "quarter", "pipeline", "forecast", "segment"]
SEEN: list[int] = []  # every prompt the model was sent, in tokens
INJECT = {"on": False}
set_tracing_disabled(True)


def text_of(item: dict[str, Any]) -> str:
    out = item.get("content", item.get("output", ""))
    if isinstance(out, list):
        out = "\n".join(p.get("text", "") for p in out)
    if item.get("type") == "function_call":
        out += f"\n{item['name']}({item['arguments']})"
    return str(out)


class StubModel(Model):
    """Asks for SQL after a question, answers after the SQL result."""

    async def get_response(self, system_instructions: Any, input: Any, *a: Any, **k: Any) -> ModelResponse:
        items = [input] if isinstance(input, str) else input
        SEEN.append(TOKENS(system_instructions or "") + OVERHEAD
                    + sum(TOKENS(text_of(dict(i))) + OVERHEAD for i in items))
        last = dict(items[-1])
        if last.get("role") == "user":
            n = str(last["content"]).split(":")[0]
            out = [function_call("sql", {"q": n}, call_id=f"sql-{n}")]
        else:
            n = str(last.get("call_id", "x")).removeprefix("sql-")
            out = [assistant_message("Based on the rows and documents: " + " ".join(WORDS[:6]), item_id=f"msg-{n}")]
        return ModelResponse(output=out, usage=Usage(), response_id=None)

    def stream_response(self, *a: Any, **k: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the stub model does not stream")


def sql_rows(turn: int) -> str:
    rows = 2_600 if turn % 4 == 3 else random.Random(turn).randint(60, 220)
    return "\n".join(f"{r},{WORDS[r % 9]},{r * 37 % 1000}.{r % 100:02d}" for r in range(rows))


@function_tool
def sql(q: str) -> str:
    """Run the analytics query for question q."""
    return sql_rows(int(q[1:]))


def instructions(ctx: Any, agent: Any) -> str:
    return SYSTEM + (" NOTE " + "unlogged context " * 150 if INJECT["on"] else "")


def chunk_text(i: int) -> str:
    return " ".join(random.Random(i).choice(WORDS) for _ in range(390))


def retrieve(turn: int) -> list[tuple[str, str]]:
    rnd = random.Random(turn)
    return [(f"https://wiki.example.com/analytics/handbook?page={i // 8}&chunk={i}#section-{i % 8}", chunk_text(i))
            for i in rnd.sample(range(400), rnd.randint(12, 18))]


def summarize(items: list[dict[str, Any]]) -> str:
    return f"Summary of {len(items)} earlier items: " + " ".join(WORDS)


BUDGET = SessionBudget(window=16_000, system_prompt=19, output_reserve=1_000, working_memory_floor=1_500, framing_tolerance=8, compaction="agent")  # ledger


class Worker:
    def __init__(self, url: str, session_id: str) -> None:
        self.url, self.session_id = url, session_id
        self.agent = Agent(name="analyst", instructions=instructions, model=StubModel(), tools=[sql])

    async def start(self) -> None:
        session = await AsyncLedger.from_url(self.url).open_session(self.session_id, BUDGET)  # ledger
        self.gov = LedgerAgents(AsyncAgent(session, TiktokenCounter(), item_overhead=4), summarize=summarize)  # ledger

    async def turn(self, n: int, history: list[Any], inject: bool) -> tuple[list[Any], dict[str, Any]]:
        SEEN.clear()
        INJECT["on"] = inject
        docs = [self.gov.document(i, text) for i, text in retrieve(n)]  # ledger
        question = {"role": "user", "content": f"Q{n}: {WORDS[n % 9]} by region?"}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ContextDriftWarning)
            async with self.gov.turn(working_set=1_500) as t:  # ledger
                run_config = self.gov.run_config()  # ledger
                result = await Runner.run(self.agent, [*history, *docs, question], run_config=run_config)
                history = await self.gov.history(result)  # ledger
        snap = await self.gov.agent.session.snapshot()
        assert t.report is not None and t.state is not None
        tool = t.state.tools[-1] if t.state.tools else None
        row = {"turn": n, "prompt": t.report.occupancy + t.report.drift, "occupancy": snap.occupancy,
               "drift": t.report.drift, "flag": t.report.flag, "warned": len(caught),
               "max_sent": max(SEEN), "window": WINDOW,
               "docs": sum(1 for h in history if str(h.get("content", "")).startswith("<document")),
               "spilled": bool(tool and tool.spilled), "tool_tokens": tool.tokens if tool else 0,
               "dropped": len(t.dropped), "compaction_due": t.report.compaction_due, "pid": os.getpid()}
        return history, row


async def serve(url: str, session_id: str) -> None:
    w = Worker(url, session_id)
    await w.start()
    for line in sys.stdin:
        req = json.loads(line)
        history, row = await w.turn(req["turn"], req["history"], req["inject"])
        print(json.dumps({"row": row, "history": history}), flush=True)


async def run(url: str, turns: int, drift_at: int | None, workers: int, session_id: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    history: list[Any] = []
    if workers <= 1:
        w = Worker(url, session_id)
        await w.start()
        for n in range(1, turns + 1):
            history, row = await w.turn(n, history, n == drift_at)
            rows.append(row)
        return rows
    procs = [subprocess.Popen([sys.executable, __file__, "--serve", "--url", url, "--session", session_id],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(workers)]
    try:
        for n in range(1, turns + 1):
            p = procs[n % workers]
            assert p.stdin and p.stdout
            p.stdin.write(json.dumps({"turn": n, "inject": n == drift_at, "history": history}) + "\n")
            p.stdin.flush()
            out = json.loads(p.stdout.readline())
            history = out["history"]
            rows.append({**out["row"], "worker": n % workers})
    finally:
        for p in procs:
            assert p.stdin
            p.stdin.close()
            p.wait(timeout=30)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="embedded://agents-example")
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--drift-at", type=int, default=None)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--session", default=None)
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sid = a.session or f"oa-{uuid.uuid4().hex[:12]}"
    if a.serve:
        return asyncio.run(serve(a.url, sid))
    rows = asyncio.run(run(a.url, a.turns, a.drift_at, a.processes, sid))
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
