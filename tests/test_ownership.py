"""Compaction ownership (worker or agent), failed compactions counted per attempt, and
the safe defaults: no implicit embedded backend, no implicit compactor."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from ledger import Item, Ledger, LedgerSettings, SessionBudget, cli
from ledger.errors import ConfigurationError
from ledger.workers.compactors import CompactionPlan, CompactionRequest
from ledger.workers.runner import Metrics, Worker, WorkerSettings, mask_url
from tests.support import jobs

AGENT_BUDGET = SessionBudget(
    window=10_000, system_prompt=500, output_reserve=500, compaction="agent"
)


# --- safe defaults -------------------------------------------------------------------


def test_no_url_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LEDGER_REDIS_URL", raising=False)
    assert LedgerSettings().redis_url is None
    with pytest.raises(ConfigurationError, match=r"LEDGER_REDIS_URL.*embedded://"):
        Ledger.from_url()
    with pytest.raises(ConfigurationError, match="no Redis URL"):
        Ledger.from_settings(LedgerSettings(prefix="x"))


@pytest.mark.parametrize(
    "argv", [["worker", "--compactor", "none"], ["audit"], ["top", "--once"], ["inspect", "s"]]
)
def test_commands_without_url_exit_2(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LEDGER_REDIS_URL", raising=False)
    assert cli.main(argv) == cli.EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert "no Redis URL" in err and "LEDGER_REDIS_URL" in err and "embedded://" in err


def test_worker_without_compactor_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LEDGER_WORKER_COMPACTOR", raising=False)
    assert cli.main(["--url", "embedded://no-compactor", "worker", "--once"]) == 2
    assert "needs a compactor named explicitly" in capsys.readouterr().err
    with Ledger.from_url("embedded://no-compactor") as led, pytest.raises(ConfigurationError):
        Worker(led, WorkerSettings())


def test_mask_url() -> None:
    assert mask_url("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert mask_url("rediss://:secret@h:1") == "rediss://:***@h:1"
    assert mask_url("redis://h:1/0") == "redis://h:1/0"


def test_first_log_line_names_url_prefix_partitions_compactor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = LedgerSettings(redis_url="embedded://first-line", prefix="fl", partitions=3)
    with Ledger.from_settings(s) as led, caplog.at_level(logging.INFO, "ledger.worker"):
        w = Worker(led, WorkerSettings(compactor="ledger.workers.compactors:simulated"), Metrics())
        w.run(threading.Event(), once=True)
    first = caplog.records[0]
    assert first.getMessage() == "worker starting"
    got = {k: getattr(first, k) for k in ("url", "prefix", "partitions", "compactor")}
    assert got == {
        "url": "embedded://first-line",
        "prefix": "fl",
        "partitions": 3,
        "compactor": "ledger.workers.compactors:simulated",
    }
    json.dumps(got)


# --- ownership -----------------------------------------------------------------------


def test_agent_owned_session_gets_no_compaction_jobs(ledger: Ledger) -> None:
    """Due compactions are reported to the agent, never enqueued; the agent's failed
    compactions are not retried by a job; the hard-reset escalation still is."""
    s = ledger.open_session("own/agent", AGENT_BUDGET)
    s.admit("working_memory", jobs.WM_ITEMS)
    assert s.end_turn(0, 8_000).compaction_due
    assert jobs.entries_for(ledger, "own/agent") == []
    replies = [s.compact([], None) for _ in range(3)]
    assert [r.failures for r in replies] == [1, 2, 3]
    kinds = [f["kind"] for _, f in jobs.entries_for(ledger, "own/agent")]
    assert kinds == ["hard_reset"]
    # a worker-owned session with the same history gets the job; an agent's own failed
    # compaction while that job is queued adds no second one
    w = ledger.open_session("own/worker", jobs.BUDGET)
    w.admit("working_memory", jobs.WM_ITEMS)
    assert w.end_turn(0, 8_000).compaction_due
    w.compact([], None)
    kinds = [f["kind"] for _, f in jobs.entries_for(ledger, "own/worker")]
    assert kinds == ["compact"]


def test_worker_skips_compact_jobs_of_agent_owned_sessions(ledger: Ledger) -> None:
    sid = "own/skip"
    s = ledger.open_session(sid, AGENT_BUDGET)
    s.admit("working_memory", jobs.WM_ITEMS)
    assert s.end_turn(0, 8_000).compaction_due
    # a compact job written by hand (e.g. from before an ownership change)
    ledger.client.xadd(
        jobs.jobs_of(ledger, sid), {"kind": "compact", "session": sid, "epoch": str(s.epoch)}
    )
    worker = jobs.new_worker(ledger)
    jobs.never_enough.calls.pop(sid, None)
    jobs.drain(ledger, worker)
    assert sid not in jobs.never_enough.calls
    reg = worker.metrics.registry
    assert reg.get_sample_value("ledger_jobs_skipped_total", {"kind": "compact"}) == 1
    assert jobs.counters(ledger, sid, "x:failed_compactions", "x:resets") == ("0", "0")


@pytest.mark.redis
def test_agent_mode_with_a_live_worker(redis_server: object) -> None:
    """50 turns of an agent that compacts inline with a worker running alongside: the
    worker compacts nothing and resets nothing."""
    settings = LedgerSettings(redis_url=redis_server.url, prefix="agentmode")  # type: ignore[attr-defined]
    with Ledger.from_settings(settings) as led:
        worker = jobs.new_worker(led, compactor=jobs.NEVER_ENOUGH)
        stop = threading.Event()
        th = threading.Thread(target=worker.run, args=(stop,), daemon=True)
        th.start()
        try:
            s = led.open_session("agent-live", AGENT_BUDGET)
            due = 0
            for turn in range(50):
                t = s.begin_turn(0).turn
                s.admit("working_memory", [Item(f"m{turn}", 600)])
                if s.end_turn(t, 600).compaction_due:
                    due += 1
                    held = [i for i in led.items("agent-live") if i.id.startswith("m")]
                    old = [i.id for i in held[:-1]]
                    r = s.compact(old, Item(f"sum{turn}", 100, 1000))
                    assert r.outcome == "compacted"
            deadline = time.monotonic() + 20
            while jobs.busy(led):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        finally:
            stop.set()
            th.join(10)
        reg = worker.metrics.registry
        assert due >= 3
        assert not reg.get_sample_value("ledger_jobs_processed_total", {"kind": "compact"})
        assert jobs.counters(led, "agent-live", "x:resets", "x:failed_compactions") == ("0", "0")


# --- failed compactions counted per attempt -------------------------------------------


class RaisesTwiceThenMisses:
    """Raises on the first two deliveries of every job, then plans a compaction that
    misses H (replaces nothing)."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, request: CompactionRequest) -> CompactionPlan:
        with self.lock:
            self.calls += 1
            n = self.calls
        if n % 3:
            raise RuntimeError(f"summarizer timeout (call {n})")
        return CompactionPlan((), None)


raises_twice = RaisesTwiceThenMisses()


def test_three_attempts_one_reset_redeliveries_are_not_attempts(ledger: Ledger) -> None:
    sid = "attempts"
    jobs.open_compaction(ledger, sid)
    raises_twice.calls = 0
    worker = jobs.new_worker(ledger, compactor="tests.test_ownership:raises_twice")
    jobs.drain(ledger, worker)
    reg = worker.metrics.registry
    h = jobs.session_hash(ledger, sid)
    got = (h["x:failed_compactions"], h["x:escalations"], h["x:resets"], h["ep"])
    assert got == ("3", "1", "1", "2"), h
    # three requests, each delivered three times: six raised, three judged
    assert raises_twice.calls == 9
    assert reg.get_sample_value("ledger_jobs_failed_total", {"kind": "compact"}) == 6
    assert reg.get_sample_value("ledger_jobs_retried_total") == 6
    assert reg.get_sample_value("ledger_jobs_processed_total", {"kind": "hard_reset"}) == 1
    assert ledger.audit(sid).clean
