"""Budget scopes above the session (docs/ceilings.md), on embedded, a real Redis and a
real Redis Cluster: a model call's worst case held in the session and its tenant's scopes
in one script, settled with the billed usage, voided, expired on Redis's clock; windows
that roll over under load with nothing lost or doubled."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ledger import (
    AdmissionRefused,
    BackendUnavailable,
    CallCost,
    CeilingReached,
    ConfigurationError,
    Consumer,
    InvalidArgument,
    Item,
    Ledger,
    LedgerSettings,
    LocalAllowance,
    Price,
    ReservationExpired,
    ScopeBudget,
    Session,
    SessionBudget,
    UnknownReservation,
    UnknownScope,
    Usage,
    VersionMismatch,
    protocol,
)
from ledger.keys import KeySpace
from tests.support import servers

W = Consumer.WORKING_MEMORY
BUDGET = SessionBudget(window=200_000, system_prompt=1_000)
DAY = 86_400_000
PRICES = {"big": Price(300, 1_500, 30), "*": Price(100, 400)}


def tenant() -> str:
    return f"acme{uuid.uuid4().hex[:8]}"


def state(led: Ledger, s: Session, *scopes: str) -> tuple[object, ...]:
    """The session hash, the deadline index and each scope's two keys, byte for byte."""
    out: list[object] = [led.client.hgetall(s.keys.session)]
    out.append(led.client.zrange(s.keys.deadlines, 0, -1, withscores=True))
    for name in scopes:
        sk = led.keyspace.scope(name)
        out += [led.client.hgetall(sk.hash), led.client.zrange(sk.holds, 0, -1, withscores=True)]
    return tuple(out)


def _unlike(a: object, b: object) -> set[bytes]:
    assert isinstance(a, dict) and isinstance(b, dict)
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k not in (b"xp", b"gz")}


def test_a_tenants_sessions_and_scopes_share_one_partition() -> None:
    space = KeySpace("ledger", 64)
    p = space.scope("acme").partition
    assert {space.partition_of(f"@acme/{i}") for i in range(50)} == {p}
    assert space.scope("acme/key-1").partition == p
    assert space.session("@acme/x").session.startswith(space.tag(p))
    # a session of no tenant still maps by its whole id
    assert len({space.partition_of(f"plain-{i}") for i in range(50)}) > 10


def test_reserve_settle_void_charge_the_scopes_in_the_same_step(ledger: Ledger) -> None:
    t = tenant()
    ledger.set_scope(t, ScopeBudget(window_ms=DAY, tokens=1_000, cents=1, prices=PRICES))
    ledger.set_scope(f"{t}/key1", ScopeBudget(window_ms=DAY, output=150))
    s = ledger.open_session(f"@{t}/s1", BUDGET)
    cost = CallCost(model="big", input=400, output=100, scopes=(f"{t}/key1",))
    r = s.reserve(W, "r1", 100, cost=cost)
    assert r.scopes == (t, f"{t}/key1")
    u = ledger.scope_usage(t)
    assert u.held == {"input": 400, "output": 100, "cached_input": 0, "money": 270_000}
    assert u.remaining == {"tokens": 500, "money": 730_000}

    # the key's output ceiling refuses the next one: nothing held anywhere, session included
    before = state(ledger, s, t, f"{t}/key1")
    with pytest.raises(CeilingReached) as err:
        s.reserve(W, "r2", 100, cost=CallCost(model="big", input=10, output=60, scopes=cost.scopes))
    assert (err.value.scope, err.value.quantity, err.value.ceiling) == (f"{t}/key1", "output", 150)
    assert (err.value.requested, err.value.free) == (60, 50)
    after = state(ledger, s, t, f"{t}/key1")
    assert _unlike(before[0], after[0]) == {b"x:refused_ceiling"}  # counted, nothing held
    assert after[1:4] == before[1:4] and after[5] == before[5]
    assert _unlike(before[4], after[4]) == {b"nr"}
    assert ledger.scope_usage(f"{t}/key1").refused == 1

    # settle bills more than held: charged all the same, and said so
    done = s.settle("r1", 120, billed=Usage(input=400, output=120), scopes=r.scopes)
    assert (done.over, done.billed_money, done.over_money) == (20, 300_000, 30_000)
    u = ledger.scope_usage(t)
    assert u.held["output"] == 0 and u.charged["output"] == 120 and u.over == 20
    assert sum(b["output"] for b in u.buckets.values()) == 120
    assert ledger.scope_usage(f"{t}/key1").charged["output"] == 120

    # void gives the hold back in every scope
    r3 = s.reserve(W, "r3", 10, cost=CallCost(model="other", input=100, output=10))
    assert ledger.scope_usage(t).held["money"] == 100 * 100 + 10 * 400
    s.void("r3", scopes=r3.scopes)
    assert ledger.scope_usage(t).held == dict.fromkeys(
        ("input", "output", "cached_input", "money"), 0
    )
    assert ledger.scope_usage(t).open_holds == 0


def test_the_money_ceiling_refuses_what_the_token_ceiling_allows(ledger: Ledger) -> None:
    t = tenant()
    ledger.set_scope(t, ScopeBudget(window_ms=DAY, cents=10, prices=PRICES))
    s = ledger.open_session(f"@{t}/s", BUDGET)
    # 5,000 output tokens at 1,500 cents per Mtok: 7.5 cents
    s.reserve(W, "a", 10, cost=CallCost(model="big", input=0, output=5_000))
    with pytest.raises(CeilingReached) as err:
        s.reserve(W, "b", 10, cost=CallCost(model="big", input=0, output=5_000))
    assert err.value.quantity == "money" and err.value.free == 2_500_000


def test_bad_input_is_refused_typed_and_changes_nothing(ledger: Ledger) -> None:
    t = tenant()
    ledger.set_scope(t, ScopeBudget(window_ms=DAY, tokens=1_000, hold_limit_ms=60_000))
    s = ledger.open_session(f"@{t}/s", BUDGET)
    before = state(ledger, s, t)
    with pytest.raises(UnknownScope):
        s.reserve(W, "a", 10, cost=CallCost(model="m", input=1, output=1, scopes=(f"{t}/nokey",)))
    with pytest.raises(InvalidArgument, match="hold limit"):
        s.reserve(W, "a", 10, lease_ms=120_000, cost=CallCost(model="m", input=1, output=1))
    with pytest.raises(InvalidArgument, match="within the tenant"):
        ledger.run(
            s.reserve_call(
                W, "a", 10, cost=CallCost(model="m", input=1, output=1, scopes=("zz/k",))
            )
        )
    assert state(ledger, s, t) == before
    plain = ledger.open_session(f"plain-{uuid.uuid4().hex[:6]}", BUDGET)
    with pytest.raises(InvalidArgument, match="names no tenant"):
        plain.reserve(W, "a", 10, cost=CallCost(model="m", input=1, output=1))
    money = ScopeBudget(window_ms=DAY, cents=1, prices={"m": Price(1, 1)})
    ledger.set_scope(t, money)
    with pytest.raises(InvalidArgument, match="no price"):
        s.reserve(W, "a", 10, cost=CallCost(model="unpriced", input=1, output=1))
    # calls are priced by the tenant's table only: a key's own was accepted, never read
    with pytest.raises(InvalidArgument, match="tenant's price table"):
        ledger.set_scope(f"{t}/key", money)
    with pytest.raises(UnknownScope):
        ledger.scope_usage(f"{t}/key")
    assert state(ledger, s)[:2] == before[:2]
    with pytest.raises(ConfigurationError, match="needs a price table"):
        ledger.set_scope(t, ScopeBudget(window_ms=DAY, cents=1))
    ledger.set_scope(f"{t}/key", ScopeBudget(window_ms=DAY, cents=1))  # the tenant's prices
    r = s.reserve(W, "k", 10, cost=CallCost(model="m", input=1, output=1, scopes=(f"{t}/key",)))
    assert ledger.scope_usage(f"{t}/key").held["money"] == 2  # 1 x 1 + 1 x 1 micro-cents
    s.void("k", scopes=r.scopes)


@pytest.mark.parametrize(
    ("at", "bad", "what"),
    [
        (8, "01", "input tokens"),
        (9, "-1", "output tokens"),
        (10, "1e3", "cached input tokens"),
        (8, "100000001", "input tokens"),
        (9, "", "output tokens"),
        (10, " 1", "cached input tokens"),
        (8, "1|2", "input tokens"),
        (9, "00", "output tokens"),
    ],
)
def test_a_calls_token_counts_are_checked_as_every_integer_argument(
    ledger: Ledger, at: int, bad: str, what: str
) -> None:
    """The three counts of a scoped call are read with one match (scope_tokens in
    lua/_common.lua): each is still refused as int_arg refuses it (canonical, 0..1e8),
    named, before anything is written."""
    t = tenant()
    ledger.set_scope(t, ScopeBudget(window_ms=DAY, tokens=1_000))
    s = ledger.open_session(f"@{t}/s", BUDGET)
    good = s.reserve_call(W, "a", 10, cost=CallCost(model="m", input=5, output=5))
    assert good.args[8:11] == ("5", "5", "0")  # (ARGV[9..11])
    before = state(ledger, s, t)
    args = list(good.args)
    args[at] = bad
    with pytest.raises(InvalidArgument, match=f"^{what} must be"):
        ledger.run(dataclasses.replace(good, args=tuple(args)))
    assert state(ledger, s, t) == before
    assert ledger.run(good).id == "a"


def test_a_dead_processs_hold_expires_on_redis_clock(ledger: Ledger) -> None:
    t = tenant()
    ledger.set_scope(t, ScopeBudget(window_ms=DAY, tokens=1_000))
    s = ledger.open_session(f"@{t}/s", BUDGET)
    s.reserve(W, "dead", 10, lease_ms=1_000, cost=CallCost(model="m", input=900, output=0))
    with pytest.raises(CeilingReached):
        s.reserve(W, "next", 10, cost=CallCost(model="m", input=900, output=0))
    time.sleep(1.3)  # nobody settles or voids "dead": its deadline passes on Redis's clock
    assert ledger.scope_usage(t).held["input"] == 0  # a read leaves a lapsed hold out
    r = s.reserve(W, "next", 10, cost=CallCost(model="m", input=900, output=0))
    with pytest.raises(ReservationExpired):
        s.settle("dead", 10, billed=Usage(input=900, output=0), scopes=r.scopes)
    assert ledger.scope_usage(t).open_holds == 1  # the swept hold is gone, "next" is open


def _scope_as_stored(led: Ledger, name: str) -> dict[bytes, object]:
    """A scope's hash as the scripts wrote it, less what two scopes set alike still tell
    apart: the op id of their set_scope, their price fields, the tenant's name in the holds'
    fields, and the deadline in w (a hold's deadline is the ms of the call that made it)."""
    raw = led.client.hgetall(led.keyspace.scope(name).hash)
    h = {k.replace(name.encode(), b"<tenant>"): v for k, v in raw.items()}  # (in hold names)
    for k in [k for k in h if k == b"op" or k.startswith(b"p:")]:
        del h[k]
    if b"w" in h:
        h[b"w"] = struct.unpack(protocol.SCOPE_W, h[b"w"])[:6]
    return h


def test_the_tenants_fast_path_writes_what_the_general_one_writes(ledger: Ledger) -> None:
    """A reserve charged to the tenant alone, in a fixed window, with the model priced by
    name, is judged without scope_config's tables (scope_fast in lua/_common.lua); a new
    bucket, a hold due or a ceiling passed go the general way. Two tenants set alike, one
    pricing the model by name (the fast path), the other by '*' (the general path), are
    stored alike after the same calls: holds, settles, a refusal, a lapsed hold swept, the
    window rolled over."""
    a, b = tenant(), tenant()
    price = Price(300, 1_500, 30)
    for t, prices in ((a, {"m": price}), (b, {"*": price})):
        ledger.set_scope(t, ScopeBudget(window_ms=2_000, tokens=5_000, output=2_000, cents=10,
                                        counted=("input", "output"), prices=prices))  # fmt: skip
    sa, sb = (ledger.open_session(f"@{t}/s", BUDGET) for t in (a, b))

    def start_of_a_bucket() -> None:  # (both tenants' calls then fall in one 2 s bucket)
        while True:
            sec, usec = ledger.client.time()
            if (sec % 2) * 1_000 + usec // 1_000 < 300:
                return
            time.sleep(0.01)

    def both(f: Any) -> list[Any]:
        out: list[Any] = []
        for s in (sa, sb):
            try:
                out.append(f(s))
            except CeilingReached as exc:
                out.append((exc.scope, exc.quantity, exc.requested, exc.free))
        return out

    def alike() -> None:
        assert _scope_as_stored(ledger, a) == _scope_as_stored(ledger, b)
        ua, ub = ledger.scope_usage(a), ledger.scope_usage(b)
        assert (ua.held, ua.charged, ua.open_holds, ua.refused, ua.over) == (
            ub.held, ub.charged, ub.open_holds, ub.refused, ub.over)  # fmt: skip

    call = CallCost(model="m", input=1_000, output=400, cached_input=50)
    start_of_a_bucket()
    both(lambda s: s.reserve(W, "r1", 10, cost=call))  # the first: w is new, the general way
    both(lambda s: s.reserve(W, "r2", 10, lease_ms=300, cost=call))  # fast
    r3 = both(lambda s: s.reserve(W, "r3", 10, cost=call))  # fast
    alike()
    assert ledger.scope_usage(a).open_holds == 3
    refused = both(lambda s: s.reserve(W, "r4", 10, cost=CallCost(model="m", input=0, output=900)))
    assert refused == [(a, "output", 900, 800), (b, "output", 900, 800)]  # 3 x 400 held of 2,000
    alike()
    scopes = {sa: r3[0].scopes, sb: r3[1].scopes}
    both(lambda s: s.settle("r1", 10, billed=Usage(input=900, output=500), scopes=scopes[s]))
    both(lambda s: s.void("r3", scopes=scopes[s]))
    alike()
    time.sleep(0.35)  # r2's deadline passes: the next reserve sweeps it (the general way)
    both(lambda s: s.reserve(W, "r5", 10, cost=call))
    alike()
    assert ledger.scope_usage(a).open_holds == 1  # r2 swept, r5 open
    start_of_a_bucket()  # a new bucket: the window rolled over (the general way)
    both(lambda s: s.reserve(W, "r6", 10, cost=call))
    both(lambda s: s.reserve(W, "r7", 10, cost=call))  # fast again
    alike()
    assert ledger.scope_usage(a).held["output"] == 800


def _as_layout_2(led: Ledger, name: str) -> None:
    """Rewrite a scope's hash as protocol 2 stored it: its config in fields L, G, hl, k and
    c_<q>, its live bucket in wb, w<q>, wn and nd (no packed cf and w)."""
    h = led.keyspace.scope(name).hash
    cf, w = led.client.hmget(h, "cf", "w")
    config = struct.unpack(protocol.SCOPE_CF, cf)
    caps, bits = config[3:8], config[8]
    wb, wi, wo, wc, wm, wn, nd = struct.unpack(protocol.SCOPE_W, w)
    old: dict[str, int | str] = {f"c_{q}": v for q, v in zip("ioct$", caps, strict=True) if v >= 0}
    old.update({"L": config[0], "G": config[1], "hl": config[2]})
    old["k"] = "".join(x for bit, x in ((1, "i"), (2, "o"), (4, "c")) if bits & bit)
    old.update({"wb": wb, "wi": wi, "wo": wo, "wc": wc, "w$": wm, "wn": wn, "nd": nd})
    led.client.hdel(h, "cf", "w")
    led.client.hset(h, mapping=old)


def test_a_scope_of_protocol_2_is_refused_typed_until_set_again(ledger: Ledger) -> None:
    """Protocol 3 packs a scope's configuration and live counters (docs/protocol.md,
    Version 3): a scope written by protocol 2 is refused with VersionMismatch, nothing
    written, until set_scope runs for it again, which keeps its counters and open holds."""
    t = tenant()
    budget = ScopeBudget(window_ms=DAY, tokens=10_000, cents=5, prices=PRICES)
    ledger.set_scope(t, budget)
    s = ledger.open_session(f"@{t}/s", BUDGET)
    big = CallCost(model="big", input=2_000, output=500)
    r1 = s.reserve(W, "settled", 10, cost=big)
    s.settle("settled", 10, billed=Usage(input=1_500, output=400), scopes=r1.scopes)
    r2 = s.reserve(W, "open", 10, cost=big)
    usage = dataclasses.replace(ledger.scope_usage(t), now_ms=0)
    _as_layout_2(ledger, t)
    assert dataclasses.replace(ledger.scope_usage(t), now_ms=0) == usage  # both layouts read
    before = state(ledger, s, t)
    for attempt in (
        lambda: s.reserve(W, "new", 10, cost=big),
        lambda: s.settle("open", 10, billed=Usage(input=1, output=1), scopes=r2.scopes),
        lambda: s.void("open", scopes=r2.scopes),
    ):
        with pytest.raises(VersionMismatch, match="run set_scope for it again") as err:
            attempt()
        # expected: the protocol of the scripts that refused (they read scopes of layout 3)
        assert (err.value.kind, err.value.found, err.value.expected) == (
            "layout",
            2,
            protocol.VERSION,
        )
        assert state(ledger, s, t) == before  # nothing written anywhere
    ledger.set_scope(t, budget)  # the operator sets it again: layout 3, counters kept
    assert dataclasses.replace(ledger.scope_usage(t), now_ms=0) == usage
    assert not {b"wb", b"wi", b"nd", b"c_t", b"L", b"k"} & set(
        ledger.client.hkeys(ledger.keyspace.scope(t).hash)
    )
    done = s.settle("open", 10, billed=Usage(input=1_000, output=100), scopes=r2.scopes)
    assert done.over == 0
    after = ledger.scope_usage(t)
    assert after.charged["input"] == 1_500 + 1_000 and after.open_holds == 0
    assert after.remaining["tokens"] == 10_000 - 1_900 - 1_100


def _fleet(url: str, prefix: str, t: str, seconds: float, step: int, ident: int, done: Any) -> None:
    """One OS process: reserve 100 input tokens, wait 0-30 ms (the model call; every 4th
    call until just past its bucket's end), settle a billed 1..100, for
    `seconds`; puts (ident, billed total, settles, settles after their bucket) on `done`."""
    billed_total = settles = crossed = n = 0
    with Ledger.from_settings(_settings(url, prefix)) as led:
        s = led.open_session(f"@{t}/w{ident}", SessionBudget(window=10_000_000, system_prompt=10))
        stop = time.time() + seconds
        while time.time() < stop:
            n += 1
            try:
                r = s.reserve(W, f"r{n}", 1, cost=CallCost(model="m", input=100, output=0))
            except CeilingReached:
                time.sleep(0.01)
                continue
            if n % 4 == 0:  # a long call: its settle lands just past its bucket's end
                sec, usec = led.client.time()
                time.sleep((step - (sec * 1000 + usec // 1000) % step + 5) / 1000)
            else:
                time.sleep((n * 7 + ident) % 31 / 1000)
            billed = 1 + (n * 37 + ident) % 100
            s.settle(r.id, 1, billed=Usage(input=billed, output=0), scopes=r.scopes)
            sec, usec = led.client.time()  # (Redis's clock, after the settle)
            crossed += (sec * 1000 + usec // 1000) // step > (r.deadline_ms - 30_000) // step
            billed_total, settles = billed_total + billed, settles + 1
    done.put((ident, billed_total, settles, crossed))


def _settings(url: str, prefix: str) -> LedgerSettings:
    return LedgerSettings(redis_url=url, prefix=prefix)


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("redis", marks=pytest.mark.redis, id="redis"),
        pytest.param("cluster", marks=pytest.mark.cluster, id="cluster"),
    ],
)
@pytest.mark.parametrize("bucket_ms", [None, 1_000], ids=["fixed", "rolling"])
def test_a_window_rolls_over_under_load_nothing_lost_or_doubled(
    ledger: Ledger, bucket_ms: int | None
) -> None:
    """4 OS processes reserve and settle for 5 s against a 2 s window (fixed, or rolling
    in 1 s buckets): the window rolls over again and again under them, holds settle in
    the bucket after the one they were made in, and every billed token is counted once,
    in one bucket, each window under its ceiling."""
    t = tenant()
    ceiling = 3_000
    window = 2_000
    ledger.set_scope(t, ScopeBudget(window_ms=window, bucket_ms=bucket_ms, input=ceiling))
    url, prefix = ledger.settings.redis_url, ledger.settings.prefix
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Queue()
    step = bucket_ms or window
    args = [(url, prefix, t, 5.0, step, i, done) for i in range(4)]
    procs = [ctx.Process(target=_fleet, args=a) for a in args]
    for p in procs:
        p.start()
    results = [done.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    billed = [b for _, b, _, _ in results]
    assert all(n > 0 for _, _, n, _ in results)  # every process got calls through
    assert sum(x for _, _, _, x in results) > 0  # holds settled after their bucket ended
    u = ledger.scope_usage(t)
    per_bucket = {b: v["input"] for b, v in u.buckets.items()}
    starts = sorted(per_bucket)
    assert starts[-1] - starts[0] >= 3_000  # 5 s of load: the window rolled over again and again
    assert sum(per_bucket.values()) == sum(billed)  # nothing lost, nothing doubled
    span = window // step
    for b in starts:  # every window (fixed) or every span of buckets (rolling) under the ceiling
        charged = sum(per_bucket.get(b + k * step, 0) for k in range(span))
        assert charged <= ceiling, (b, charged)
    assert u.open_holds == 0 and u.over == 0


@pytest.mark.slow
@pytest.mark.bench_smoke
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_bench_ceiling_smoke() -> None:
    """bench/bench_ceiling.py end to end, small: 4 processes, 2 tenants, kill -9 included;
    the ledger lets nothing past a ceiling (the full run's figures: docs/ceilings.md)."""
    args = ["--procs", "4", "--sessions", "8", "--tenants", "2", "--seconds", "4"]
    args += ["--window-ms", "2000", "--rounds", "2", "--calls", "100", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_ceiling", *args],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout)
    assert res["windows"] >= 2 and res["kills"] >= 1
    assert res["ledger"]["tokens"] == 0 and res["ledger"]["cents"] == 0
    assert res["baseline"]["tokens"] >= 0
    assert res["timing"]["reserve_usec"] > 0 and res["timing"]["reserve_tenant_usec"] > 0


@pytest.mark.redis
def test_redis_unreachable_refuses_or_spends_the_stated_local_allowance() -> None:
    """Fail closed: with Redis gone, a reservation with a cost raises BackendUnavailable
    (typed, after the bounded retries). The opt-in LocalAllowance then admits calls
    until the process's allowance is spent, and no further: that is its whole overshoot."""
    with servers.standalone() as srv:
        settings = LedgerSettings(
            redis_url=srv.url,
            prefix=f"t{uuid.uuid4().hex[:8]}",
            retry_attempts=2,
            retry_max_seconds=0.5,
            connect_timeout=0.5,
            socket_timeout=0.5,
        )
        t = tenant()
        with Ledger.from_settings(settings) as led:
            led.set_scope(t, ScopeBudget(window_ms=DAY, tokens=1_000_000))
            s = led.open_session(f"@{t}/s", BUDGET)
            cost = CallCost(model="m", input=3_000, output=1_000)
            s.reserve(W, "up", 1, cost=cost)  # Redis answers: held in the scope
            srv.kill()
            allowance = LocalAllowance(tokens=10_000)
            admitted = 0
            for n in range(4):
                with pytest.raises(BackendUnavailable):
                    s.reserve(W, f"down{n}", 1, cost=cost)
                admitted += allowance.admit(cost)
            assert admitted == 2 and allowance.left == (2_000, None)  # 2 x 4,000 of 10,000
            money = LocalAllowance(tokens=10**6, cents=5, price=Price(300, 1_500))
            assert [money.admit(cost) for _ in range(3)] == [True, True, False]  # 2.4 c each


@pytest.mark.cluster
def test_a_cluster_unreachable_refuses_typed_and_nothing_is_held() -> None:
    """Fail closed on a Redis Cluster too: with every node gone, a reservation with a cost
    raises BackendUnavailable after the bounded retries (nothing admitted), and a
    LocalAllowance is the only way to keep serving, within its own bound."""
    with servers.cluster(3) as nodes:
        settings = LedgerSettings(
            redis_url=f"redis+cluster://127.0.0.1:{nodes[0].port}",
            prefix=f"t{uuid.uuid4().hex[:8]}",
            retry_attempts=2,
            retry_max_seconds=0.5,
            connect_timeout=0.5,
            socket_timeout=0.5,
        )
        t = tenant()
        with Ledger.from_settings(settings) as led:
            led.set_scope(t, ScopeBudget(window_ms=DAY, tokens=1_000_000))
            s = led.open_session(f"@{t}/s", BUDGET)
            cost = CallCost(model="m", input=3_000, output=1_000)
            s.reserve(W, "up", 1, cost=cost)
            assert led.scope_usage(t).open_holds == 1
            for node in nodes:
                node.kill()
            with pytest.raises(BackendUnavailable):
                s.reserve(W, "down", 1, cost=cost)
            allowance = LocalAllowance(tokens=5_000)
            assert [allowance.admit(cost) for _ in range(2)] == [True, False]


def _pool(ledger: Ledger, pool: int) -> tuple[Session, str]:
    t = tenant()
    ledger.set_scope(t, ScopeBudget(window_ms=DAY, tokens=1_000_000))
    s = ledger.open_session(f"@{t}/parent", BUDGET)
    r = s.reserve(W, "fan", pool, cost=CallCost(model="m", input=pool, output=0))
    return s, r.id


def test_four_children_whose_floors_fit_are_none_starved(ledger: Ledger) -> None:
    s, rid = _pool(ledger, 4_000)
    for k in range(4):
        assert s.open_child(rid, f"kid{k}", 1_000).free == 4_000 - 1_000 * (k + 1)
    # the first child is greedy: it gets its floor, and nothing its siblings' floors hold
    assert s.draw_child(rid, "kid0", 1_000).used == 1_000
    with pytest.raises(AdmissionRefused) as err:
        s.draw_child(rid, "kid0", 1)
    assert err.value.free == 0
    for k in range(1, 4):  # every sibling still gets its whole floor
        assert s.draw_child(rid, f"kid{k}", 1_000).used == 1_000


def test_eight_children_whose_floors_do_not_fit_the_extra_ones_are_refused_alone(
    ledger: Ledger,
) -> None:
    s, rid = _pool(ledger, 4_000)
    opened, refused = [], []
    for k in range(8):
        try:
            s.open_child(rid, f"kid{k}", 1_000)
            opened.append(k)
        except AdmissionRefused as exc:
            assert exc.reason == "child_floor" and exc.free == 0
            refused.append(k)
    assert opened == [0, 1, 2, 3] and refused == [4, 5, 6, 7]
    for k in opened:  # the refusals took nothing from the children already open
        assert s.draw_child(rid, f"kid{k}", 1_000).free == 0
    with pytest.raises(UnknownReservation):
        s.draw_child(rid, "kid5", 1)  # a refused child was never opened


def test_without_floors_one_greedy_child_starves_its_siblings(ledger: Ledger) -> None:
    """What the floors prevent: children opened with floor 0 share the pool first come,
    first served, and the first one can take it all."""
    s, rid = _pool(ledger, 4_000)
    for k in range(4):
        s.open_child(rid, f"kid{k}", 0)
    assert s.draw_child(rid, "kid0", 4_000).used == 4_000
    with pytest.raises(AdmissionRefused):
        s.draw_child(rid, "kid1", 1)


def _children(led: Ledger, s: Session) -> dict[bytes, bytes]:
    return {k: v for k, v in led.client.hgetall(s.keys.session).items() if k.startswith(b"k:")}


def test_children_opened_or_drawn_in_an_aborted_turn_are_undone(ledger: Ledger) -> None:
    """A turn rolled back (abort_turn: its undo log) takes back what it did to children:
    a child it opened is closed, a draw it made is given back, a child of a reservation
    the turn made goes with the reservation. Children from before the turn stay as they
    were, and the pool has its room back: the same child can be opened again."""
    s, rid = _pool(ledger, 4_000)
    s.open_child(rid, "kid0", 1_000)
    s.draw_child(rid, "kid0", 500)
    before = _children(ledger, s)
    s.begin_turn(500)
    s.open_child(rid, "kid1", 2_000)
    assert s.draw_child(rid, "kid0", 1_000).used == 1_500  # 500 past its floor
    with pytest.raises(AdmissionRefused):
        s.open_child(rid, "kid2", 501)  # 500 left: floors 1,000 + 2,000, kid0's 500 past its own
    inner = s.reserve(W, "inner", 1_000)
    s.open_child(inner.id, "sub", 600)
    s.draw_child(inner.id, "sub", 700)
    assert _children(ledger, s) != before
    assert s.abort_turn().rolled_back > 0
    assert _children(ledger, s) == before  # as the turn found them, byte for byte
    assert s.open_child(rid, "kid1", 2_000).free == 4_000 - 1_000 - 2_000  # room is back
    assert s.draw_child(rid, "kid0", 500).used == 1_000  # its draws from before the turn
    again = s.reserve(W, "inner", 1_000)  # the rolled-back reservation's id, new again
    assert s.open_child(again.id, "sub", 600).free == 400  # no child left on it


def test_usage_as_genai_attributes_one_name_a_quantity() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as semconv

    from ledger.adapters import otel

    # the names are the pinned release's
    assert otel.INPUT == semconv.GEN_AI_USAGE_INPUT_TOKENS
    assert otel.OUTPUT == semconv.GEN_AI_USAGE_OUTPUT_TOKENS
    assert otel.CACHE_READ == semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS
    assert otel.CONVERSATION == semconv.GEN_AI_CONVERSATION_ID
    with Ledger.from_url(f"embedded://{uuid.uuid4().hex}") as led:
        s = led.open_session("@acme/otel", BUDGET)
        s.admit(W, [Item("turn1", 700)])
        attrs = otel.usage_attributes(
            s.id, Usage(input=1_000, output=200, cached_input=3_000), s.snapshot()
        )
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("chat") as span:
        span.set_attributes(attrs)
    got = dict(exporter.get_finished_spans()[0].attributes or {})
    assert got[otel.INPUT] == 4_000 and got[otel.CACHE_READ] == 3_000 and got[otel.OUTPUT] == 200
    assert got[otel.CONVERSATION] == "@acme/otel"
    assert got["ledger.window.working_memory.used"] == 700
    assert got["ledger.window.free"] == BUDGET.window - 1_000 - 700 - BUDGET.output_reserve
    gen_ai = [k for k in got if k.startswith("gen_ai.")]
    assert sorted(gen_ai) == sorted({otel.INPUT, otel.OUTPUT, otel.CACHE_READ, otel.CONVERSATION})


@pytest.mark.redis
def test_ledger_scope_shows_a_tenants_window(
    redis_server: servers.RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    from ledger import cli

    prefix, t = f"t{uuid.uuid4().hex[:8]}", tenant()
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        led.set_scope(t, ScopeBudget(window_ms=DAY, tokens=10_000))
        s = led.open_session(f"@{t}/s", BUDGET)
        r = s.reserve(W, "a", 1, cost=CallCost(model="m", input=3_000, output=500))
        s.settle("a", 1, billed=Usage(input=3_000, output=900), scopes=r.scopes)
        s.reserve(W, "b", 1, cost=CallCost(model="m", input=1_000, output=0))
    argv = ["--url", redis_server.url, "--prefix", prefix, "scope", t, "--json"]
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["charged"]["input"] == 4_000 and got["held"]["input"] == 1_000
    assert got["remaining"] == {"tokens": 10_000 - 4_900} and got["over"] == 400
    assert cli.main(["--url", redis_server.url, "--prefix", prefix, "scope", f"{t}/none"]) == 1
    assert "no ceilings set" in capsys.readouterr().err
