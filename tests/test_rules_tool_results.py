"""Record 002 of docs/rules.md, replayed with the demo scenario's numbers (a truncated
system prompt, half a tool result): tool results are admitted whole, spilled to a preview,
or refused.

Every test takes the parametrized ``ledger`` fixture (embedded fakeredis, a real
redis-server, a real Redis Cluster); the helpers are in tests/support/rules.py. Tests named
``test_bug_*`` are regressions of defects found and fixed.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from ledger import (
    AdmissionRefused,
    Item,
    Ledger,
    LedgerSettings,
    SessionBudget,
)
from tests.support.rules import (
    REC,
    RET,
    SCR,
    WM,
    budget_002,
    clean,
    new_sid,
    numbers,
    raw_hash,
    run_workers,
)

# --- admission control for tool results (rules.md#admission-with-spill) ---------------


def test_record002_oversized_result_spilled_then_memory_gives_way(
    ledger: Ledger, settings: LedgerSettings
) -> None:
    b = budget_002()
    s = ledger.open_session(new_sid(), b)
    # Up to 40 memory chunks: retrieval (mixed priorities) and recall.
    s.admit(RET, [Item(f"r{i:02d}", 300, priority=i % 3) for i in range(10)])
    s.admit(REC, [Item("m0", 500, 1), Item("m1", 500, 0)])
    memory = 10 * 300 + 2 * 500
    free0 = clean(ledger, s).free
    assert free0 == b.window - b.reserved_floor - memory

    # Turn N: a 24k file read. It cannot fit even with all memory evicted: spilled.
    content = '{"file":"big.json","rows":[' + ",".join(str(i) for i in range(3_000)) + "]}"
    big = s.admit_tool_result("call-24k", 24_000, content)
    assert big.outcome == "spilled" and big.spilled
    assert big.preview_tokens == big.charged == b.spill_preview_tokens
    assert big.tokens == 24_000
    assert big.evicted == ()  # the preview fitted: memory was not even touched
    snap = clean(ledger, s)
    assert snap.system_prompt == b.system_prompt and snap.tool_framing == b.tool_framing
    assert snap.free == free0 - b.spill_preview_tokens
    # Another worker reads the whole result through the handle.
    with Ledger.from_settings(settings) as other:
        assert other.read_spill(s.id, "call-24k") == content.encode()

    # Working memory above its floor, so that the next result fits only with no memory.
    above = snap.free + memory - 20_000
    s.admit(WM, [Item("h1", b.working_memory_floor), Item("h2", above)])
    assert clean(ledger, s).free == 20_000 - memory

    # Turn N+1: a 20k result. Memory gives way, all of it; the result is whole.
    r = s.admit_tool_result("call-20k", 20_000, '{"rows": []}')
    assert r.outcome == "admitted"
    assert r.charged == r.tokens == 20_000  # no truncation
    assert r.preview_tokens == 0
    retrieval_order = sorted(range(10), key=lambda i: (i % 3, i))  # priority, then age
    assert r.evicted == (
        *((RET, f"r{i:02d}") for i in retrieval_order),
        (REC, "m1"),
        (REC, "m0"),
    )
    after = clean(ledger, s)
    assert after.used[RET] == after.used[REC] == 0  # memory degraded to zero
    assert after.used[WM] == b.working_memory_floor + above  # never the elastic source
    assert after.used[SCR] == b.spill_preview_tokens + 20_000
    assert after.system_prompt == b.system_prompt
    assert after.free == 0
    assert ledger.read_spill(s.id, "call-20k") is None  # admitted whole, not spilled


def test_record002_preview_admitted_after_memory_gives_way(ledger: Ledger) -> None:
    b = budget_002()
    s = ledger.open_session(new_sid(), b)
    free0 = s.snapshot().free
    s.admit(RET, [Item("r0", 400), Item("r1", 400)])
    s.admit(SCR, [Item("fill", free0 - 800 - 100)])
    assert s.snapshot().free == 100
    r = s.admit_tool_result("call-big", 24_000, "x" * 100)
    assert r.outcome == "spilled" and r.charged == b.spill_preview_tokens
    assert r.evicted == ((RET, "r0"), (RET, "r1"))
    after = clean(ledger, s)
    assert after.free == 100 + 800 - b.spill_preview_tokens


def test_record002_parallel_results_one_admitted_one_spilled(
    ledger: Ledger, settings: LedgerSettings
) -> None:
    b = budget_002()
    s = ledger.open_session(new_sid(), b)
    free0 = s.snapshot().free
    size = free0 // 2 + 1_000  # each fits alone, not both
    assert size <= free0 < 2 * size
    results: dict[str, Any] = {}
    barrier = threading.Barrier(2)

    def worker(name: str) -> None:
        with Ledger.from_settings(settings) as led:
            sess = led.session(s.id)
            barrier.wait()
            results[name] = sess.admit_tool_result(f"call-{name}", size, f"result {name}")

    run_workers(worker, ("a", "b"))
    outcomes = sorted(r.outcome for r in results.values())
    assert outcomes == ["admitted", "spilled"]
    for r in results.values():
        assert r.charged == (size if r.outcome == "admitted" else b.spill_preview_tokens)
    after = clean(ledger, s)
    assert after.used[SCR] == size + b.spill_preview_tokens
    (spilled,) = (r for r in results.values() if r.spilled)
    assert ledger.read_spill(s.id, spilled.item) == f"result {spilled.item[5:]}".encode()


def test_record002_result_that_cannot_take_its_preview_is_refused(ledger: Ledger) -> None:
    b = SessionBudget(
        window=32_000, system_prompt=2_100, tool_framing=150, output_reserve=1_024
    )  # no floors: the only room is free room
    s = ledger.open_session(new_sid(), b)
    s.admit(SCR, [Item("fill", s.snapshot().free - 100)])
    before = raw_hash(ledger, s)
    with pytest.raises(AdmissionRefused) as info:
        s.admit_tool_result("call-x", 24_000, "x")
    assert info.value.reason == "token_budget_exhausted"
    assert info.value.requested == 24_000 and info.value.free == 100
    after = raw_hash(ledger, s)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    # Only the outcome generation, the TTL refresh and the refusal counter move.
    journal = (b"gz", b"xp", b"x:")
    assert all(k.startswith(journal) for k in changed), changed
    assert ledger.read_spill(s.id, "call-x") is None
    clean(ledger, s)


def test_record002_duplicate_call_id_charges_nothing(ledger: Ledger) -> None:
    s = ledger.open_session(new_sid(), budget_002())
    first = s.admit_tool_result("call-1", 1_000, "{}")
    assert first.outcome == "admitted"
    before = numbers(s)
    again = s.admit_tool_result("call-1", 1_000, "{}")  # another op id: a second delivery
    assert again.outcome == "duplicate" and again.charged == 0
    assert again.free == first.free
    assert numbers(s) == before
    clean(ledger, s)
