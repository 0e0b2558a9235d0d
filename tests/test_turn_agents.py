"""Turn leases through the agent layer (ledger.agent), on every backend: a turn that
raises is rolled back, the lease is renewed while others wait or take over, and apply,
reconcile and tool results keep the process's state up to the ledger's.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from ledger import (
    AsyncLedger,
    Item,
    Ledger,
    SessionBudget,
    TurnInProgress,
    TurnLost,
)
from ledger.agent import Agent, AsyncAgent
from tests.support.turn_state import (
    BUDGET,
    R,
    W,
    loaded,
    msg,
    sid,
    state,
    words,
    worker_compaction,
)


def test_an_agent_turn_that_raises_is_rolled_back(ledger: Ledger) -> None:
    s = loaded(ledger, "A")
    before = state(ledger, s)
    agent = Agent(s, words)
    with pytest.raises(RuntimeError, match="the model call failed"), agent.turn(200) as turn:
        turn.admit("retrieval", [msg("doc-1"), msg("doc-2")])
        turn.tool_result({"id": "call-1", "content": "row " * 300})
        raise RuntimeError("the model call failed")
    assert turn.state is not None and turn.state.aborted is not None
    assert state(ledger, s) == before and ledger.audit(s.id).clean
    with agent.turn(200) as turn:  # the next turn starts from what was committed
        assert turn.rolled_back is None
        turn.prompt(5_000)


async def test_the_asyncio_face_rolls_back_and_renews_alike(aledger: AsyncLedger) -> None:
    s = await aledger.open_session(sid(), BUDGET, owner="A")
    await s.admit(W, [Item("w1", 900)])
    agent = AsyncAgent(s, words, lease_ms=300)
    other = AsyncAgent(await aledger.session(s.id, owner="B"), words)
    with pytest.raises(RuntimeError):
        async with agent.turn(0) as turn:
            await turn.admit("retrieval", [msg("doc-1")])
            raise RuntimeError("boom")
    assert [i.id for i in await aledger.items(s.id)] == ["w1"]
    async with agent.turn(0) as turn:
        import asyncio

        await asyncio.sleep(1.0)  # three leases long: renewed in the background
        with pytest.raises(TurnInProgress):
            async with other.turn(0):
                pass
        assert turn.lost is None
        turn.prompt(1_400)
    assert (await s.audit()).clean


def test_the_agent_renews_its_lease_and_others_wait_or_take_over(ledger: Ledger) -> None:
    s = loaded(ledger, "A")
    a = Agent(s, words, lease_ms=300)
    b = Agent(ledger.session(s.id, owner="B"), words, poll_interval=0.02)
    with a.turn(0) as turn:
        time.sleep(1.0)  # three leases long: renewed in the background
        with pytest.raises(TurnInProgress) as caught:
            b.turn(0).__enter__()
        assert caught.value.owner == "A"
        started = time.monotonic()
        with pytest.raises(TurnInProgress):  # waiting is bounded
            b.turn(0, wait=0.2).__enter__()
        assert 0.15 <= time.monotonic() - started < 1.0
        turn.prompt(5_100)
    with b.turn(0, wait=1.0) as theirs:  # free now: no wait
        theirs.prompt(5_100)
    with pytest.raises(TurnLost), a.turn(0) as mine:  # its end: the turn is not its own
        mine.admit("retrieval", [msg("doc-9")])
        with b.turn(0, takeover=True) as theirs:  # a stuck owner is taken over
            assert theirs.rolled_back == mine.number
            theirs.prompt(5_100)
        with pytest.raises(TurnLost):
            mine.admit("retrieval", [msg("doc-10")])
        mine.prompt(5_100)
    assert mine.state is not None and mine.state.aborted is not None
    assert mine.state.aborted.rolled_back is None  # nothing of its own left to roll back
    assert ledger.audit(s.id).clean


def test_apply_brings_any_process_state_up_to_the_ledger(ledger: Ledger) -> None:
    """Objects admitted by one process, a compaction committed between turns, the next
    turn served by another process that never saw those objects: apply drops what the
    summary replaced and puts the summary where that history began."""
    system = "You are brief."
    s = ledger.open_session(sid(), SessionBudget(window=20_000, system_prompt=words(system)))
    a = Agent(s, words)
    history: list[Any] = [system]
    with a.turn(0) as turn:
        for i in range(4):
            history += turn.admit("working_memory", [msg(f"m{i}", 100)]).kept
        turn.prompt(history)
    ledger.client.hset(
        s.keys.compacted,
        "sum-1",
        '{"text": "Earlier: four messages.", "replaced": ["w:m0", "w:m1", "w:m2"]}',
    )
    worker_compaction(
        ledger, s, ["m0", "m1", "m2"], Item("sum-1", words("Earlier: four messages."))
    )
    b = Agent(ledger.session(s.id, owner="B"), words)  # another process: knows none of them
    with b.turn(0) as turn:
        assert turn.dropped == []  # nothing it knows of
        shown = turn.apply(history)
        assert [o if isinstance(o, str) else o["id"] for o in shown] == [system, "sum-1", "m3"]
        assert turn.apply(shown) == shown  # applying twice changes nothing
        turn.prompt(shown)
    assert turn.report is not None and turn.report.drift == 0


def test_a_reconcile_drops_the_deliveries_the_prompt_contradicts(ledger: Ledger) -> None:
    """A worker's compaction lands between turns; before the next turn the app sets the
    ledger to its prompt (a repair), which still holds what the compaction replaced and
    not its summary: the queued deliveries it contradicts go, so the next turn's prompt
    is the ledger."""
    a = loaded(ledger, "A")
    worker_compaction(ledger, a, ["w1", (R, "r1")], Item("sum-1", 100, 1000))
    held = {W: [Item("w1", 900), Item("w2", 700, 3)], R: [Item("r1", 800), Item("r2", 600, 2)]}
    a.reconcile(held)
    t = a.begin_turn(0)
    assert t.summaries == () and t.dropped == ()
    assert {i.id for i in ledger.items(a.id)} >= {"w1", "w2", "r1", "r2"}
    assert "sum-1" not in {i.id for i in ledger.items(a.id)} and ledger.audit(a.id).clean


def test_a_tool_result_with_no_room_is_answered_by_a_note(ledger: Ledger) -> None:
    """Not even its preview fits: the tool call is answered by a short note that says so,
    held in the result's place; never a result cut."""
    s = ledger.open_session(
        sid(),
        SessionBudget(
            window=2_000, system_prompt=100, output_reserve=100, spill_preview_tokens=300
        ),
    )
    agent = Agent(s, words)
    with agent.turn(0) as turn:
        turn.admit("working_memory", [msg("m1", 1_750)])
        out = turn.tool_result({"id": "call-1", "content": "row " * 5_000})
        assert out.refused and out.reason in ("token_budget_exhausted", "floor_protected")
        assert "refused by the ledger" in out.text and not out.spilled
        assert {i.id: i.tokens for i in ledger.items(s.id)}["call-1"] == words(out.text)
        turn.prompt(100 + 1_750 + words(out.text))
    assert turn.report is not None and turn.report.drift == 0 and s.audit().clean
