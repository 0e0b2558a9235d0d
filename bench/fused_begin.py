"""A turn's start in one script call instead of three (issue 44), measured.

    python -m bench.fused_begin [--rounds 15] [--n 20]

Starts its own redis-server, runs one agent turn as bench_turn's (a user message, 12
chunks with texts, a tool result) and records the calls of the next turn's first round
trip. On a fresh copy of the state before it (its keys deleted and RESTOREd, not timed)
each phase sends the turn's start `--n` times a round, phases interleaved:

A. today's: MULTI/EXEC of begin_turn + admit (the user message) + admit (the chunks);
B. the three in ONE EVALSHA: one prelude (the _common.lua definitions the three use), each
   script's body a local function run on its own KEYS and ARGV;
C. B as a Redis Function (FUNCTION LOAD once, FCALL).

B's and C's replies are checked to be A's. For context, a whole agent turn and the floor
(bench_turn's: one pipeline of two plain HSETs). Server usec from INFO commandstats.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

import redis
import redis.connection

from bench.common import commandstats, interleaved
from bench.common import ratio_row as row
from ledger import Agent, Ledger, LedgerSettings, SessionBudget, TiktokenCounter, scripts
from ledger.testing import standalone

SENT: list[list[tuple[Any, ...]]] = []  # the pipelines the client packed, while recording


def recording() -> Callable[[], None]:
    conn = redis.connection.Connection
    packs = conn.pack_commands

    def record(self: Any, commands: Any) -> Any:
        SENT.append([tuple(c) for c in commands])
        return packs(self, commands)  # type: ignore[no-untyped-call]

    conn.pack_commands = record  # type: ignore[method-assign]
    return lambda: setattr(conn, "pack_commands", packs)


def fused(names: list[str]) -> str:
    """One chunk running the scripts `names` in order: ARGV[1..2n] the key and argument
    counts of each, then each one's keys and arguments. The prelude's per-call state
    (TALLY, OUT, OLD from KEYS; CALL_TOKEN and the BUCKET table) is set again before each."""
    bodies = [(scripts.lua_dir() / f"{n}.lua").read_text() for n in names]
    pre = scripts.prelude("\n".join(bodies))
    table = ", ".join(f"op{k}" for k in range(len(names)))
    ops = "".join(f"local function op{k}()\n{b}\nend\n" for k, b in enumerate(bodies))
    code = f"""local GK, GA = KEYS, ARGV
local KEYS, ARGV = {{}}, {{}}
{pre}
{ops}local ops, out, ki, ai = {{{table}}}, {{}}, 0, {2 * len(names)}
for i = 1, #ops do
  KEYS, ARGV = {{}}, {{}}
  for j = 1, tonumber(GA[2 * i - 1]) do KEYS[j] = GK[ki + j] end
  for j = 1, tonumber(GA[2 * i]) do ARGV[j] = GA[ai + j] end
  ki, ai = ki + #KEYS, ai + #ARGV
  TALLY, OUT, OLD = KEYS[#KEYS - 2], KEYS[#KEYS - 1], KEYS[#KEYS]
  CALL_TOKEN = false
  for f in pairs(BUCKET) do BUCKET[f] = false end
  out[i] = ops[i]()
end
return out"""
    return scripts.wrap(code)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--n", type=int, default=20)
    a = ap.parse_args()
    n: int = a.n
    with standalone() as srv:
        r = redis.Redis.from_url(srv.url)
        settings = LedgerSettings(redis_url=srv.url, prefix="bt", op_retention_seconds=86_400)
        live = LedgerSettings(redis_url=srv.url, prefix="lv", op_retention_seconds=86_400)
        budget = SessionBudget(window=10_000_000, system_prompt=100)
        with Ledger.from_settings(settings) as led, Ledger.from_settings(live) as led2:
            tok = TiktokenCounter()
            agents = [Agent(led.open_session("turn", budget), tok),
                      Agent(led2.open_session("turn", budget), tok)]  # fmt: skip
            words = ["the", "ledger", "keeps", "every", "worker", "on", "one", "budget", "of",
                     "tokens"]  # fmt: skip

            def text(i: int, n: int) -> str:
                return " ".join(words[(i + k) % len(words)] for k in range(n)) + f" #{i}"

            def turn(i: int, agent: Agent = agents[0]) -> None:
                user = {"id": f"u{i}", "content": text(i, 20)}
                chunks = [{"id": f"c{i}-{k}", "content": text(i * 13 + k, 120)} for k in range(12)]
                with agent.turn(0, admit={"working_memory": [user], "retrieval": chunks}) as t:
                    out = t.tool_result({"id": f"tool{i}", "content": text(i * 7, 200)})
                    t.prompt([user, *chunks, out.text])

            def floor(i: int) -> None:
                fields: dict[Any, Any] = {f"i:r:c{i}-{k}": f"150|{i}|0|{k}" for k in range(12)}
                fields.update({f"i:w:u{i}": f"25|{i}|0|1", f"i:s:tool{i}": f"250|{i}|0|2"})
                texts: dict[Any, Any] = {f"r:c{i}-{k}": text(i * 13 + k, 120) for k in range(12)}
                texts.update({f"w:u{i}": text(i, 20), f"s:tool{i}": text(i * 7, 200)})
                p = r.pipeline(transaction=False)
                p.hset("floor", mapping={**fields, "tn": i, "fr": 1000})
                p.hset("floor:content", mapping=texts)
                p.execute()

            for ag in agents:
                turn(0, ag)
                turn(1, ag)
            state: dict[Any, Any] = {k: r.dump(k) for k in r.scan_iter(match="bt*", count=1000)}
            undo = recording()
            turn(2)
            undo()
            start = next(p for p in SENT if any(str(c[0]).upper() == "EVALSHA" for c in p))
            calls = [c for c in start if str(c[0]).upper() == "EVALSHA"]
            by_sha = {scripts.sha(n): n for n in scripts.NAMES}
            names = [by_sha[str(c[1])] for c in calls]
            assert names == ["begin_turn", "admit", "admit"], names
            counts: list[Any] = []
            keys: list[Any] = []
            args: list[Any] = []
            for c in calls:
                nk = int(c[2])
                counts += [nk, len(c) - 3 - nk]
                keys += c[3 : 3 + nk]
                args += c[3 + nk :]
            code = fused(names)
            sha = r.script_load(code)
            lib = "#!lua name=fusedbench\nredis.register_function('fused', function(KEYS, ARGV)\n"
            r.function_load(lib + code + "\nend)", replace=True)

            def restore() -> None:
                p = r.pipeline(transaction=False)
                p.delete(*r.scan_iter(match="bt*", count=1000))
                for k, v in state.items():
                    p.restore(k, 0, v)
                p.execute()

            def send_a() -> Any:
                p = r.pipeline(transaction=True)
                for c in calls:
                    p.execute_command(*c)  # type: ignore[no-untyped-call]
                return p.execute()

            def send_b() -> Any:
                return r.evalsha(sha, len(keys), *keys, *counts, *args)

            def send_c() -> Any:
                return r.fcall("fused", len(keys), *keys, *counts, *args)

            replies = {}
            for name, send in (("A", send_a), ("B", send_b), ("C", send_c)):
                restore()
                # the same replies but the lease deadline (server TIME + the lease)
                replies[name] = [re.sub(rb"lease=\d+", b"", x) for x in send()]
            assert replies["B"] == replies["C"] == replies["A"], replies
            skip = ("scan", "del", "restore", "config", "info", "multi", "exec")

            def phase(send: Callable[[], Any]) -> Callable[[], float]:
                def go() -> float:
                    usec = 0
                    for _ in range(n):
                        restore()
                        r.config_resetstat()
                        send()
                        usec += sum(u for _, u in commandstats(r, skip).values())
                    return float(usec) / n

                return go

            nxt = [3]

            def whole(step: Callable[[int], None]) -> Callable[[], float]:
                def go() -> float:
                    r.config_resetstat()
                    for i in range(nxt[0], nxt[0] + n):
                        step(i)
                    nxt[0] += n
                    return float(sum(u for _, u in commandstats(r, skip).values())) / n

                return go

            restore()
            t = interleaved(a.rounds, {"A": phase(send_a), "B": phase(send_b), "C": phase(send_c),
                                       "turn": whole(lambda i: turn(i, agents[1])),
                                       "floor": whole(floor)})  # fmt: skip
            rest = [x - y for x, y in zip(t["turn"], t["A"], strict=True)]
            with_b = [x + y for x, y in zip(rest, t["B"], strict=True)]
            with_c = [x + y for x, y in zip(rest, t["C"], strict=True)]
            print(f"{'server us':<44} {'this':>10} {'reference':>10}  ratio (min-max)")
            for line in (
                row("B: turn start in one EVALSHA vs A", t["B"], t["A"], "A: MULTI/EXEC of 3"),
                row("C: B as FCALL vs A", t["C"], t["A"], "one FUNCTION LOAD"),
                row("A: today's turn start vs the floor", t["A"], t["floor"], "floor: 2 HSETs"),
                row("whole turn today vs the floor", t["turn"], t["floor"], "target <= 8x"),
                row("  turn less A (finish_turn) vs floor", rest, t["floor"], ""),
                row("  whole turn with B instead of A", with_b, t["floor"], "vs the floor"),
                row("  whole turn with C instead of A", with_c, t["floor"], "vs the floor"),
            ):  # fmt: skip
                print(line, flush=True)


if __name__ == "__main__":
    main()
