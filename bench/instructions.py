"""Instructions a script call costs inside Redis, counted by callgrind: stable where timings
on a shared machine are not.

    python -m bench.instructions [--against <git revision>] [--calls 200] [--turns 20]

Starts `redis-server` under `valgrind --tool=callgrind`, collecting only inside
`evalShaCommand` (so a script call's own Redis commands count, the client's setup does
not), once for the working tree's scripts and, with `--against`, once for the scripts as
assembled at that revision (`bench.lua_costs.sources_at`; the same client sends both, so
KEYS and ARGV are the same). Each phase is counted alone (`callgrind_control` zeroes the
counts before it and dumps them after); the figure is thousands of instructions per call,
or per turn:

- admit: a single-item retrieval admit on a session holding 1,000 items and outcomes, as
  `bench.bench_turn` times it;
- reference: `bench/admit_reference.lua` (the careful hand-written admit) on the same
  kind of session;
- admit of 12: twelve retrieval chunks with their texts (8.4 KB), on a fresh session;
- turn: an agent turn (begin with a user message and 12 chunks, a tool result deferred to
  finish_turn, the prompt), after 5 turns not counted.

Needs valgrind and callgrind_control on the PATH; the counts vary by well under 1% from one
run to the next.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from bench.common import ROOT, table
from bench.lua_costs import sources_at
from ledger import Agent, Item, Ledger, LedgerSettings, SessionBudget, scripts

BIG = SessionBudget(window=100_000_000, system_prompt=100)
WORDS = ["the", "ledger", "keeps", "every", "worker", "on", "one", "budget", "of", "tokens"]


def text(i: int, n: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n)) + f" #{i}"


@contextmanager
def callgrind_server(
    inside: str = "evalShaCommand",
) -> Iterator[tuple[redis.Redis, Callable[[], float]]]:
    """A redis-server under callgrind: (client, count) where count() returns the
    instructions inside the server's function `inside` (EVALSHA's by default;
    `processCommand` for every command a client sends) since the previous count() (the
    first: since the start)."""
    for tool in ("valgrind", "callgrind_control", "redis-server"):
        if not shutil.which(tool):
            raise SystemExit(
                f"counting instructions needs {tool} on the PATH (apt-get install valgrind)"
            )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="bench-cg-") as d:
        out = Path(d) / "cg.out"
        proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no",
             f"--toggle-collect={inside}", f"--callgrind-out-file={out}",
             "redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        r = redis.Redis(port=port)
        try:
            for _ in range(600):
                try:
                    r.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.1)

            def control(flag: str) -> None:
                subprocess.run(["callgrind_control", flag, str(proc.pid)], check=True,
                               capture_output=True)  # fmt: skip

            def count() -> float:
                before = set(Path(d).glob("cg.out.*"))
                control("-d")
                for _ in range(600):
                    new = set(Path(d).glob("cg.out.*")) - before
                    if new:
                        break
                    time.sleep(0.05)
                (dump,) = new
                for _ in range(100):  # (written once the totals line is there)
                    lines = [ln for ln in dump.read_text().splitlines()
                             if ln.startswith(("summary:", "totals:"))]  # fmt: skip
                    if lines:
                        return float(lines[0].split()[1])
                    time.sleep(0.05)
                raise RuntimeError(f"no totals in {dump}")

            control("-z")
            yield r, count
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def fill(led: Ledger, name: str) -> Any:
    s = led.open_session(name, BIG)
    calls = [s.admit_call("retrieval", [Item(f"h{i}", 1)]) for i in range(1000)]
    for i in range(0, len(calls), 500):
        led.run_many(calls[i : i + 500])
    return s


def measure(sources: dict[str, str], calls: int, turns: int) -> dict[str, float]:
    """Thousands of instructions per call (per turn) of each phase, for these scripts."""
    original = scripts.source
    scripts.source = sources.__getitem__  # type: ignore[assignment]  # (the ledger loads these)
    try:
        with callgrind_server() as (r, count):
            url = f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}"
            settings = LedgerSettings(redis_url=url, prefix="cg", op_retention_seconds=86_400)
            led = Ledger.from_settings(settings)
            got: dict[str, float] = {}

            def phase(name: str, n: int, body: Callable[[], object]) -> None:
                count()
                body()
                got[name] = count() / n / 1000

            own, mine = fill(led, "adm"), fill(led, "ref")
            admits = [own.admit_call("retrieval", [Item(f"n{i}", 1)]) for i in range(calls)]
            phase("admit, 1 item (1,000 items + outcomes)", calls, lambda: led.run_many(admits))
            ref = r.register_script((ROOT / "bench" / "admit_reference.lua").read_text())
            tag = mine.keys.session.rsplit(":s:", 1)[0]

            def reference() -> None:
                p = r.pipeline(transaction=False)
                for _ in range(calls):
                    op, iid = uuid.uuid4().hex, uuid.uuid4().hex
                    ref(keys=[mine.keys.session, f"{tag}:op:{mine.id}:{op}"],
                        args=[op, mine.epoch, "r", iid, 1, 0, 3_600_000], client=p)  # fmt: skip
                p.execute()

            ref(keys=[mine.keys.session, f"{tag}:op:{mine.id}:w"],
                args=["w", mine.epoch, "r", "w", 1, 0, 3_600_000])  # fmt: skip  # (loaded)
            phase("the careful reference (bench/admit_reference.lua)", calls, reference)
            batch = led.open_session("batch", BIG)
            n12 = max(calls // 10, 5)
            twelve = [batch.admit_call("retrieval", [Item(f"c{i}-{k}", 150) for k in range(12)],
                                       texts=[text(i * 13 + k, 120) for k in range(12)])
                      for i in range(n12)]  # fmt: skip
            phase("admit of 12 chunks with texts", n12, lambda: led.run_many(twelve))
            agent = Agent(led.open_session("turn", SessionBudget(window=10_000_000,
                                                                 system_prompt=100)),
                          lambda t: max(1, len(t) // 4))  # fmt: skip
            history: list[dict[str, str]] = []

            def turn(i: int) -> None:
                user = {"id": f"u{i}", "content": text(i, 20)}
                chunks = [{"id": f"c{i}-{k}", "content": text(i * 13 + k, 120)}
                          for k in range(12)]  # fmt: skip
                with agent.turn(0, admit={"working_memory": [user], "retrieval": chunks}) as t:
                    out = t.tool_result({"id": f"tool{i}", "content": text(i * 7, 200)},
                                        defer=True)  # fmt: skip
                    t.prompt(["system", *history, user, *chunks, out.text])
                history.append(user)

            for i in range(5):
                turn(i)
            phase("agent turn (begin + 2 admits, finish_turn)", turns,
                  lambda: [turn(i) for i in range(5, 5 + turns)])  # fmt: skip
            led.close()
            return got
    finally:
        scripts.source = original  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--against", metavar="REV", help="also count the scripts of git revision REV")
    ap.add_argument("--calls", type=int, default=200, help="single admits per phase")
    ap.add_argument("--turns", type=int, default=20, help="agent turns counted")
    a = ap.parse_args()
    tree = {n: scripts.source(n) for n in scripts.NAMES}
    runs = {"working tree": measure(tree, a.calls, a.turns)}
    if a.against:
        runs[a.against] = measure(sources_at(a.against, scripts.NAMES), a.calls, a.turns)
    names = list(runs["working tree"])
    head = ["k instructions per call", *runs]
    rows = [[n, *(f"{v[n]:,.1f}" for v in runs.values())] for n in names]
    if a.against:
        head.append("tree / rev")
        for row, n in zip(rows, names, strict=True):
            row.append(f"{runs['working tree'][n] / runs[a.against][n]:.3f}")
    ref = "the careful reference (bench/admit_reference.lua)"
    rows.append(["admit / the reference", *(f"{v[names[0]] / v[ref]:.2f}x" for v in runs.values()),
                 *([""] if a.against else [])])  # fmt: skip
    table("Instructions inside EVALSHA (callgrind)", head, rows)


if __name__ == "__main__":
    main()
