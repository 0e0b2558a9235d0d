"""An agent process of tests/test_two_call_turn.py's fleet test: governed turns of two round
trips on one shared session (the turn's first admissions in its begin, a deferred tool
result with the prompt in its end), waiting while another process holds the turn or a
compaction is pending. Prints one JSON line: the turns it committed, the tool results each
became, and every error.

    python tests/support/two_call_agent.py URL PREFIX NAME TURNS SID
"""

from __future__ import annotations

import json
import sys

from ledger import Agent, Ledger, LedgerError, LedgerSettings, SessionBudget

# a low high-water mark: the worker compacts the session every few turns
BUDGET = SessionBudget(window=12_000, system_prompt=200, output_reserve=500, high_water_mark=0.5)


def words(text: str) -> int:
    return len(text.split())


def main(url: str, prefix: str, name: str, turns: int, sid: str) -> None:
    out: dict[str, object] = {"name": name}
    committed: list[int] = []
    tools: list[list[object]] = []
    errors: list[str] = []
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
        s = led.open_session(sid, BUDGET, owner=name)
        agent = Agent(s, words, await_compaction=5.0, poll_interval=0.01)
        for n in range(turns):
            user = {"id": f"{name}-u{n}", "content": f"question {n} " * 20}
            docs = [{"id": f"{name}-d{n}-{k}", "content": "retrieved text " * 60} for k in range(3)]
            try:
                with agent.turn(
                    0, wait=60, admit={"working_memory": [user], "retrieval": docs}
                ) as t:
                    asked, found = t.admissions
                    result = {"id": f"{name}-tool{n}", "content": "rows " * 150}
                    got = t.tool_result(result, defer=True)
                    t.prompt(["x " * 200, *asked.kept, *found.kept, got.text])
                assert t.report is not None
                committed.append(t.number)
                last = t.tools[-1]
                tools.append([last.deferred, last.spilled, last.tokens])
            except (LedgerError, AssertionError) as exc:  # a failed turn: reported, not hidden
                errors.append(f"{type(exc).__name__}: {exc}")
    out.update(committed=committed, tools=tools, errors=errors)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
