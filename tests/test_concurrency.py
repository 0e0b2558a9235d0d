"""Concurrency on a real redis-server (the `redis_server` fixture): sixteen OS processes
(spawn) hammer three sessions with admit / release / reserve / settle / void, each call
with an explicit op id; a fifth of the calls is sent a second time with the same op id (a
retry after a lost reply), and now and then an old call is sent again. Every process
records what it believes it holds; at the end the ledger holds exactly that, its counters
pass the audit, and free >= 0.

Timeouts and lost replies are in test_concurrency_lost_replies.py, the race for the last
free tokens in test_concurrency_race.py.
"""

from __future__ import annotations

import functools
import random
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from ledger import (
    Admitted,
    Consumer,
    Item,
    Ledger,
    LedgerSettings,
    Released,
    Reservation,
    SessionBudget,
    Settled,
    Voided,
)
from tests.conftest import make_settings
from tests.support import servers
from tests.support.concurrency import GROUP, REFUSAL_REASONS, SPAWN, capture, started

pytestmark = [pytest.mark.redis]


CONSUMERS = tuple(c.value for c in Consumer)


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
