"""One client process of `python -m bench.bench_turn --against <commit>`: the governed turn,
the admit, the careful reference and the floor, run on command, with whichever `ledger` its
PYTHONPATH holds (this tree's, or an older commit's unpacked with `git archive`).

It reads one JSON command a line on stdin and answers one JSON line on stdout; the parent
measures the server's time (INFO commandstats) around each command. Run as
`python bench/turn_child.py` (the parent sets PYTHONPATH); `contend` runs alone:
`python bench/turn_child.py contend <url> <prefix> <ledger|watch> <seconds>`.
It uses only what both releases have (`Agent.turn(admit=...)`, `tool_result`, `prompt`), and
a two-call turn (`tool_result(..., defer=True)`) where the release has it.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis
import redis.connection

SENT = [0]  # requests sent (round trips: a pipeline is one)
NAMES: set[str] = set()  # the commands sent (a script's own commands are inside its time)


def _count_sends() -> None:
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


FORMS = {"refturn": "", "digestturn": "~", "bareturn": "!"}  # bench/turn_reference.lua's
FORMS_NAMED = {"": "", "~": "-digest", "!": "-bare"}  # (each form's session)
WORDS = ["the", "ledger", "keeps", "every", "worker", "on", "one", "budget", "of", "tokens"]


def text(i: int, n: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n)) + f" #{i}"


def inputs(i: int) -> tuple[dict[str, str], list[dict[str, str]], dict[str, str]]:
    """The app's objects of turn i: a user message, 12 chunks, a tool result."""
    user = {"id": f"u{i}", "content": text(i, 20)}
    chunks = [{"id": f"c{i}-{k}", "content": text(i * 13 + k, 120)} for k in range(12)]
    return user, chunks, {"id": f"tool{i}", "content": text(i * 7, 200)}


class Tokenizer:
    """The real BPE tokenizer, its calls and CPU counted (taken out of the client's CPU)."""

    def __init__(self, enc: Any) -> None:
        self.enc, self.calls, self.cpu = enc, 0, 0.0

    def __call__(self, s: str) -> int:
        t = time.process_time()
        n: int = self.enc(s)
        self.calls += 1
        self.cpu += time.process_time() - t
        return n


class Child:
    def __init__(self, url: str, prefix: str) -> None:
        from ledger import Agent, Item, Ledger, LedgerSettings, SessionBudget, TiktokenCounter

        self.Item = Item
        self.r = redis.Redis.from_url(url)
        settings = LedgerSettings(redis_url=url, prefix=prefix, op_retention_seconds=86_400)
        self.led = Ledger.from_settings(settings)
        big = SessionBudget(window=100_000_000, system_prompt=100)
        self.s = self.led.open_session("turn", SessionBudget(window=10_000_000, system_prompt=100))
        self.tok = Tokenizer(TiktokenCounter())
        self.agent = Agent(self.s, self.tok)
        turn_cls = type(self.agent.turn(0))
        self.two = "defer" in inspect.signature(turn_cls.tool_result).parameters
        self.system = "You answer from the documents. " * 10
        self.history: list[dict[str, str]] = []
        self.adm = self.led.open_session("adm", big)
        self.mine = self.led.open_session("ref", big)
        for s in (self.adm, self.mine):
            self._fill(s)
        ref = Path(__file__).with_name("admit_reference.lua").read_text()
        self.ref = self.r.register_script(ref)
        self.tag = self.mine.keys.session.rsplit(":s:", 1)[0]
        self.turn(0, inputs(0))  # the first turn asks once whether a worker compacts it
        for form in FORMS.values():  # (its script loaded, each form's session opened)
            self.ref_turns(1, -1, form)

    def _fill(self, s: Any) -> None:
        """1,000 held retrieval items and 1,000 outcomes."""
        calls = [s.admit_call("retrieval", [self.Item(f"h{i}", 1)]) for i in range(1000)]
        for i in range(0, len(calls), 500):
            self.led.run_many(calls[i : i + 500])

    def turn(self, i: int, objs: Any) -> None:
        user, chunks, tool = objs
        with self.agent.turn(0, admit={"working_memory": [user], "retrieval": chunks}) as t:
            out = t.tool_result(tool, defer=True) if self.two else t.tool_result(tool)
            t.prompt([self.system, *self.history, user, *chunks, out.text])
        self.history.append(user)

    def floor(self, i: int, objs: Any) -> None:
        """The same items and texts written with two plain HSETs in one pipeline."""
        user, chunks, tool = objs
        fields = {f"i:r:{c['id']}": f"150|{i}|0|{k}" for k, c in enumerate(chunks)}
        fields.update({f"i:w:{user['id']}": f"25|{i}|0|1", f"i:s:{tool['id']}": f"250|{i}|0|2"})
        texts = {f"r:{c['id']}": c["content"] for c in chunks}
        texts.update({f"w:{user['id']}": user["content"], f"s:{tool['id']}": tool["content"]})
        p = self.r.pipeline(transaction=False)
        p.hset("floor", mapping={**fields, "tn": i, "fr": 1000})
        p.hset("floor:content", mapping=texts)
        p.execute()

    def steps(self, name: str, n: int, start: int) -> dict[str, float]:
        step = self.turn if name == "turn" else self.floor
        objs = [(start + i, inputs(start + i)) for i in range(n)]
        c0, k0, s0, t0 = self.tok.calls, self.tok.cpu, SENT[0], time.process_time()
        for i, o in objs:
            step(i, o)
        cpu = time.process_time() - t0 - (self.tok.cpu - k0)
        return {"cpu_us": cpu * 1e6 / n, "sent": (SENT[0] - s0) / n,
                "tok_calls": (self.tok.calls - c0) / n}  # fmt: skip

    def ends(self, n: int, start: int) -> dict[str, float]:
        """A turn's end both ways, server usec (this client's own INFO commandstats around
        each end, begun outside it): a tool result and the commit in one finish_turn,
        against admit_tool then end_turn, on two sessions filled alike."""
        from ledger import SessionBudget

        if not hasattr(self, "enders"):
            b = SessionBudget(window=100_000_000, system_prompt=100)
            self.enders = [self.led.open_session(f"end-{k}", b) for k in range(2)]
            for s in self.enders:
                self._fill(s)
        body = text(start, 200)
        got = {"finish": 0.0, "two": 0.0}
        for i in range(n):
            for name, s in zip(("finish", "two"), self.enders, strict=True):
                turn = s.begin_turn(0).turn
                self.r.config_resetstat()
                if name == "finish":
                    s.finish_turn(turn, 1_000, [(f"e{start}-{i}", 250, body)])
                else:
                    s.admit_tool_result(f"e{start}-{i}", 250, body)
                    s.end_turn(turn, 1_000)
                got[name] += float(self.r.info("commandstats")["cmdstat_evalsha"]["usec"]) / n
        return got

    def ref_turns(self, n: int, start: int, form: str) -> dict[str, float]:
        """The careful two-call turn of `bench/turn_reference.lua` (form '!': its commands
        alone, nothing checked; '~': the texts left out of its fingerprint) on a session
        of its own, with the same objects: two round trips, the first admitting the user
        message and the chunks with their texts, the second the tool result with the
        prompt's tokens (a cheap count: only the server's time is compared). Each form
        has a session of its own, so that each admits and writes every item of its turns."""
        from ledger import SessionBudget

        if not hasattr(self, "rs"):
            src = Path(__file__).with_name("turn_reference.lua").read_text()
            self.turn_ref, self.owner = self.r.register_script(src), uuid.uuid4().hex
            self.rs: dict[str, Any] = {}
        if form not in self.rs:
            budget = SessionBudget(window=10_000_000, system_prompt=100)
            self.rs[form] = self.led.open_session(f"refturn{FORMS_NAMED[form]}", budget)
        s, ref = self.rs[form], self.turn_ref
        tag = s.keys.session.rsplit(":s:", 1)[0]
        keys = [s.keys.session, s.keys.content, s.keys.order, s.keys.deadlines]
        mode = ("start" + form, "finish" + form)
        for i in range(start, start + n):
            user, chunks, tool = inputs(i)
            items = [("w", user), *(("r", c) for c in chunks)]
            quads = [x for c, o in items for x in (c, o["id"], len(o["content"]) // 4, 0)]
            op = uuid.uuid4().hex
            got = ref(keys=[*keys, f"{tag}:op:{s.id}:{op}"],
                      args=[mode[0], op, s.epoch, self.owner, 30_000, 3_600_000, len(items),
                            *quads, *(o["content"] for _, o in items)])  # fmt: skip
            turn = got.split(b"|")[1].removeprefix(b"turn=").decode()
            parts = [self.system, *(h["content"] for h in self.history), user["content"],
                     *(c["content"] for c in chunks), tool["content"]]  # fmt: skip
            op = uuid.uuid4().hex
            end = ref(keys=[*keys, f"{tag}:op:{s.id}:{op}"],
                      args=[mode[1], op, s.epoch, self.owner, turn, 3_600_000,
                            sum(len(x) // 4 for x in parts), tool["id"],
                            len(tool["content"]) // 4, 0, tool["content"]])  # fmt: skip
            # (every item new: the turn pays for every write, whichever form ran first)
            assert got.startswith(b"status=ok|turn=") and end.startswith(b"status=ok"), (got, end)
            assert int(got.split(b"|")[2].removeprefix(b"charged=")) > 0, got
        return {}

    def admits(self, n: int) -> dict[str, float]:
        s = self.adm
        self.led.run_many(
            [s.admit_call("retrieval", [self.Item(f"n{uuid.uuid4().hex}", 1)]) for _ in range(n)]
        )
        return {}

    def reference(self, n: int) -> dict[str, float]:
        p = self.r.pipeline(transaction=False)
        mine = self.mine
        for _ in range(n):
            op, iid = uuid.uuid4().hex, uuid.uuid4().hex
            self.ref(keys=[mine.keys.session, f"{self.tag}:op:{mine.id}:{op}"],
                     args=[op, mine.epoch, "r", iid, 1, 0, 3_600_000], client=p)  # fmt: skip
        p.execute()
        return {}


def serve(url: str, prefix: str) -> None:
    _count_sends()
    child = Child(url, prefix)
    print(json.dumps({"two": child.two}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        what = cmd["cmd"]
        NAMES.clear()
        if what == "quit":
            break
        if what in ("turn", "floor"):
            out = child.steps(what, cmd["n"], cmd["start"])
        elif what == "admit":
            out = child.admits(cmd["n"])
        elif what == "ends":
            out = child.ends(cmd["n"], cmd["start"])
        elif what in FORMS:
            out = child.ref_turns(cmd["n"], cmd["start"], FORMS[what])
        else:
            out = child.reference(cmd["n"])
        print(json.dumps({**out, "names": sorted(NAMES)}), flush=True)


def contend(url: str, prefix: str, mode: str, seconds: float) -> None:
    """Single-item admits on one shared session (or WATCH/MULTI on one shared hash) for
    `seconds` from the start time the parent sends (wall clock) once every process said it
    is ready: ops and each call's latency."""
    lat: list[float] = []
    tag = uuid.uuid4().hex[:8]
    if mode == "watch":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from bench.alternatives import WatchAdmit

        impl = WatchAdmit(redis.Redis.from_url(url, socket_timeout=120))

        def one(k: int) -> None:
            impl.admit("alt:shared", f"{tag}.{k}", 1)
    else:
        from ledger import Item, Ledger, LedgerSettings, SessionBudget

        led = Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix))
        s = led.open_session("shared", SessionBudget(window=100_000_000, system_prompt=100))

        def one(k: int) -> None:
            s.admit("retrieval", [Item(f"{tag}.{k}", 1)])

    one(-1)
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    time.sleep(max(start - time.time(), 0))
    k, end = 0, start + seconds
    while time.time() < end:
        t = time.perf_counter()
        one(k)
        lat.append(time.perf_counter() - t)
        k += 1
    print(json.dumps({"ops": k, "lat": lat}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "contend":
        contend(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
    else:
        serve(sys.argv[1], sys.argv[2])
