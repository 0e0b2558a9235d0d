"""Faults: crashes and restarts, script cache flushes, cut and slow connections,
skewed client clocks. Each test starts its own redis-server (never 6379), scripts its
fault at a known moment, bounds every loop in count and time, and ends with the
invariants: every acknowledged operation is there exactly once, the counters equal the
items (``ledger audit`` exits 0), and what the clients believe they hold is what the
ledger holds.

The clients here are :class:`Agent` threads. An agent builds each call once (one
operation id) and, while Redis is unreachable, re-sends that same call until it gets
an answer: the ledger then either applied it once or replays its first outcome, so an
agent always knows what it holds.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from ledger import (
    BackendUnavailable,
    Consumer,
    Item,
    Ledger,
    LedgerError,
    LedgerSettings,
    Session,
    SessionBudget,
)
from ledger import cli as ledger_cli
from ledger.protocol import Call
from tests.support import servers
from tests.support.tcp_proxy import TcpProxy

WM, RET, REC, SCR = (
    Consumer.WORKING_MEMORY,
    Consumer.RETRIEVAL,
    Consumer.RECALL,
    Consumer.SCRATCHPAD,
)


def roomy_budget() -> SessionBudget:
    """A window so large that no call of the workload is ever refused."""
    return SessionBudget(window=10_000_000, system_prompt=1_000, tool_framing=100)


def new_prefix() -> str:
    return f"f{uuid.uuid4().hex[:10]}"


# --- the workload ------------------------------------------------------------------------


@dataclass
class Ack:
    """One acknowledged call: what was sent, what came back, when (monotonic seconds)."""

    call: Call[Any]
    result: Any
    at: float
    kind: str
    session: str
    item: str = ""
    tokens: int = 0


@dataclass
class Agent:
    """One client thread serving its own sessions (so its calls on a session are
    sequential). It records every acknowledged call and what it believes each
    session holds, per consumer; anything the ledger answers that contradicts a
    single application of a call is recorded in `violations`."""

    name: str
    ledger: Ledger
    sessions: list[Session]
    seed: int = 0
    mix: str = "basic"  # basic | admit-only | full
    resend_for: float = 20.0  # seconds a call is re-sent while Redis is unreachable
    # Errors after which the call is re-sent (same op id, so safe either way), by name.
    tolerate: Callable[[Exception], str | None] | None = None
    held: dict[str, dict[tuple[Consumer, str], int]] = field(default_factory=dict)
    acks: list[Ack] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.n = 0
        for s in self.sessions:
            self.held.setdefault(s.id, {})

    # one call, sent until its outcome is known
    def send(
        self, call: Call[Any], kind: str, session: Session, item: str = "", tokens: int = 0
    ) -> Any:
        deadline = time.monotonic() + self.resend_for
        for attempt in range(10_000):
            try:
                result = self.ledger.run(call)
            except BackendUnavailable:
                self.stats["unavailable"] += 1
                if time.monotonic() > deadline:
                    raise
                time.sleep(min(0.2, 0.01 * (attempt + 1)))
                continue
            except Exception as exc:
                why = self.tolerate(exc) if self.tolerate else None
                if why is None or attempt >= 100:
                    raise
                self.stats[why] += 1
                continue
            if attempt:
                self.stats["resent"] += 1
            self.stats[kind] += 1
            self.acks.append(Ack(call, result, time.monotonic(), kind, session.id, item, tokens))
            return result
        raise AssertionError("unreachable: the deadline ends the loop")

    def step(self) -> None:
        s = self.sessions[self.rng.randrange(len(self.sessions))]
        held = self.held[s.id]
        self.n += 1
        tag = f"{self.name}-{self.n}"
        r = self.rng.random()
        if self.mix == "admit-only" or r < 0.5 or not held:
            c = self.rng.choice([RET, REC, WM])
            tokens = self.rng.randint(1, 40)
            res = self.send(s.admit_call(c, [Item(tag, tokens)]), "admit", s, tag, tokens)
            if res.charged != tokens or res.duplicates or res.admitted != 1:
                self.violations.append(f"admit {tag}: {res}")
            held[(c, tag)] = tokens
        elif r < 0.7:
            (c, item), tokens = next(iter(held.items()))
            res = self.send(s.release_call(c, [item]), "release", s, item, tokens)
            if res.released != tokens or res.missing or res.count != 1:
                self.violations.append(f"release {item}: {res}")
            del held[(c, item)]
        elif r < 0.85 or self.mix == "basic":
            est = self.rng.randint(10, 60)
            res = self.send(s.reserve_call(SCR, f"r{tag}", est, lease_ms=120_000), "reserve", s)
            if self.rng.random() < 0.6:
                actual = self.rng.randint(1, 80)
                st = self.send(s.settle_call(f"r{tag}", actual, tag), "settle", s, tag, actual)
                if st.charged != actual:
                    self.violations.append(f"settle {tag}: {st}")
                held[(SCR, tag)] = actual
            else:
                v = self.send(s.void_call(f"r{tag}"), "void", s)
                if v.released != est:
                    self.violations.append(f"void {tag}: {v} after {res}")
        else:  # full: turns, spans, tool results (some spilled), reads
            t = self.send(s.begin_turn_call(10, 0), "begin_turn", s)
            self.send(s.record_span_call(t.turn, "recall", 50, 5), "record_span", s)
            self.send(s.end_turn_call(t.turn, 500), "end_turn", s)
            big = self.rng.random() < 0.3
            tokens = 50_000_000 if big else self.rng.randint(1, 40)
            tr = self.send(s.admit_tool_result_call(f"call-{tag}", tokens, b"{}" * 10), "tool", s)
            if tr.outcome != ("spilled" if big else "admitted"):
                self.violations.append(f"tool {tag}: {tr}")
            for c, item in tr.evicted:
                held.pop((c, item), None)
            held[(SCR, f"call-{tag}")] = tr.charged
            self.send(s.snapshot_call(), "snapshot", s)

    def run(self, stop: threading.Event, max_steps: int, max_seconds: float) -> None:
        deadline = time.monotonic() + max_seconds
        try:
            for _ in range(max_steps):
                if stop.is_set() or time.monotonic() > deadline:
                    break
                self.step()
        except BaseException as exc:  # reported by the main thread
            self.errors.append(exc)


def run_agents(
    agents: list[Agent],
    *,
    max_steps: int,
    max_seconds: float,
    during: Callable[[threading.Event], None] | None = None,
) -> None:
    """Run the agents in threads; `during(stop)` runs in this thread meanwhile (the
    scripted fault), then the agents are stopped and joined."""
    stop = threading.Event()
    threads = [
        threading.Thread(target=a.run, args=(stop, max_steps, max_seconds), daemon=True)
        for a in agents
    ]
    for t in threads:
        t.start()
    try:
        if during is not None:
            during(stop)
    finally:
        if during is not None:
            stop.set()
        for t in threads:
            t.join(timeout=max_seconds + 30)
    assert not any(t.is_alive() for t in threads), "an agent thread did not stop"
    for a in agents:
        assert not a.errors, f"{a.name} failed: {a.errors[0]!r}"


def open_sessions(ledger: Ledger, n: int, tag: str = "s") -> list[Session]:
    return [ledger.open_session(f"tenant/{tag}-{i}", roomy_budget()) for i in range(n)]


def check_invariants(ledger: Ledger, agents: list[Agent]) -> dict[str, int]:
    """Every session: audit clean, free >= 0, no open reservation, and the items the
    ledger holds are exactly those the agents believe they hold (ids and tokens)."""
    totals = Counter[str]()
    for a in agents:
        assert not a.violations, f"{a.name}: {a.violations[:5]}"
        for sid, believed in a.held.items():
            rep = ledger.audit(sid)
            assert rep.clean, (sid, rep.problems)
            snap = ledger.session(sid).snapshot()
            assert snap.free >= 0
            assert snap.open_reservations == 0 and not any(snap.reserved.values())
            have = {(i.consumer, i.id): i.tokens for i in ledger.items(sid)}
            assert have == believed, f"{sid}: ledger {len(have)} items, client {len(believed)}"
            for c in Consumer:
                assert snap.used[c] == sum(t for (k, _), t in believed.items() if k is c)
            totals["sessions"] += 1
            totals["items"] += len(have)
    return dict(totals)


def assert_replays(ledger: Ledger, agents: list[Agent], limit: int = 2_000) -> int:
    """Re-send acknowledged calls (same op ids): each gets its first outcome back and
    the sessions do not change."""
    sessions = {sid for a in agents for sid in a.held}
    before = {sid: _state(ledger, sid) for sid in sessions}
    n = 0
    for a in agents:
        for ack in a.acks[:limit]:
            if ack.kind == "snapshot":
                continue
            assert ledger.run(ack.call) == ack.result, f"{ack.kind} {ack.item} replayed otherwise"
            n += 1
    assert {sid: _state(ledger, sid) for sid in sessions} == before
    return n


def _state(ledger: Ledger, sid: str) -> dict[str, int]:
    raw = dict(ledger.session(sid).snapshot().raw)
    raw.pop("now")
    return raw


def assert_cli_audit_clean(url: str, prefix: str) -> None:
    assert ledger_cli.main(["--url", url, "--prefix", prefix, "audit"]) == ledger_cli.EXIT_OK


# --- kill -9 and restart --------------------------------------------------------------------


def fast_settings(url: str, prefix: str, **kw: Any) -> LedgerSettings:
    """Short timeouts and few retries: an outage surfaces fast, the agent re-sends."""
    base: dict[str, Any] = {
        "socket_timeout": 1.0,
        "connect_timeout": 0.5,
        "retry_attempts": 3,
        "retry_max_seconds": 1.0,
        "retry_initial_backoff": 0.01,
        "retry_max_backoff": 0.1,
    }
    base.update(kw)
    return LedgerSettings(redis_url=url, prefix=prefix, **base)


def kill_and_restart(
    server: servers.RedisProcess, load_for: float, down_for: float, marks: dict[str, float]
) -> Callable[[threading.Event], None]:
    """The scripted fault: load, SIGKILL (no shutdown, no final fsync), stay down,
    restart on the same port and dir (the AOF is reloaded), load again."""

    def fault(stop: threading.Event) -> None:
        time.sleep(load_for)
        server.kill()
        marks["killed"] = time.monotonic()
        time.sleep(down_for)
        server.restart()
        marks["restarted"] = time.monotonic()
        time.sleep(load_for)

    return fault


@pytest.mark.redis
@pytest.mark.slow
def test_kill9_restart_appendfsync_always_loses_no_acknowledged_operation() -> None:
    with servers.restartable(appendfsync="always") as srv:
        prefix = new_prefix()
        with Ledger.from_settings(fast_settings(srv.url, prefix)) as led:
            sessions = open_sessions(led, 12)
            agents = [
                Agent(f"a{i}", led, sessions[i * 3 : i * 3 + 3], seed=i, mix="basic")
                for i in range(4)
            ]
            marks: dict[str, float] = {}
            fault = kill_and_restart(srv, load_for=0.8, down_for=0.3, marks=marks)
            run_agents(agents, max_steps=100_000, max_seconds=20, during=fault)
            killed_at = marks["killed"]
            before_kill = sum(1 for a in agents for k in a.acks if k.at < killed_at)
            totals = check_invariants(led, agents)
            replayed = assert_replays(led, agents)
        assert_cli_audit_clean(srv.url, prefix)
    acked = sum(len(a.acks) for a in agents)
    resent = sum(a.stats["resent"] for a in agents)
    print(
        f"\nappendfsync always, kill -9: {acked} calls acknowledged ({before_kill} before the "
        f"kill), {resent} re-sent across the outage, 0 lost; {totals['items']} items in "
        f"{totals['sessions']} sessions match the clients; {replayed} acknowledged op ids "
        "re-sent after the restart all replayed"
    )
    assert before_kill > 50 and resent > 0


@pytest.mark.redis
@pytest.mark.slow
def test_kill9_restart_appendfsync_everysec_loss_window() -> None:
    """Measures how many acknowledged admissions a kill -9 loses with everysec (the
    window is what was acknowledged but not yet written to the AOF). Asserts only the
    invariants on what survived: audit clean, counters equal items."""
    figures = []
    with servers.restartable(appendfsync="everysec") as srv:
        for trial in range(3):
            prefix = new_prefix()
            with Ledger.from_settings(fast_settings(srv.url, prefix)) as led:
                sessions = open_sessions(led, 8)
                time.sleep(1.2)  # the opens are older than one fsync period
                agents = [
                    Agent(f"e{trial}{i}", led, sessions[i * 2 : i * 2 + 2], mix="admit-only")
                    for i in range(4)
                ]
                stop_at: dict[str, float] = {}

                def fault(stop: threading.Event, stop_at: dict[str, float] = stop_at) -> None:
                    time.sleep(0.6)
                    srv.kill()
                    stop_at["killed"] = time.monotonic()
                    stop.set()  # no new calls; those in flight are re-sent after the restart
                    srv.restart()

                run_agents(agents, max_steps=100_000, max_seconds=20, during=fault)
                lost = []
                for a in agents:
                    for sid in a.held:
                        have = {i.id for i in led.items(sid)}
                        lost += [
                            k
                            for k in a.acks
                            if k.session == sid and k.kind == "admit" and k.item not in have
                        ]
                        assert led.audit(sid).clean  # counters equal the surviving items
                killed = stop_at["killed"]
                acked = sum(len(a.acks) for a in agents)
                if lost:
                    span = (max(k.at for k in lost) - min(k.at for k in lost)) * 1000
                    before = (killed - min(k.at for k in lost)) * 1000
                    figures.append(
                        f"trial {trial}: {len(lost)}/{acked} acknowledged admissions lost, "
                        f"acknowledged over {span:.0f} ms, the oldest {before:.0f} ms "
                        "before the kill"
                    )
                else:
                    figures.append(f"trial {trial}: 0/{acked} acknowledged admissions lost")
            assert_cli_audit_clean(srv.url, prefix)
    print("\nappendfsync everysec, kill -9:\n  " + "\n  ".join(figures))


# --- SCRIPT FLUSH ---------------------------------------------------------------------------


def noscript_race(exc: Exception) -> str | None:
    """The one failure a SCRIPT FLUSH causes (see the xfail below): the EVALSHA after
    redis-py's reload met a second flush. The script did not run; re-sending is safe."""
    if isinstance(exc, LedgerError) and "No matching script" in str(exc):
        return "noscript race"
    return None


@pytest.mark.redis
@pytest.mark.slow
def test_script_flush_during_load() -> None:
    """30 SCRIPT FLUSHes, one every 50 ms, under 4 client threads: redis-py reloads a
    script on NOSCRIPT, so calls go on. A flush that lands between that reload and
    its EVALSHA fails the call (the pinned bug below; in about 3 runs out of 10 here):
    such a call did not run, the agent counts it and re-sends it. Every other call
    succeeds at once, and the invariants hold."""
    with servers.standalone() as srv:
        prefix = new_prefix()
        with Ledger.from_settings(LedgerSettings(redis_url=srv.url, prefix=prefix)) as led:
            loads = Counter[str]()
            real_load = led.client.script_load

            def counting_load(script: Any) -> Any:
                loads["script load"] += 1
                return real_load(script)

            led.client.script_load = counting_load  # type: ignore[method-assign]
            sessions = open_sessions(led, 8)
            agents = [
                Agent(
                    f"f{i}",
                    led,
                    sessions[i * 2 : i * 2 + 2],
                    seed=i,
                    mix="full",
                    resend_for=0.0,
                    tolerate=noscript_race,
                )
                for i in range(4)
            ]
            admin = redis.Redis(port=srv.port)
            flushes = 0

            def flusher(stop: threading.Event) -> None:
                nonlocal flushes
                for _ in range(30):
                    time.sleep(0.05)
                    admin.script_flush()
                    flushes += 1

            run_agents(agents, max_steps=100_000, max_seconds=20, during=flusher)
            admin.close()
            totals = check_invariants(led, agents)
            replayed = assert_replays(led, agents)
        assert_cli_audit_clean(srv.url, prefix)
    calls = sum(len(a.acks) for a in agents)
    stats = sum((a.stats for a in agents), Counter[str]())
    print(
        f"\nSCRIPT FLUSH x{flushes} during load: {calls} calls acknowledged, "
        f"{loads['script load']} reloads after NOSCRIPT, {stats['noscript race']} calls "
        f"failed by the flush-between-reload-and-EVALSHA race (re-sent), "
        f"{stats['unavailable']} unavailable, 0 other failures; {totals['items']} items "
        f"match the clients; {replayed} replays identical"
    )
    assert flushes == 30 and loads["script load"] >= flushes
    assert stats["unavailable"] == 0


# --- cut and delayed connections ---------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.slow
def test_cut_and_delayed_replies_apply_every_call_once() -> None:
    """A proxy forwards every request but cuts some connections before the reply and
    delays other replies past the socket timeout: the client retries with the same op
    id, and every call is applied once (its outcome replayed), never twice."""
    with (
        servers.standalone() as srv,
        TcpProxy(srv.port, drop_reply_rate=0.04, delay=0.3, delay_rate=0.02, seed=7) as proxy,
    ):
        prefix = new_prefix()
        settings = fast_settings(
            proxy.url, prefix, socket_timeout=0.15, retry_attempts=6, retry_max_seconds=3.0
        )
        with Ledger.from_settings(settings) as led:
            attempts = Counter[str]()
            real_evalsha = led.client.evalsha

            def counting_evalsha(sha: str, numkeys: int, *args: Any) -> Any:
                op = str(args[numkeys]) if len(args) > numkeys else "read"  # ARGV[1]: op id
                attempts[op] += 1
                return real_evalsha(sha, numkeys, *args)

            led.client.evalsha = counting_evalsha  # type: ignore[method-assign]
            sessions = open_sessions(led, 8)
            agents = [
                Agent(f"p{i}", led, sessions[i * 2 : i * 2 + 2], seed=i, mix="full")
                for i in range(4)
            ]

            def blackout(stop: threading.Event) -> None:
                """0.8 s in which every reply is cut: the ledger's own retries run out
                and the agents re-send the same calls (applied by Redis already)."""
                time.sleep(0.4)
                proxy.drop_reply_rate = 1.0
                time.sleep(0.8)
                proxy.drop_reply_rate = 0.04
                deadline = time.monotonic() + 40
                while time.monotonic() < deadline and any(
                    a.n < 150 and not a.errors for a in agents
                ):
                    time.sleep(0.05)

            run_agents(agents, max_steps=150, max_seconds=40, during=blackout)
            mutating = {op: n for op, n in attempts.items() if op != "read"}
            retried = sum(1 for n in mutating.values() if n > 1)
            most = max(mutating.values())
            proxy.faults_enabled = False
            totals = check_invariants(led, agents)
            replayed = assert_replays(led, agents)
        with Ledger.from_settings(LedgerSettings(redis_url=srv.url, prefix=prefix)) as direct:
            check_invariants(direct, agents)
        assert_cli_audit_clean(srv.url, prefix)
    calls = sum(len(a.acks) for a in agents)
    gave_up = sum(a.stats["unavailable"] for a in agents)
    st = proxy.stats
    print(
        f"\nproxy: {st.connections} connections, {st.replies} replies forwarded, "
        f"{st.dropped} cut before the reply, {st.delayed} delayed 300 ms (timeout 150 ms); "
        f"{calls} calls acknowledged, {retried} mutating calls needed more than one "
        f"attempt (at most {most}), "
        f"{gave_up} times the ledger's retries ran out (0.8 s blackout) and the agent "
        "re-sent; "
        f"0 applied twice; {totals['items']} items match; {replayed} replays identical"
    )
    assert st.dropped > 0 and st.delayed > 0 and retried > 0 and gave_up > 0


# --- clock skew -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[servers.RedisProcess]:
    with servers.standalone() as s:
        yield s


@pytest.mark.redis
@pytest.mark.parametrize("skew", [600.0, -600.0], ids=["plus10min", "minus10min"])
def test_client_clock_skew_does_not_move_deadlines(
    server: servers.RedisProcess, monkeypatch: pytest.MonkeyPatch, skew: float
) -> None:
    real_time, real_mono = time.time, time.monotonic
    monkeypatch.setattr(time, "time", lambda: real_time() + skew)
    monkeypatch.setattr(time, "monotonic", lambda: real_mono() + skew)
    assert abs(time.time() - real_time() - skew) < 1
    prefix = new_prefix()
    with Ledger.from_settings(LedgerSettings(redis_url=server.url, prefix=prefix)) as led:
        s = led.open_session("skewed", roomy_budget())
        lease = 30_000
        res = s.reserve(SCR, "r1", 100, lease_ms=lease)
        sec, usec = led.client.time()
        server_now = sec * 1000 + usec // 1000
        assert abs(res.deadline_ms - server_now - lease) < 1_000, (res.deadline_ms, server_now)
        assert abs(res.deadline_ms - time.time() * 1000 - lease) > 500_000  # not the client's
        # A sweep on Redis's clock releases nothing early...
        assert led.expire_due(s.keys.partition) == 0
        assert s.settle("r1", 90, "item-1").charged == 90
        # ...and a short lease does end, whatever the client's clock says.
        s.reserve(SCR, "r2", 50, lease_ms=200)
        assert led.expire_due(s.keys.partition) == 0
        real_sleep_until = real_mono() + 0.3
        while real_mono() < real_sleep_until:
            time.sleep(0.02)
        assert led.expire_due(s.keys.partition) == 1
        assert led.audit("skewed").clean
    assert_cli_audit_clean(server.url, prefix)


# --- the NOSCRIPT reload race -------------------------------------------------------------------


@pytest.mark.redis
def test_script_flush_between_load_and_evalsha_is_retried(
    server: servers.RedisProcess,
) -> None:
    prefix = new_prefix()
    with Ledger.from_settings(LedgerSettings(redis_url=server.url, prefix=prefix)) as led:
        s = led.open_session("flushed", roomy_budget())
        real_load = led.client.script_load

        flushed = []

        def load_then_flush(script: Any) -> Any:
            sha = real_load(script)
            if not flushed:  # once: a ledger that retried would then succeed
                led.client.script_flush()  # another client's SCRIPT FLUSH lands here
                flushed.append(sha)
            return sha

        server_admin = redis.Redis(port=server.port)
        server_admin.script_flush()
        server_admin.close()
        led.client.script_load = load_then_flush  # type: ignore[method-assign]
        s.admit(RET, [Item("doc", 10)])


# --- the audit after a close ---------------------------------------------------------------------


@pytest.mark.redis
def test_cli_audit_after_a_session_was_closed(server: servers.RedisProcess) -> None:
    prefix = new_prefix()
    with Ledger.from_settings(LedgerSettings(redis_url=server.url, prefix=prefix)) as led:
        led.open_session("kept", roomy_budget()).admit(RET, [Item("doc", 10)])
        assert led.open_session("closed", roomy_budget()).delete().deleted
        assert led.session_ids() == ["kept"]
    assert_cli_audit_clean(server.url, prefix)
