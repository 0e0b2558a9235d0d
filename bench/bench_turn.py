"""The cost of a governed turn, each figure beside its reference as a ratio.

    python -m bench.bench_turn [--rounds 15] [--calls 200] [--outcomes 100000] [--items 10000]
                               [--held working_memory|retrieval]

Starts its own redis-server. Phases are interleaved in every round (their order
alternates); each row prints the median ratio over the rounds with its min-max. Server
time is INFO commandstats usec (CONFIG RESETSTAT before each phase).

1. admit: a single-item admit (`ledger/lua/admit.lua`) on a session holding 1,000 items and
   1,000 outcomes, against `bench/admit_reference.lua` (a careful hand-written admit:
   every argument checked, at-most-once through an op key SET PX, epoch fence) on a
   session filled the same way; calls back to back in pipelines.
2. history: the same admit at `--outcomes` retained outcomes against 1,000, and the
   outcome hashes' memory per retained outcome (MEMORY USAGE).
3. turn: an agent turn (begin, a user message, 12 chunks, one tool result, end with the
   prompt as a list), against one pipeline writing the same items with plain HSETs:
   round trips (requests sent), server usec and client CPU per turn; the tokenizer's
   calls and CPU per turn apart (a real BPE tokenizer).
4. reclaim: a `begin_turn` that reclaims one scratchpad item on a session holding
   `--items` items of `--held` (retrieval chunks are in the reclaim-order index with the
   scratchpad, working memory is not), with the index and without it (as a client that
   does not send it), against a `begin_turn` on it that reclaims nothing; and a small
   session's admits right after such a begin_turn against right before it.

With `--against <commit>` (e.g. a8b2daf, protocol 2) it prints instead this tree's governed
turn beside that commit's, both run in client processes of their own (`bench/turn_child.py`,
the older `ledger` unpacked with `git archive` onto its PYTHONPATH) on the one redis-server,
their phases interleaved: turns per Redis core (1e6 / server usec per turn), round trips per
turn, server time and client CPU (without the tokenizer) against the floor (one pipeline
writing the same counters and texts), admit against the careful reference, the careful
two-call turn of `bench/turn_reference.lua` in its three forms (as it is, with the texts left
out of its fingerprint, its commands alone; each on a session of its own) beside the floor
and in turns per core, and 32 processes admitting on one session against WATCH/MULTI with
their p99 (`--procs`, `--seconds`). `--warmup` rounds run first, uncounted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis
import redis.connection

from bench.common import ratio_row as row
from ledger import Agent, Item, Ledger, LedgerSettings, SessionBudget, TiktokenCounter
from ledger.client import Session
from ledger.testing import standalone

BIG = SessionBudget(window=100_000_000, system_prompt=100)
RECLAIM = SessionBudget(window=200_000, system_prompt=100, output_reserve=0)
SENT = [0]  # requests sent (round trips: a pipeline is one)
NAMES: set[str] = set()  # the commands the client sent


def _counting_sends() -> None:
    conn = redis.connection.Connection
    send, one, packs = conn.send_packed_command, conn.send_command, conn.pack_commands

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        SENT[0] += 1
        send(self, command, check_health)

    def named(self: Any, *args: Any, **kwargs: Any) -> None:
        NAMES.add(str(args[0]).lower())
        one(self, *args, **kwargs)

    def all_named(self: Any, commands: Any) -> Any:
        NAMES.update(str(c[0]).lower() for c in commands)
        return packs(self, commands)

    conn.send_packed_command = counted  # type: ignore[method-assign]
    conn.send_command = named  # type: ignore[method-assign]
    conn.pack_commands = all_named  # type: ignore[method-assign]


@contextmanager
def server_usec(r: redis.Redis, out: list[float]) -> Iterator[None]:
    """Appends the server usec of the commands the block sent: a script's includes the
    commands it calls; MULTI/EXEC are left out (EXEC's time is the commands it runs)."""
    r.config_resetstat()
    NAMES.clear()
    yield
    sent = NAMES - {"multi", "exec", "config resetstat", "info"}
    st = r.info("commandstats")
    out.append(sum(float(st[f"cmdstat_{n}"]["usec"]) for n in sent if f"cmdstat_{n}" in st))


def fill(led: Ledger, s: Session, items: int, outcomes: int) -> None:
    """`items` held retrieval items, then single-item admit/release pairs up to
    `outcomes` outcomes in all."""
    calls: list[Any] = [s.admit_call("retrieval", [Item(f"h{i}", 1)]) for i in range(items)]
    calls += [
        s.admit_call("scratchpad", [Item("churn", 1)])
        if i % 2 == 0
        else s.release_call("scratchpad", ["churn"])
        for i in range(max(outcomes - items, 0))
    ]
    for i in range(0, len(calls), 1000):
        led.run_many(calls[i : i + 1000])


def admits(led: Ledger, s: Session, n: int, tag: str) -> Callable[[], None]:
    def go() -> None:
        led.run_many([s.admit_call("retrieval", [Item(f"{tag}{uuid.uuid4().hex}", 1)])
                      for _ in range(n)])  # fmt: skip

    return go


def bench_admit(led: Ledger, r: redis.Redis, a: argparse.Namespace) -> list[str]:
    ref = r.register_script(Path(__file__).with_name("admit_reference.lua").read_text())
    own, mine, big = (led.open_session(f"adm-{n}", BIG) for n in ("ledger", "ref", "history"))
    for s, k in ((own, 1000), (mine, 1000), (big, a.outcomes)):
        fill(led, s, 1000, 1000 + k if s is big else 2000)
    tag = mine.keys.session.rsplit(":s:", 1)[0]

    def reference() -> None:
        p = r.pipeline(transaction=False)
        for _ in range(a.calls):
            op, iid = uuid.uuid4().hex, uuid.uuid4().hex
            ref(keys=[mine.keys.session, f"{tag}:op:{mine.id}:{op}"],
                args=[op, mine.epoch, "r", iid, 1, 0, 3_600_000], client=p)  # fmt: skip
        p.execute()

    t: dict[str, list[float]] = {k: [] for k in ("ledger", "ref", "history")}
    phases = {"ledger": admits(led, own, a.calls, "n"), "ref": reference,
              "history": admits(led, big, a.calls, "n")}  # fmt: skip
    for rnd in range(a.rounds):
        for name in sorted(phases, reverse=rnd % 2 == 1):
            with server_usec(r, t[name]):
                phases[name]()
    per = {k: [u / a.calls for u in v] for k, v in t.items()}
    mem = [
        sum(r.memory_usage(k, samples=0) or 0 for k in (s.keys.outcomes, s.keys.outcomes_old))
        for s in (own, big)
    ]
    count = [2000 + a.rounds * a.calls, 1000 + a.outcomes + a.rounds * a.calls]
    return [
        row("admit, 1,000 items + 1,000 outcomes (us)", per["ledger"], per["ref"],
            "target <= 1.2x the careful hand-written admit"),
        row(f"admit at {a.outcomes:,} outcomes vs 1,000 (us)", per["history"], per["ledger"],
            "target <= 1.15x"),
        f"{'memory per retained outcome (B)':<44} {mem[1] / count[1]:10.1f} "
        f"{mem[0] / count[0]:10.1f}  at {count[1]:,} / {count[0]:,} outcomes; target <= 64 B",
    ]  # fmt: skip


class Tokenizer:
    """The real BPE tokenizer, its calls and CPU counted."""

    def __init__(self) -> None:
        self.enc, self.calls, self.cpu = TiktokenCounter(), 0, 0.0

    def __call__(self, text: str) -> int:
        t = time.process_time()
        n = self.enc(text)
        self.calls += 1
        self.cpu += time.process_time() - t
        return n


def bench_turn(led: Ledger, r: redis.Redis, a: argparse.Namespace) -> list[str]:
    s = led.open_session("turn", SessionBudget(window=10_000_000, system_prompt=100))
    tok = Tokenizer()
    agent = Agent(s, tok)
    system = "You answer from the documents. " * 10
    history: list[dict[str, str]] = []
    words = ["the", "ledger", "keeps", "every", "worker", "on", "one", "budget", "of", "tokens"]

    def text(i: int, n: int) -> str:
        return " ".join(words[(i + k) % len(words)] for k in range(n)) + f" #{i}"

    Turn = tuple[dict[str, str], list[dict[str, str]], dict[str, str]]

    def inputs(i: int) -> Turn:
        """The app's objects of turn i (made before the timing: the app's work, not the
        ledger's): a user message, 12 chunks, a tool result."""
        user = {"id": f"u{i}", "content": text(i, 20)}
        chunks = [{"id": f"c{i}-{k}", "content": text(i * 13 + k, 120)} for k in range(12)]
        return user, chunks, {"id": f"tool{i}", "content": text(i * 7, 200)}

    def turn(i: int, objs: Turn) -> None:
        user, chunks, tool = objs
        with agent.turn(0, admit={"working_memory": [user], "retrieval": chunks}) as t:
            out = t.tool_result(tool)
            t.prompt([system, *history, user, *chunks, out.text])
        history.append(user)

    def floor(i: int, objs: Turn) -> None:
        """The same items and texts written with two plain HSETs in one pipeline."""
        user, chunks, tool = objs
        fields = {f"i:r:{c['id']}": f"150|{i}|0|{k}" for k, c in enumerate(chunks)}
        fields.update({f"i:w:{user['id']}": f"25|{i}|0|1", f"i:s:{tool['id']}": f"250|{i}|0|2"})
        texts = {f"r:{c['id']}": c["content"] for c in chunks}
        texts.update({f"w:{user['id']}": user["content"], f"s:{tool['id']}": tool["content"]})
        p = r.pipeline(transaction=False)
        p.hset("floor", mapping={**fields, "tn": i, "fr": 1000})
        p.hset("floor:content", mapping=texts)
        p.execute()

    usec: dict[str, list[float]] = {"turn": [], "floor": []}
    cpu: dict[str, list[float]] = {"turn": [], "floor": []}
    sent: dict[str, list[float]] = {"turn": [], "floor": []}
    calls, tcpu = [], []
    turn(0, inputs(0))  # the agent's first turn asks once whether a worker compacts it
    n = max(a.calls // 20, 5)
    for rnd in range(a.rounds):
        for name, step in sorted({"turn": turn, "floor": floor}.items(), reverse=rnd % 2 == 1):
            objs = [(1 + rnd * n + i, inputs(1 + rnd * n + i)) for i in range(n)]
            c0, k0, s0, t0 = tok.calls, tok.cpu, SENT[0], time.process_time()
            with server_usec(r, usec[name]):
                for i, o in objs:
                    step(i, o)
            cpu[name].append((time.process_time() - t0 - (tok.cpu - k0)) * 1e6 / n)
            sent[name].append((SENT[0] - s0 - 2) / n)  # less RESETSTAT and INFO
            if name == "turn":
                calls.append((tok.calls - c0) / n)
                tcpu.append((tok.cpu - k0) * 1e6 / n)
    us = {k: [u / n for u in v] for k, v in usec.items()}
    return [
        row("governed turn: round trips", sent["turn"], sent["floor"], "target <= 3"),
        row("governed turn: server us", us["turn"], us["floor"], "target <= 5x"),
        row("governed turn: client CPU us, no tokenizer", cpu["turn"], cpu["floor"],
            "target <= 3x"),
        f"{'governed turn: tokenizer calls, CPU us':<44} {statistics.median(calls):10.1f} "
        f"{statistics.median(tcpu):10.1f}  14 new objects a turn",
    ]  # fmt: skip


def bench_reclaim(led: Ledger, r: redis.Redis, a: argparse.Namespace) -> list[str]:
    s = led.open_session("reclaim", RECLAIM)
    small = led.open_session("small", BIG)
    fill(led, small, 10, 0)
    held = a.items - 2
    for i in range(0, held, 1000):
        led.run_many([s.admit_call(a.held, [Item(f"w{j}", 5)])
                      for j in range(i, min(i + 1000, held))])  # fmt: skip
    # the working set: 20,000 tokens under the residual without scratchpad; the two
    # scratchpad items (35,000) leave it short, reclaiming the older one (30,000) is enough
    want = 200_000 - 100 - 20_000 - (0 if a.held == "working_memory" else 5 * held)
    t: dict[str, list[float]] = {k: [] for k in ("reclaim", "scan", "plain", "before", "after")}
    small_admits = admits(led, small, 50, "g")
    for rnd in range(a.rounds):
        for name in ("reclaim", "scan", "plain")[:: 1 if rnd % 2 == 0 else -1]:
            s.admit("scratchpad", [Item(f"x{rnd}{name}", 30_000), Item(f"y{rnd}{name}", 5_000)])
            call = s.begin_turn_call(0 if name == "plain" else want, 0)
            if name == "scan":  # sent as a client without the reclaim-order index sends it
                call = replace(call, keys=tuple(k for k in call.keys if k != s.keys.order))
            if name == "reclaim":
                with server_usec(r, t["before"]):
                    small_admits()
            with server_usec(r, t[name]):
                st = led.run(call)
            if name == "reclaim":
                with server_usec(r, t["after"]):
                    small_admits()
            assert [i for _, i in st.reclaimed] == ([] if name == "plain" else [f"x{rnd}{name}"])
            s.end_turn(st.turn, 100 + 5 * held)
            gone = [f"y{rnd}{name}"] + ([f"x{rnd}{name}"] if name == "plain" else [])
            s.release("scratchpad", gone)
    return [
        row(f"reclaiming begin_turn at {a.items:,} items (us)", t["reclaim"], t["plain"],
            f"{a.held} held; vs one that reclaims nothing; target <= 1 ms"),
        row("  the same without the reclaim-order index", t["scan"], t["plain"],
            "HSCAN of the session, as clients that do not send it"),
        row("small session's 50 admits after it vs before", t["after"], t["before"],
            "target <= 1.1x"),
    ]  # fmt: skip


ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).with_name("turn_child.py")


class Client:
    """A `bench/turn_child.py` process on one tree's `ledger`."""

    def __init__(self, tree: Path, url: str, prefix: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
        env["PYTHONPATH"] = str(tree)
        pipe = subprocess.PIPE
        self.p = subprocess.Popen([sys.executable, str(CHILD), url, prefix], env=env,
                                  stdin=pipe, stdout=pipe, text=True)  # fmt: skip
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{CHILD.name} ended (exit {self.p.wait()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write('{"cmd": "quit"}\n')
        self.p.stdin.close()
        self.p.wait(timeout=60)


def commandstats_usec(r: redis.Redis, names: list[str]) -> float:
    """Server usec since CONFIG RESETSTAT of the commands a client sent (a script's own
    commands are in its time); MULTI/EXEC left out (EXEC's time is the commands it runs)."""
    st = r.info("commandstats")
    sent = set(names) - {"multi", "exec"}
    return sum(float(st[f"cmdstat_{n}"]["usec"]) for n in sent if f"cmdstat_{n}" in st)


def contend(
    url: str, tree: Path, mode: str, procs: int, seconds: float, prefix: str
) -> tuple[float, float]:
    """`procs` processes admitting on one session (or WATCH/MULTI on one hash) for
    `seconds`: (ops/s of all, p99 ms of one call)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    env["PYTHONPATH"] = str(tree)
    pipe = subprocess.PIPE
    ps = [subprocess.Popen([sys.executable, str(CHILD), "contend", url, prefix, mode,
                            str(seconds)], env=env, stdin=pipe, stdout=pipe, text=True)
          for _ in range(procs)]  # fmt: skip
    for p in ps:  # every process connected and warmed up
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    start = time.time() + 0.5
    for p in ps:
        assert p.stdin is not None
        p.stdin.write(f"{start}\n")
        p.stdin.flush()
    got = [json.loads(p.communicate(timeout=seconds + 300)[0].strip().splitlines()[-1])
           for p in ps]  # fmt: skip
    lat = sorted(x for g in got for x in g["lat"])
    return sum(g["ops"] for g in got) / seconds, lat[int(0.99 * (len(lat) - 1))] * 1e3


class Meter:
    """A phase's server cost: INFO commandstats usec of the commands the client sent
    (`bench.turn_instructions` counts instructions instead)."""

    unit = "us"

    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def start(self) -> None:
        self.r.config_resetstat()

    def stop(self, names: list[str]) -> float:
        return commandstats_usec(self.r, names)


def against(url: str, a: argparse.Namespace, meter: Meter | None = None) -> Iterator[str]:
    """This tree's turn beside `a.against`'s, in client processes of their own."""
    r = redis.Redis.from_url(url)
    m = meter or Meter(r)
    u = m.unit
    with tempfile.TemporaryDirectory(prefix="bench-old-") as d:
        # (the scripts live in lua/ beside the package since 0a956ef, in ledger/lua/ before)
        has_lua = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{a.against}:lua"],
                                 capture_output=True).returncode == 0  # fmt: skip
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", a.against, "ledger",
                              *(["lua"] if has_lua else [])],
                             capture_output=True, check=True)  # fmt: skip
        subprocess.run(["tar", "-x", "-C", d], input=tar.stdout, check=True)
        trees = {"new": ROOT, "old": Path(d)}
        kids = {k: Client(t, url, f"bt{k}") for k, t in trees.items()}
        try:
            head = f"this tree: {'two-call' if kids['new'].hello['two'] else 'three-call'} turn"
            figures: dict[str, dict[str, list[float]]] = {}
            n = max(a.calls // 20, 5)
            phases = [("new", "turn"), ("old", "turn"), ("new", "floor"), ("new", "refturn"),
                      ("new", "digestturn"), ("new", "bareturn"), ("new", "admit"), ("new", "ref"),
                      ("old", "admit")]  # fmt: skip
            if kids["new"].hello["two"] and meter is None:  # (the child meters its ends)
                phases.append(("new", "ends"))
            for rnd in range(a.warmup + a.rounds):
                for who, what in phases[:: 1 if rnd % 2 == 0 else -1]:
                    start = 1 + rnd * n
                    calls = (
                        n if what in ("turn", "floor", "ends") or what.endswith("turn") else a.calls
                    )
                    m.start()
                    out = kids[who].ask(cmd=what, n=calls, start=start)
                    usec = m.stop(out.pop("names")) / calls
                    if what == "ends":  # (measured by the child around each end)
                        usec = out["finish"]
                    if rnd < a.warmup:  # (rounds that warm the server up, not counted)
                        continue
                    f = figures.setdefault(f"{who}.{what}", {})
                    for k, v in {"usec": usec, **out}.items():
                        f.setdefault(k, []).append(float(v))
        finally:
            for k in kids.values():
                k.close()
        rows = [head]
        nt, ot, fl = figures["new.turn"], figures["old.turn"], figures["new.floor"]
        rt, dt, bt = (figures[f"new.{k}turn"] for k in ("ref", "digest", "bare"))
        core = {k: [1e6 / u for u in v["usec"]] for k, v in
                (("new", nt), ("old", ot), ("ref", rt), ("digest", dt))}  # fmt: skip
        rows += [
            row(f"turns per Redis core (1e6 / server {u})", core["new"], core["old"],
                f"vs {a.against}; target >= 3x"),
            row("  the careful turn's, the same", core["ref"], core["old"],
                "bench/turn_reference.lua: what a careful design reaches"),
            row("  the same, texts' digest from the client", core["digest"], core["old"], "~"),
            row("round trips per turn", nt["sent"], ot["sent"], "target <= 2 (absolute)"),
            row(f"turn server {u} vs the floor", nt["usec"], fl["usec"], "target <= 8x"),
            row(f"  {a.against}'s turn vs the floor", ot["usec"], fl["usec"], "before"),
            row("  the careful two-call turn vs the floor", rt["usec"], fl["usec"],
                "same promises, none of the rules"),
            row("  the same, texts' digest from the client", dt["usec"], fl["usec"], "~"),
            row("  its commands alone vs the floor", bt["usec"], fl["usec"],
                "the same Redis commands, nothing checked"),
            row(f"turn server {u} vs the careful turn", nt["usec"], rt["usec"], "this tree"),
            row("turn client CPU us (no tokenizer) vs floor", nt["cpu_us"], fl["cpu_us"],
                "target <= 3.5x"),
            row(f"  {a.against}'s turn vs the floor", ot["cpu_us"], fl["cpu_us"], "before"),
            row("turn client CPU us vs the old head's", nt["cpu_us"], ot["cpu_us"],
                f"vs {a.against}, no tokenizer"),
            row(f"admit server {u} vs the careful reference", figures["new.admit"]["usec"],
                figures["new.ref"]["usec"], "1,000 items + outcomes; target <= 2.0x"),
            row(f"  {a.against}'s admit vs the reference", figures["old.admit"]["usec"],
                figures["new.ref"]["usec"], "before"),
            f"{'tokenizer calls per turn':<44} {statistics.median(nt['tok_calls']):10.1f} "
            f"{statistics.median(ot['tok_calls']):10.1f}",
        ]  # fmt: skip
        if "new.ends" in figures:
            e = figures["new.ends"]
            rows.append(row("end: finish_turn vs admit_tool+end_turn", e["finish"],
                            e["two"], "server us, one call at a time"))  # fmt: skip
        yield from rows
        if a.procs:
            from bench import alternatives as alt

            alt.open_session(r, "alt:shared", 10**12)
            got: dict[str, list[tuple[float, float]]] = {"new": [], "old": [], "watch": []}
            for rnd in range(a.contend_rounds):
                for who in ("new", "old", "watch")[:: 1 if rnd % 2 == 0 else -1]:
                    mode, tree = ("watch", ROOT) if who == "watch" else ("ledger", trees[who])
                    got[who].append(contend(url, tree, mode, a.procs, a.seconds, f"bt32{who}"))
            for who in ("new", "old"):
                yield row(f"{a.procs} procs, one session, ops/s vs WATCH ({who})",
                          [x for x, _ in got[who]], [x for x, _ in got["watch"]],
                          "target >= 10x")  # fmt: skip
                yield row(f"  p99 ms ({who}) vs WATCH's", [p for _, p in got[who]],
                          [p for _, p in got["watch"]], "target <= 10 ms")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--outcomes", type=int, default=100_000)
    ap.add_argument("--items", type=int, default=10_000)
    ap.add_argument("--held", default="working_memory", choices=["working_memory", "retrieval"])
    ap.add_argument("--against", help="a commit (e.g. a8b2daf): its turn beside this tree's")
    ap.add_argument("--procs", type=int, default=32, help="--against: processes, 0 for none")
    ap.add_argument("--seconds", type=float, default=5.0, help="--against: per contention run")
    ap.add_argument("--contend-rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=0, help="--against: rounds not counted")
    a = ap.parse_args()
    _counting_sends()
    if a.against:
        with standalone() as srv:
            print(f"{'figure':<44} {'this tree':>10} {'reference':>10}  ratio (min-max)")
            for line in against(srv.url, a):
                print(line, flush=True)
        return
    with standalone() as srv:
        r = redis.Redis.from_url(srv.url)
        settings = LedgerSettings(redis_url=srv.url, prefix="bt", op_retention_seconds=86_400)
        with Ledger.from_settings(settings) as led:
            print(f"{'figure':<44} {'project':>10} {'reference':>10}  ratio (min-max)")
            for part in (bench_admit, bench_turn, bench_reclaim):
                for line in part(led, r, a):
                    print(line, flush=True)


if __name__ == "__main__":
    main()
