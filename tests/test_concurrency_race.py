"""Two processes race for the last free tokens of a session, on a real redis-server (the
`redis_server` fixture): exactly one wins.
"""

from __future__ import annotations

import functools
import random
import traceback
from collections import Counter
from typing import Any

import pytest

from ledger import (
    Consumer,
    Item,
    Ledger,
    LedgerSettings,
    SessionBudget,
    Snapshot,
)
from tests.conftest import make_settings
from tests.support import servers
from tests.support.concurrency import GROUP, REFUSAL_REASONS, SPAWN, capture, started

pytestmark = [pytest.mark.redis]


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
