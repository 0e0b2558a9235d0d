"""Stateful property test of the rules (docs/rules.md): the ledger against a model of the scripts.

tests/test_properties.py checks admit / release / reserve / settle / void. This file's
model (tests/support/rules_model.py) restates, in plain Python, what lua/begin_turn.lua, admit.lua,
admit_tool.lua, compact.lua, record_span.lua, end_turn.lua and release.lua do to one
session, and hypothesis drives them (tests/support/rules_machine.py; plus replays of earlier calls
under their op ids) in a small window where refusals, reclamation, spills and failed
compactions happen often:

begin_turn   residual = W - S - T - out' - max(memory, F_rm) - scratchpad against
             need = max(working set, working memory, F_w) after the consumers released
             each turn are rotated out; regime ok / starvation / loud (occupancy at the
             eviction threshold); reclamation scratchpad oldest first, then retrieval
             (ids recall still holds first, then oldest), then recall oldest first,
             applied only if it closes the gap; otherwise WorkingMemoryStarvation with
             the working-memory items to compact (lowest priority, then oldest), nothing
             changed but a pending compaction (and its job); else the turn advances with
             this turn's output reserve, and a compaction is due above the high-water mark.
admit        'all' / 'prefix', duplicates, floor_protected vs token_budget_exhausted, and
             while a compaction is pending memory (retrieval, recall) is capped at
             W - out - HW - pm (pm: memory admitted since it became pending), none at
             all while the last compaction failed, with reason compaction_pending; a
             request within that cap but not the free room gets the free-room reason.
admit_tool   whole; whole once memory gives way (retrieval before recall, lowest priority
             then oldest); spilled with a preview; refused (judged on the preview);
             duplicate tool-call ids.
compact      replaced items of any consumer, a working-memory summary, compacted /
             failed / did_not_fit, the failure count, one escalation (hard-reset job) at
             max_failed_compactions, a compaction job on other failures.
record_span  the amplification ratio and the fan-out guard; refused once the turn ended.
end_turn     ratio, utilization and its delta, the four classes, compaction due, roll-up.
release      tokens, count and missing ids.

After every step: every outcome equals the model's; the snapshot (free, used / items per
consumer, turn, epoch, output reserve, compaction pending, failed compactions, the raw
counters), the other hash fields the rules keep (kt, te, pu, ao, telemetry counters), the
exact held items (ledger.items), the job stream and the spilled contents equal the
model's; free is never negative and the audit is clean.

Each example opens a session with a drawn budget variant (marks, consumers released each
turn, spill preview, failures that escalate, roll-up and amplification thresholds) and a
drawn load of small items. Most rules aim at a rule's edges (the gate's boundary, what
reclamation can give back, the room and the per-call cap, the fan-out threshold, the
classes' delta) so that ~25 steps reach them. The test_bug_* tests at the end are
the defects this model found, kept as regression tests since their fixes.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from ledger import AdmissionRefused, Consumer, Item, Ledger, Session, SessionBudget
from ledger.errors import WorkingMemoryStarvation
from tests.conftest import make_settings
from tests.support import servers
from tests.support.rules_machine import RulesMachine
from tests.support.rules_model import (
    F_M,
    F_W,
    MAX_OUT,
    OUT,
    S,
    T,
    W,
)
from tests.support.stateful import run_machine


def check(url: str, max_examples: int) -> None:
    run_machine(RulesMachine, url, max_examples, steps=25)


@pytest.mark.slow
@pytest.mark.embedded
def test_rules_match_model_embedded() -> None:
    check(f"embedded://{uuid.uuid4().hex}", max_examples=30)


@pytest.mark.slow
@pytest.mark.redis
def test_rules_match_model_redis(redis_server: servers.RedisProcess) -> None:
    check(redis_server.url, max_examples=15)


@pytest.mark.slow
@pytest.mark.cluster
def test_rules_match_model_cluster(redis_cluster: list[servers.RedisProcess]) -> None:
    check(f"redis+cluster://127.0.0.1:{redis_cluster[0].port}", max_examples=8)


# --- defects the model found, fixed: each stays as a regression test ---------------------


def _session(sid: str, **kw: Any) -> tuple[Ledger, Session]:
    ledger = Ledger.from_settings(make_settings(f"embedded://{uuid.uuid4().hex}"))
    budget = SessionBudget(
        window=W,
        system_prompt=S,
        tool_framing=T,
        working_memory_floor=F_W,
        min_memory=F_M,
        output_reserve=OUT,
        **kw,
    )
    return ledger, ledger.open_session(sid, budget)


@pytest.mark.embedded
def test_bug_starvation_refusal_reports_the_sessions_free() -> None:
    """begin_turn's refusal reports free computed with the refused turn's own output
    reserve (-2600 here) instead of the session's free (250)."""
    ledger, s = _session("bug/free")
    with ledger:
        s.admit(Consumer.WORKING_MEMORY, [Item("t1", 1_000)])
        s.admit(Consumer.SCRATCHPAD, [Item("x", 2_000)])
        free = s.snapshot().free  # 250
        with pytest.raises(WorkingMemoryStarvation) as caught:
            s.begin_turn(400, MAX_OUT)  # refused: nothing changes
        assert s.snapshot().free == free
        assert caught.value.free == free


@pytest.mark.embedded
def test_bug_duplicates_are_not_refused_while_a_compaction_is_pending() -> None:
    """An 'all' batch of duplicates (charged 0) is refused as compaction_pending when
    the per-call cap W - out - HW is negative; 'prefix' admits the same batch."""
    ledger, s = _session("bug/dups")
    with ledger:
        s.admit(Consumer.RETRIEVAL, [Item("a", 100)])
        s.begin_turn(0, 1_500)  # this turn's output reserve 1500: cap 4000 - 1500 - 2880 < 0
        with pytest.raises(WorkingMemoryStarvation):
            s.begin_turn(3_500, 1_500)  # a compaction is now pending
        assert s.snapshot().compaction_pending
        prefix = s.admit(Consumer.RETRIEVAL, [Item("a", 100)], partial=True)
        assert (prefix.charged, prefix.duplicates) == (0, 1)
        whole = s.admit(Consumer.RETRIEVAL, [Item("a", 100)])
        assert (whole.charged, whole.duplicates) == (0, 1)
        with pytest.raises(AdmissionRefused) as caught:  # anything new is still capped
            s.admit(Consumer.RETRIEVAL, [Item("a", 100), Item("b", 1)])
        assert (caught.value.reason, caught.value.requested) == ("compaction_pending", 1)


@pytest.mark.embedded
def test_bug_recall_released_each_turn_does_not_make_retrieval_redundant() -> None:
    """The ids recall holds are taken before the rotation, so a retrieval chunk whose
    recall copy is released this turn is still reclaimed first, before older chunks."""
    ledger, s = _session("bug/rotation", release_each_turn=frozenset({Consumer.RECALL}))
    with ledger:
        s.admit(Consumer.RETRIEVAL, [Item("a", 300), Item("b", 300)])  # a is the older
        s.admit(Consumer.RECALL, [Item("b", 300)])  # released at the next begin_turn
        # After the rotation: residual 4000 - 350 - 200 - 600 = 2850; one chunk must go.
        started = s.begin_turn(2_851)
        assert started.rotated == 300
        assert started.reclaimed == ((Consumer.RETRIEVAL, "a"),)  # the oldest
