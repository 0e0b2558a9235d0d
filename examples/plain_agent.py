"""The agent layer with no framework, served by a fleet: the app keeps its own
conversation, the ledger its numbers.

Each turn: a question and the retrieved chunks (12-18, URL ids) go in with the round trip
that begins the turn (``agent.turn(admit=...)``), the model asks a SQL tool whose result
is sometimes ~22k tokens (spilled), then answers. The model is a stub that counts every
prompt it is sent with its own tokenizer and reports that count as billed.

The conversation is the app's own: a table of versions in SQLite that every process
opens. A turn starts from the version the last ended turn committed (``turn.mark``), so a
turn that died left nothing anyone reads, and ends by writing a new version and committing
its id with ``end_turn``. Compaction is the background worker's (``ledger worker`` with an
LLM summarizer over a stub model, ``COMPACTOR`` below).

    python examples/plain_agent.py                         # embedded, one process
    python examples/plain_agent.py --url redis://localhost:6379/0 --processes 2
    python examples/plain_agent.py --url ... --processes 2 --kill-at 9 --race-at 5 --drift-at 17

Lines marked `# ledger` are the glue that plugs the ledger in.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import time
import warnings
from types import SimpleNamespace
from typing import Any

import fleet

from ledger import Agent, Ledger, SessionBudget, TiktokenCounter  # ledger
from ledger.adapters.summarizer import LLMSummarizer
from ledger.errors import ContextDriftWarning  # the example's report

WINDOW = 16_000
OVERHEAD = 4
SYSTEM = "You are a data analyst. Answer from the documents and the SQL results."
TOKENS = TiktokenCounter()  # the stub model's own count
WORDS = ["revenue", "margin", "churn", "cohort", "region", "quarter", "pipeline", "forecast", "segment"]


def billed(prompt: list[Any]) -> int:
    """What the stub model bills for a prompt: its own count, as a provider's would be."""
    return sum(TOKENS(p if isinstance(p, str) else str(p["content"])) + OVERHEAD for p in prompt)


class StubSummarizer:
    """The worker's summarizer model (anything with ``ainvoke``)."""

    async def ainvoke(self, messages: list[dict[str, str]]) -> Any:
        body = messages[-1]["content"]
        return SimpleNamespace(content=f"Summary of {body.count('[')} earlier items: " + " ".join(WORDS))


# The background worker's compactor: `ledger worker --compactor plain_agent:COMPACTOR`.
COMPACTOR = LLMSummarizer(StubSummarizer(), TOKENS, item_overhead=OVERHEAD)


def sql_rows(turn: int) -> str:
    fleet.crash_here()  # a fleet drill: the process dies inside the tool
    rows = 2_600 if turn % 4 == 3 else random.Random(turn).randint(60, 220)
    return "\n".join(f"{r},{WORDS[r % 9]},{r * 37 % 1000}.{r % 100:02d}" for r in range(rows))


def retrieve(turn: int) -> list[dict[str, str]]:
    rnd = random.Random(turn)
    return [{"id": f"https://wiki.example.com/analytics/handbook?page={i // 8}&chunk={i}#section-{i % 8}",
             "content": " ".join(random.Random(i).choice(WORDS) for _ in range(390))}
            for i in rnd.sample(range(400), rnd.randint(12, 18))]


BUDGET = SessionBudget(window=WINDOW, system_prompt=TOKENS(SYSTEM) + OVERHEAD, output_reserve=1_000, working_memory_floor=1_500, framing_tolerance=8)  # ledger


class Server:
    """One process's agent: its ledger session and the conversation table every process
    shares."""

    def __init__(self, url: str, session_id: str, db: str) -> None:
        self.db = sqlite3.connect(db, timeout=30, isolation_level=None)
        self.db.execute("CREATE TABLE IF NOT EXISTS history (version TEXT PRIMARY KEY, objects TEXT)")
        session = Ledger.from_url(url).open_session(session_id, BUDGET)  # ledger
        self.agent = Agent(session, TOKENS, item_overhead=OVERHEAD)  # ledger

    def load(self, version: str | None) -> list[dict[str, Any]]:
        row = self.db.execute("SELECT objects FROM history WHERE version = ?", (version,)).fetchone()
        return json.loads(row[0]) if row else []

    def track(self, state: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tell this process's agent about the objects another process admitted, so that a
        tool result's evictions hand them back as objects."""
        for consumer, objs in self.held(state).items():
            self.agent.track(consumer, objs)
        return state

    @staticmethod
    def held(state: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """The state's objects by the consumer that holds them."""
        return {"working_memory": [o for o in state if o.get("role") in ("user", "assistant", "system")],
                "retrieval": [o for o in state if "role" not in o],
                "scratchpad": [o for o in state if o.get("role") == "tool"]}

    def turn(self, n: int, inject: bool = False, wait: float = 0.0) -> dict[str, Any]:
        started = time.monotonic()
        question = {"id": f"user-{n}", "role": "user", "content": f"Q{n}: {WORDS[n % 9]} by region?"}
        docs = retrieve(n)
        sent: list[int] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ContextDriftWarning)
            with self.agent.turn(1_500, wait=wait, admit={"working_memory": [question], "retrieval": docs}) as t:  # ledger
                asked, found = t.admissions  # ledger
                state = t.apply(self.track(self.load(t.mark)))  # ledger: the committed version, deliveries applied
                ids = {o["id"] for o in state}
                state += [o for o in [*asked.kept, *found.kept] if o["id"] not in ids]  # (a chunk held already is in it)
                extra = ["NOTE " + "unlogged context " * 150] if inject else []  # behind the ledger's back
                fleet.hold_here()  # a fleet drill: a slow model call, holding the turn
                sent.append(billed([SYSTEM, *state, *extra]))
                t.billed(sent[-1], t.agent.core.prompt_tokens([SYSTEM, *state, *extra]))  # ledger: what the model billed
                result = t.tool_result({"id": f"sql-{n}", "role": "tool", "content": sql_rows(n)})  # ledger
                state = [o for o in state if o not in result.evicted]
                state.append({**result.result, "content": result.text})
                answer = {"id": f"answer-{n}", "role": "assistant",
                          "content": "Based on the rows and documents: " + " ".join(WORDS[:6])}
                prompt = [SYSTEM, *state, *extra]
                sent.append(billed(prompt))
                state += t.admit("working_memory", [answer]).kept  # ledger
                version = f"v{n}-{os.getpid()}-{time.monotonic_ns()}"
                self.db.execute("INSERT INTO history VALUES (?, ?)", (version, json.dumps(state)))
                t.end([*prompt, answer], mark=version)  # ledger: commits the version
        assert t.report is not None and t.state is not None
        if t.report.flagged:  # the prompt drifted from the ledger: set it to the state
            self.agent.reconcile(self.held(state))  # ledger
        snap = self.agent.session.snapshot()
        tool = t.state.tools[-1] if t.state.tools else None
        return {"turn": n, "ledger_turn": t.number, "pid": os.getpid(),
                "prompt": t.report.occupancy + t.report.drift, "occupancy": snap.occupancy,
                "drift": t.report.drift, "flag": t.report.flag, "warned": len(caught),
                "counted": sent[-1], "max_sent": max(sent), "window": WINDOW,
                "docs": sum(1 for o in state if "role" not in o),
                "spilled": bool(tool and tool.spilled), "tool_tokens": tool.tokens if tool else 0,
                "dropped": len(t.state.drop_refs), "delivered": [str(s["id"]) for s in t.summaries],
                "summaries_in_prompt": [str(o["id"]) for o in state if str(o["id"]).startswith("summary-")],
                "high": snap.occupancy > BUDGET.high_water_tokens, "rolled_back": t.rolled_back,
                "waited_s": round(time.monotonic() - started, 3),
                "billed": t.state.billing[-1].billed if t.state.billing else None,
                "billing_flagged": [c.flagged for c in t.state.billing],
                "audit_clean": self.agent.session.audit().clean}


def main() -> None:
    fleet.main(__file__, Server, COMPACTOR, "plain_agent:COMPACTOR", "embedded://plain-example", "pa")


if __name__ == "__main__":
    main()
