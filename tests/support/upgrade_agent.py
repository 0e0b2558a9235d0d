"""An agent process of tests/test_upgrade.py, run by the ledger release its PYTHONPATH
names (the one deployed before the upgrade, or this one): turns on shared sessions, each
begun (waiting while another process holds the turn or a compaction is pending), given a
working-memory item, ended. Prints one JSON line: the turns it served and every error.

    python tests/support/upgrade_agent.py URL PREFIX NAME TURNS SID [SID ...]

Only the API both releases have: Ledger.from_url, open_session, begin_turn, admit,
end_turn."""

from __future__ import annotations

import json
import sys
import time

import ledger
from ledger import (
    CompactionPending,
    Item,
    Ledger,
    LedgerError,
    LedgerSettings,
    SessionBudget,
    TurnInProgress,
)

# H = 7_200: about 17 turns of 400 tokens make a compaction due; the worker's simulated
# compactor then summarizes all but the two newest items (to 10-60%).
BUDGET = SessionBudget(window=10_000, system_prompt=500, output_reserve=500)


def main(url: str, prefix: str, name: str, turns: int, sids: list[str]) -> None:
    out: dict[str, object] = {"name": name, "ledger": ledger.__file__, "turns": 0, "errors": []}
    errors: list[str] = []
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
        handles = [led.open_session(sid, BUDGET, owner=name) for sid in sids]
        for t in range(turns):
            for s in handles:
                deadline = time.monotonic() + 30
                try:
                    while True:
                        try:
                            started = s.begin_turn(working_set=300, await_compaction=True)
                            break
                        except (TurnInProgress, CompactionPending):
                            if time.monotonic() > deadline:
                                raise
                            time.sleep(0.005)
                    s.admit("working_memory", [Item(f"{name}-{t}", 400)])
                    s.end_turn(started.turn, 1_000)
                    out["turns"] = int(str(out["turns"])) + 1
                except (LedgerError, Warning) as exc:  # a failed turn: reported, not hidden
                    errors.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.01)  # (room for the worker between turns)
    out["errors"] = errors
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
