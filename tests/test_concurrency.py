"""Concurrency and lost replies, on a real redis-server (the `redis_server` fixture).

a. Sixteen OS processes (spawn) hammer three sessions with admit / release / reserve /
   settle / void, each call with an explicit op id; a fifth of the calls is sent a
   second time with the same op id (a retry after a lost reply), and now and then an
   old call is sent again. Every process records what it believes it holds; at the
   end the ledger holds exactly that, its counters pass the audit, and free >= 0.
b. Timeouts and lost replies: a call that timed out while Redis was paused, a call
   Redis applied whose reply was lost, a request that reached Redis only after the
   client had retried it, and redis-py's own default retry: each is charged once.
c. Two processes race for the last free tokens of a session: exactly one wins.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import random
import socket
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from ledger import (
    AdmissionRefused,
    Admitted,
    Consumer,
    Item,
    Ledger,
    LedgerError,
    LedgerSettings,
    Released,
    Reservation,
    Session,
    SessionBudget,
    Settled,
    Snapshot,
    Voided,
)
from ledger import scripts as ledger_scripts
from tests import servers
from tests.conftest import make_settings

pytestmark = [pytest.mark.redis]

SPAWN = multiprocessing.get_context("spawn")
CONSUMERS = tuple(c.value for c in Consumer)
GROUP = {"working_memory": "w", "retrieval": "m", "recall": "m", "scratchpad": "s"}
REFUSAL_REASONS = {"token_budget_exhausted", "floor_protected"}

# Sized so that 5-6 processes per session run it full: refusals are part of the load.
HAMMER_BUDGET = {
    "window": 80_000,
    "system_prompt": 2_000,
    "tool_framing": 200,
    "output_reserve": 1_000,
    "working_memory_floor": 4_000,
    "min_memory": 3_000,
}
HAMMER_PROCESSES = 16
HAMMER_SECONDS = 3.0
HAMMER_SESSIONS = ("hammer/a", "hammer/b", "hammer/c")


def capture(fn: Callable[[], Any]) -> Any:
    """A call's outcome as a comparable value: the result, a refusal, or an error."""
    try:
        return fn()
    except AdmissionRefused as exc:
        return ("refused", exc.reason, exc.requested, exc.free)
    except LedgerError as exc:
        return ("error", type(exc).__name__, str(exc))


def free_of(budget: dict[str, int], active: dict[str, int]) -> int:
    """free = W - S - T - out - max(a_w, F_w) - max(a_rm, F_rm) - a_s."""
    return (
        budget["window"]
        - budget["system_prompt"]
        - budget["tool_framing"]
        - budget["output_reserve"]
        - max(active["w"], budget["working_memory_floor"])
        - max(active["m"], budget["min_memory"])
        - active["s"]
    )


# --- a. many processes, retries with the same op id ----------------------------------------


def _hammer(
    idx: int,
    url: str,
    prefix: str,
    session_ids: tuple[str, ...],
    seconds: float,
    barrier: Any,
    out: Any,
) -> None:
    """Child process entry: report the beliefs, or the traceback that ended it."""
    try:
        out.put(_hammer_body(idx, url, prefix, session_ids, seconds, barrier))
    except BaseException:
        out.put({"idx": idx, "crash": traceback.format_exc()})


class Hammer:
    """One process's load on the shared sessions, and what it believes it holds."""

    def __init__(self, idx: int, led: Ledger, session_ids: tuple[str, ...]) -> None:
        self.idx = idx
        self.seed = random.randrange(2**32)
        self.rng = random.Random(self.seed)
        self.sessions = {sid: led.session(sid) for sid in session_ids}
        # session -> consumer -> item -> tokens, and session -> reservation -> (consumer, tokens)
        self.held = {sid: {c: {} for c in CONSUMERS} for sid in session_ids}
        self.resv: dict[str, dict[str, tuple[str, int]]] = {sid: {} for sid in session_ids}
        self.stats: Counter[str] = Counter()
        self.problems: list[str] = []
        self.history: list[tuple[str, Callable[[], Any], Any]] = []
        self.min_free = 10**9
        self.n = 0

    def step(self) -> None:
        rng = self.rng
        self.n += 1
        sid = rng.choice(tuple(self.sessions))
        s, h, rv = self.sessions[sid], self.held[sid], self.resv[sid]
        op = f"p{self.idx}.{self.n}"
        holding = [c for c in CONSUMERS if h[c]]
        kinds = ["admit", "reserve"] + ["release"] * bool(holding) + ["settle", "void"] * bool(rv)
        weights = {"admit": 35, "release": 30, "reserve": 15, "settle": 12, "void": 8}
        kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
        what = f"{kind} {op} on {sid}"

        if kind == "admit":
            c = rng.choice(CONSUMERS)
            items = [
                Item(f"{op}.{k}", rng.randint(1, 2_000), rng.randint(0, 3))
                for k in range(rng.randint(1, 4))
            ]
            dup = rng.choice(sorted(h[c])) if h[c] and rng.random() < 0.2 else None
            if dup is not None:  # an item this process holds: charged nothing again
                items.insert(rng.randrange(len(items) + 1), Item(dup, h[c][dup]))
            call = functools.partial(s.admit, c, items, partial=rng.random() < 0.5, op_id=op)
            res = self.send(what, sid, call)
            if isinstance(res, Admitted):
                new = [i for i in items if i.id != dup and i.id not in res.skipped]
                want = (sum(i.tokens for i in new), len(new), int(dup is not None))
                if (res.charged, res.admitted, res.duplicates) != want:
                    self.problems.append(f"{what}: {res}, expected {want}")
                for i in new:
                    h[c][i.id] = i.tokens

        elif kind == "release":
            c = rng.choice(holding)
            ids = rng.sample(sorted(h[c]), min(len(h[c]), rng.randint(1, 3)))
            ghost = f"{op}.ghost" if rng.random() < 0.2 else None
            call = functools.partial(s.release, c, [*ids, ghost] if ghost else ids, op_id=op)
            res = self.send(what, sid, call)
            if isinstance(res, Released):
                want = (sum(h[c][i] for i in ids), len(ids), (ghost,) if ghost else ())
                if (res.released, res.count, res.missing) != want:
                    self.problems.append(f"{what}: {res}, expected {want}")
                for i in ids:
                    del h[c][i]

        elif kind == "reserve":
            c, rid, est = rng.choice(CONSUMERS), f"{op}.r", rng.randint(1, 2_000)
            call = functools.partial(s.reserve, c, rid, est, lease_ms=120_000, op_id=op)
            if isinstance(self.send(what, sid, call), Reservation):
                rv[rid] = (c, est)

        elif kind == "settle":  # lower or higher than the estimate
            rid = rng.choice(sorted(rv))
            c, est = rv[rid]
            actual = rng.randint(1, est) if rng.random() < 0.5 else rng.randint(est, est + 1_500)
            call = functools.partial(s.settle, rid, actual, f"{op}.s", op_id=op)
            res = self.send(what, sid, call)
            if isinstance(res, Settled):
                del rv[rid]
                h[c][res.item] = actual
                if (res.charged, res.item) != (actual, f"{op}.s"):
                    self.problems.append(f"{what}: {res}, expected charged={actual}")

        else:  # void
            rid = rng.choice(sorted(rv))
            res = self.send(what, sid, functools.partial(s.void, rid, op_id=op))
            if isinstance(res, Voided):
                _, est = rv.pop(rid)
                if res.released != est:
                    self.problems.append(f"{what}: {res}, expected released={est}")

    def send(self, what: str, sid: str, call: Callable[[], Any]) -> Any:
        """Send a call; a fifth of the time send it again (its reply was "lost") and
        now and then re-send an older call: each must return its first outcome."""
        rng = self.rng
        first = capture(call)
        self.stats[what.split()[0]] += 1
        self.note_free(first)
        if isinstance(first, tuple):
            if first[0] == "refused" and first[1] in REFUSAL_REASONS:
                self.stats["refused"] += 1
                self.stats[f"refused:{sid}"] += 1
            else:  # a process touches only its own items and reservations
                self.problems.append(f"{what}: unexpected {first}")
        if rng.random() < 0.2:
            self.stats["retries"] += 1
            again = capture(call)
            if again != first:
                self.problems.append(f"retry of {what}: {again} != first {first}")
        self.history.append((what, call, first))
        if rng.random() < 0.05:
            self.stats["late_replays"] += 1
            old, old_call, old_first = rng.choice(self.history[-200:])
            late = capture(old_call)
            if late != old_first:
                self.problems.append(f"late replay of {old}: {late} != first {old_first}")
        return first

    def note_free(self, outcome: Any) -> None:
        free = outcome[3] if isinstance(outcome, tuple) and outcome[0] == "refused" else None
        free = getattr(outcome, "free", free)
        if free is not None:
            self.min_free = min(self.min_free, free)

    def report(self) -> dict[str, Any]:
        return {
            "idx": self.idx,
            "seed": self.seed,
            "held": self.held,
            "resv": self.resv,
            "stats": dict(self.stats),
            "problems": self.problems,
            "min_free": self.min_free,
            "calls": self.n,
        }


def _hammer_body(
    idx: int,
    url: str,
    prefix: str,
    session_ids: tuple[str, ...],
    seconds: float,
    barrier: Any,
) -> dict[str, Any]:
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
        hammer = Hammer(idx, led, session_ids)
        barrier.wait(timeout=120)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            hammer.step()
        return hammer.report()


@contextlib.contextmanager
def started(processes: list[Any]) -> Iterator[None]:
    """Start processes; on the way out, end those still running (only ours, by object)."""
    try:
        for p in processes:
            p.start()
        yield
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)


@pytest.mark.slow
def test_many_processes_with_retries_hold_exactly_what_they_believe(
    redis_server: servers.RedisProcess,
) -> None:
    settings = make_settings(redis_server.url)
    budget = SessionBudget(**HAMMER_BUDGET)  # type: ignore[arg-type]
    barrier = SPAWN.Barrier(HAMMER_PROCESSES + 1)
    out = SPAWN.Queue()
    with Ledger.from_settings(settings) as led:
        sessions = {sid: led.open_session(sid, budget) for sid in HAMMER_SESSIONS}
        procs = [
            SPAWN.Process(
                target=_hammer,
                args=(
                    i,
                    redis_server.url,
                    settings.prefix,
                    HAMMER_SESSIONS,
                    HAMMER_SECONDS,
                    barrier,
                    out,
                ),
                daemon=True,
            )
            for i in range(HAMMER_PROCESSES)
        ]
        with started(procs):
            barrier.wait(timeout=120)
            results = [out.get(timeout=60) for _ in procs]
        crashes = [r["crash"] for r in results if "crash" in r]
        assert not crashes, crashes[0]
        assert all(p.exitcode == 0 for p in procs)
        problems = [f"p{r['idx']} (seed {r['seed']}): {m}" for r in results for m in r["problems"]]
        assert not problems, "\n".join(problems[:20])

        totals: Counter[str] = Counter()
        for r in results:
            totals.update(r["stats"])
            assert r["min_free"] >= 0, r
        # the load did what it is meant to: many calls, retries, and a full budget
        assert sum(r["calls"] for r in results) >= 16 * 20, totals
        assert totals["retries"] >= 50, totals
        assert totals["late_replays"] >= 10, totals
        assert totals["refused"] >= 1, totals
        for kind in ("admit", "release", "reserve", "settle", "void"):
            assert totals[kind] >= 10, totals

        for sid, s in sessions.items():
            snap = s.snapshot()
            active = {"w": 0, "m": 0, "s": 0}
            for c in Consumer:
                held = [r["held"][sid][c.value] for r in results]
                opened = [v for r in results for v in r["resv"][sid].values() if v[0] == c.value]
                assert snap.used[c] == sum(sum(h.values()) for h in held), (sid, c)
                assert snap.items[c] == sum(len(h) for h in held), (sid, c)
                assert snap.reserved[c] == sum(t for _, t in opened), (sid, c)
                active[GROUP[c.value]] += snap.used[c] + snap.reserved[c]
            assert snap.open_reservations == sum(len(r["resv"][sid]) for r in results)
            assert snap.free >= 0
            assert snap.free == free_of(HAMMER_BUDGET, active)
            assert snap.refusals == sum(r["stats"].get(f"refused:{sid}", 0) for r in results)
            report = s.audit()
            assert report.clean, report.problems
            # the items the hash holds are exactly the believed ones, with their sizes
            believed = {
                (c, i): t
                for r in results
                for c, its in r["held"][sid].items()
                for i, t in its.items()
            }
            have = {(it.consumer.value, it.id): it.tokens for it in led.items(sid)}
            assert have == believed
    out.close()
    out.join_thread()


# --- b. timeouts and lost replies ---------------------------------------------------------


class FlakyProxy:
    """A TCP proxy in front of a Redis server. Armed, it meddles with the next EVALSHA:

    drop  forwards the request and loses its reply: Redis applied the call, the client
          times out and cannot know whether it took effect;
    hold  holds the request back for `hold` seconds and forwards it after the client
          has given up on it (and, usually, after its retry was applied).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port: int = self.listener.getsockname()[1]
        self.closing = threading.Event()
        self.lock = threading.Lock()
        self.mode: str | None = None
        self.hold = 0.0
        self.fired = 0
        self.socks: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def arm(self, mode: str, hold: float = 0.0) -> None:
        with self.lock:
            self.mode, self.hold = mode, hold

    def close(self) -> None:
        self.closing.set()
        self.thread.join(5)
        self.listener.close()
        with self.lock:
            for s in self.socks:
                with contextlib.suppress(OSError):
                    s.close()

    def __enter__(self) -> FlakyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self) -> tuple[str | None, float]:
        with self.lock:
            mode, self.mode = self.mode, None
            self.fired += mode is not None
            return mode, self.hold

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            client.settimeout(None)
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            lost = threading.Event()
            with self.lock:
                self.socks += [client, upstream]
            for target, args in (
                (self._requests, (client, upstream, lost)),
                (self._replies, (upstream, client, lost)),
            ):
                threading.Thread(target=target, args=args, daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, lost: Any) -> None:
        try:
            while data := client.recv(65536):
                if b"EVALSHA" in data:
                    mode, hold = self._take()
                    if mode == "drop":
                        lost.set()
                    elif mode == "hold":
                        time.sleep(hold)
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                upstream.shutdown(socket.SHUT_WR)

    def _replies(self, upstream: socket.socket, client: socket.socket, lost: Any) -> None:
        try:
            while data := upstream.recv(65536):
                if not lost.is_set():
                    with contextlib.suppress(OSError):
                        client.sendall(data)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.close()


LOSSY = {"socket_timeout": 0.2, "retry_attempts": 10, "retry_max_seconds": 5}
BUDGET = SessionBudget(window=32_000, system_prompt=2_100, tool_framing=150, output_reserve=1_024)


def evalsha_calls(admin: redis.Redis) -> int:
    """EVALSHA calls Redis has executed (INFO commandstats)."""
    return int(admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def count_sent(client: Any) -> Counter[str]:
    """Count the commands a redis-py client sends (each ledger attempt is one EVALSHA)."""
    sent: Counter[str] = Counter()
    send = client.execute_command

    def counting(*args: Any, **options: Any) -> Any:
        sent[str(args[0]).upper()] += 1
        return send(*args, **options)

    client.execute_command = counting
    return sent


@pytest.fixture
def admin(redis_server: servers.RedisProcess) -> Iterator[redis.Redis]:
    """A plain client straight to the server; the ledger scripts preloaded, so that
    no attempt below is spent on NOSCRIPT."""
    client = redis.Redis(port=redis_server.port)
    for name in ledger_scripts.NAMES:
        client.script_load(ledger_scripts.source(name))
    try:
        yield client
    finally:
        client.client_unpause()
        client.close()


def charged_once(s: Session, consumer: Consumer, tokens: int, items: int = 1) -> Snapshot:
    snap = s.snapshot()
    assert snap.used[consumer] == tokens
    assert snap.items[consumer] == items
    report = s.audit()
    assert report.clean, report.problems
    return snap


def test_timeout_while_redis_is_paused_is_retried_and_charged_once(
    redis_server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """CLIENT PAUSE holds the EVALSHA past the socket timeout. Redis drops a paused
    command whose client disconnected, so here the tries that timed out are never
    applied and the one after the pause is: the ledger keeps retrying the same op id
    until then, and charges it once."""
    with Ledger.from_settings(make_settings(redis_server.url, **LOSSY)) as led:
        s = led.open_session("paused", BUDGET)
        sent = count_sent(led.client)
        before = evalsha_calls(admin)
        admin.client_pause(600, all=False)  # WRITE: every script that may write waits
        t0 = time.monotonic()
        got = s.admit("retrieval", [Item("doc-1", 777)], op_id="paused-admit-1")
        elapsed = time.monotonic() - t0
        assert got.charged == 777 and got.admitted == 1 and got.duplicates == 0
        assert sent["EVALSHA"] >= 2, "the call never timed out: the pause did not hold it"
        assert elapsed >= 0.5
        applied = evalsha_calls(admin) - before
        assert 1 <= applied <= sent["EVALSHA"]
        charged_once(s, Consumer.RETRIEVAL, 777)
        # a late re-send of the same call gets the stored outcome and charges nothing
        assert s.admit("retrieval", [Item("doc-1", 777)], op_id="paused-admit-1") == got
        charged_once(s, Consumer.RETRIEVAL, 777)


def test_a_batch_whose_reply_is_lost_is_charged_once(
    redis_server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """run_many: Redis runs the whole MULTI/EXEC, its reply is lost, the retry sends the
    batch again and every call gets its stored outcome."""
    with (
        FlakyProxy(redis_server.port) as proxy,
        Ledger.from_settings(make_settings(proxy.url, **LOSSY)) as led,
    ):
        s = led.open_session("lost-batch", BUDGET)
        calls = [s.admit_call("retrieval", [Item(f"c{k}", 100)]) for k in range(8)]
        calls.append(s.release_call("retrieval", ["c0"]))
        applied = evalsha_calls(admin)
        proxy.arm("drop")
        got = led.run_many(calls)
        assert proxy.fired == 1
        assert evalsha_calls(admin) - applied >= 2 * len(calls)  # applied, then replayed
        assert [r.charged for r in got[:8]] == [100] * 8  # the first outcomes, replayed
        assert got[8].released == 100
        charged_once(s, Consumer.RETRIEVAL, 700, items=7)


def test_lost_replies_of_applied_calls_are_charged_once(
    redis_server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """Redis applies each call, its reply is lost, the ledger's retry (same op id) gets
    the stored outcome: the result is the first one (a re-evaluation would report a
    duplicate, a missing id, an unknown reservation or a conflict) and nothing moves
    twice."""
    with (
        FlakyProxy(redis_server.port) as proxy,
        Ledger.from_settings(make_settings(proxy.url, **LOSSY)) as led,
    ):
        s = led.open_session("lost", BUDGET)
        sent = count_sent(led.client)

        def lost(call: Callable[[], Any]) -> Any:
            fired, tries, applied = proxy.fired, sent["EVALSHA"], evalsha_calls(admin)
            proxy.arm("drop")
            out = call()
            assert proxy.fired == fired + 1
            assert sent["EVALSHA"] - tries >= 2  # timed out, then retried
            assert evalsha_calls(admin) - applied >= 2  # applied, then replayed
            return out

        got = lost(lambda: s.admit("retrieval", [Item("d1", 700), Item("d2", 300)], op_id="l-1"))
        assert (got.charged, got.admitted, got.duplicates) == (1_000, 2, 0)
        charged_once(s, Consumer.RETRIEVAL, 1_000, items=2)

        rel = lost(lambda: s.release("retrieval", ["d2"], op_id="l-2"))
        assert (rel.released, rel.count, rel.missing) == (300, 1, ())
        charged_once(s, Consumer.RETRIEVAL, 700)

        res = lost(lambda: s.reserve("scratchpad", "tool-1", 2_000, op_id="l-3"))
        assert res.id == "tool-1"
        assert s.snapshot().reserved[Consumer.SCRATCHPAD] == 2_000

        st = lost(lambda: s.settle("tool-1", 2_500, "tool-1-out", op_id="l-4"))
        assert (st.charged, st.item) == (2_500, "tool-1-out")
        snap = charged_once(s, Consumer.SCRATCHPAD, 2_500)
        assert snap.reserved[Consumer.SCRATCHPAD] == 0 and snap.open_reservations == 0

        s.reserve("recall", "tool-2", 1_200, op_id="l-5")
        vd = lost(lambda: s.void("tool-2", op_id="l-6"))
        assert vd.released == 1_200
        snap = s.snapshot()
        assert snap.reserved[Consumer.RECALL] == 0 and snap.open_reservations == 0
        assert snap.free == 32_000 - 2_100 - 150 - 1_024 - 700 - 2_500
        assert s.audit().clean


def test_request_that_arrives_after_its_retry_is_not_applied_again(
    redis_server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """The first try is held in the network until after the client timed out, retried
    (applied) and even released the item: when the stale request finally reaches Redis
    it gets the stored outcome and does not bring the item back."""
    with (
        FlakyProxy(redis_server.port) as proxy,
        Ledger.from_settings(make_settings(proxy.url, **LOSSY)) as led,
    ):
        s = led.open_session("held", BUDGET)
        before = evalsha_calls(admin)
        proxy.arm("hold", hold=1.0)
        got = s.admit("working_memory", [Item("turn-1", 900)], op_id="h-1")
        assert (got.charged, got.admitted) == (900, 1)
        assert proxy.fired == 1
        s.release("working_memory", ["turn-1"], op_id="h-2")
        # wait for the held request to reach Redis: admit retry, release, held admit
        deadline = time.monotonic() + 5
        while evalsha_calls(admin) - before < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert evalsha_calls(admin) - before >= 3, "the held request never reached Redis"
        charged_once(s, Consumer.WORKING_MEMORY, 0, items=0)
        assert s.snapshot().free == 32_000 - 2_100 - 150 - 1_024


def test_redis_py_default_retry_is_harmless(
    redis_server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """A plain redis.Redis with redis-py's default Retry, wrapped in Ledger directly,
    the ledger's own retry off: the driver re-sends the timed-out EVALSHA by itself,
    with the same op id, and the call is charged once."""
    with FlakyProxy(redis_server.port) as proxy:
        client = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=0.2)
        assert client.get_retry() is not None and client.get_retry().get_retries() >= 1
        settings = make_settings(proxy.url, retry_attempts=1)
        with Ledger(client, settings) as led:
            s = led.open_session("driver-retry", BUDGET)
            sent = count_sent(client)
            before = evalsha_calls(admin)
            proxy.arm("drop")
            got = s.admit("recall", [Item("m-1", 1_234)], op_id="d-1")
            assert (got.charged, got.admitted, got.duplicates) == (1_234, 1, 0)
            assert proxy.fired == 1
            assert sent["EVALSHA"] == 1  # one ledger attempt ...
            assert evalsha_calls(admin) - before >= 2  # ... that the driver sent twice
            charged_once(s, Consumer.RECALL, 1_234)


# --- c. a race for the last free tokens ---------------------------------------------------


def _racer(idx: int, url: str, prefix: str, sid: str, plans: Any, barrier: Any, out: Any) -> None:
    try:
        with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
            s = led.session(sid)
            while (plan := plans.get(timeout=60)) is not None:
                rnd, kind, consumer, tokens = plan
                name = f"race{rnd}-p{idx}"
                barrier.wait(timeout=60)
                if kind == "admit":
                    call = functools.partial(s.admit, consumer, [Item(name, tokens)], op_id=name)
                else:
                    call = functools.partial(s.reserve, consumer, name, tokens, op_id=name)
                out.put((idx, rnd, capture(call)))
    except BaseException:
        out.put((idx, -1, traceback.format_exc()))


RACE_BUDGET = {
    "window": 20_000,
    "system_prompt": 1_000,
    "tool_framing": 100,
    "output_reserve": 500,
    "working_memory_floor": 2_000,
    "min_memory": 1_500,
}


def room(snap: Snapshot, consumer: Consumer) -> int:
    """The most tokens consumer can take now: free plus its group's unused floor."""
    group = GROUP[consumer.value]
    floor = {"w": snap.working_memory_floor, "m": snap.min_memory, "s": 0}[group]
    active = sum(snap.used[c] + snap.reserved[c] for c in Consumer if GROUP[c.value] == group)
    return snap.free + max(0, floor - active)


@pytest.mark.slow
def test_two_processes_race_for_the_last_free_tokens(
    redis_server: servers.RedisProcess,
) -> None:
    """Each round both processes ask, at the same moment, for all the room their
    consumer has left (so either alone would fit): exactly one is granted."""
    rounds = 30
    rng = random.Random()
    settings = make_settings(redis_server.url)
    barrier = SPAWN.Barrier(2)
    plans = [SPAWN.Queue(), SPAWN.Queue()]
    out = SPAWN.Queue()
    wins: Counter[int] = Counter()
    with Ledger.from_settings(settings) as led:
        s = led.open_session("race", SessionBudget(**RACE_BUDGET))  # type: ignore[arg-type]
        procs = [
            SPAWN.Process(
                target=_racer,
                args=(i, redis_server.url, settings.prefix, "race", plans[i], barrier, out),
                daemon=True,
            )
            for i in range(2)
        ]
        with started(procs):
            for rnd in range(rounds):
                start = s.snapshot().free
                # vary the state: some filler in random consumers, leaving room
                for c in rng.sample(list(Consumer), 2):
                    left = s.snapshot().free
                    if left > 2_000:
                        s.admit(c, [Item(f"fill{rnd}-{c.code}", rng.randint(1, left // 3))])
                snap = s.snapshot()
                assert snap.free > 0
                kind = rng.choice(["admit", "reserve"])
                consumers = [rng.choice(list(Consumer)) for _ in range(2)]
                for i in range(2):
                    plans[i].put((rnd, kind, consumers[i].value, room(snap, consumers[i])))
                got = sorted(out.get(timeout=60) for _ in range(2))
                for _, r, res in got:
                    assert r == rnd, res
                winners = [idx for idx, _, res in got if not isinstance(res, tuple)]
                losers = [res for _, _, res in got if isinstance(res, tuple)]
                assert len(winners) == 1, (rnd, kind, consumers, got)
                assert losers[0][0] == "refused" and losers[0][1] in REFUSAL_REASONS, losers
                wins[winners[0]] += 1
                after = s.snapshot()
                assert after.free == 0, (rnd, kind, consumers, after)
                assert s.audit().clean
                # give the round back: the winner's grant and the filler
                name = f"race{rnd}-p{winners[0]}"
                winner_consumer = consumers[winners[0]]
                if kind == "admit":
                    s.release(winner_consumer, [name])
                else:
                    s.void(name)
                for c in Consumer:
                    s.release(c, [f"fill{rnd}-{c.code}"])
                assert s.snapshot().free == start, rnd
            for q in plans:
                q.put(None)
    assert sum(wins.values()) == rounds
    for q in (*plans, out):
        q.close()
        q.join_thread()
