"""Dead letters of the background worker (ledger/workers/runner.py) on a real Redis:
listed, replayed and purged, and named by ``ledger inspect``.

Every test uses its own key prefix on the session's ``redis_server`` and ``PARTITIONS``
partitions; the helpers (compactors named by import path, job streams, backlogs) are in
tests/support/worker_scenarios.py, the ``led`` fixture in tests/conftest.py.
"""

from __future__ import annotations

import time

import pytest

from ledger import Ledger
from tests.support import jobs
from tests.support.jobs import session_hash
from tests.support.worker_scenarios import (
    _text,
    drain_in_process,
    in_process_worker,
    open_compaction,
)

pytestmark = pytest.mark.redis


def test_dead_letters_listed_replayed_and_purged(
    led: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job the compactor always fails ends in a dead-letter stream, each death
    committed as a failed compaction, so a session's third reaches its hard reset (it is
    not left waiting for a compaction nobody makes); `ledger dead list` shows them,
    `replay` puts one back on its job stream as a new job (done as 'already': its session
    moved on to a new epoch), `purge` deletes letters; the worker exports the depth."""
    import json

    from ledger import cli, views

    open_compaction(led, "dl-1")
    open_compaction(led, "dl-2")
    worker = in_process_worker(
        led,
        compactor="tests.support.worker_scenarios:always_fails",
        max_deliveries=1,
        claim_idle_ms=10,
    )
    drain_in_process(led, worker)
    depths, letters = views.dead_letters(led)
    assert sum(depths.values()) == 6 and {d.fields["session"] for d in letters} == {"dl-1", "dl-2"}
    assert all("counted as a failed compaction (failed)" in d.fields["why"] for d in letters)
    for sid in ("dl-1", "dl-2"):
        h = session_hash(led, sid)
        assert (h["x:failed_compactions"], h["x:resets"], h["ep"], h["cd"]) == ("3", "1", "2", "0")
    worker.observe()
    gauge = worker.metrics.registry.get_sample_value
    assert sum(gauge("ledger_dead_letters", {"partition": str(p)}) or 0 for p in depths) == 6
    argv = ["--url", led.settings.redis_url or "", "--prefix", led.settings.prefix, "dead"]
    assert cli.main([*argv, "list", "--json"]) == cli.EXIT_OK
    listed = json.loads(capsys.readouterr().out)
    refs = [r["ref"] for r in listed["letters"] if r["session"] == "dl-1"]
    assert cli.main([*argv, "replay", refs[0]]) == cli.EXIT_OK
    assert cli.main([*argv, "replay", "p0:1-1"]) == cli.EXIT_VIOLATION  # no such letter
    assert cli.main([*argv, "replay"]) == cli.EXIT_USAGE  # names, or --all
    good = in_process_worker(led, claim_idle_ms=10)
    drain_in_process(led, good)
    assert jobs.metric(good, "ledger_jobs_processed_total", kind="compact") == 1  # replayed
    assert session_hash(led, "dl-1")["ep"] == "2"  # nothing more: its epoch had moved on
    assert sum(views.dead_letters(led)[0].values()) == 5
    assert cli.main([*argv, "purge", "--all"]) == cli.EXIT_OK
    assert views.dead_letters(led)[0] == {}
    capsys.readouterr()


def test_inspect_names_a_session_held_by_a_dead_letter(
    led: Ledger, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compaction that died is a failed compaction of the session's epoch: `ledger
    inspect` says the session is held by that dead letter, and names it."""
    from ledger import cli

    open_compaction(led, "dl-held")
    worker = in_process_worker(
        led,
        compactor="tests.support.worker_scenarios:always_fails",
        max_deliveries=1,
        claim_idle_ms=10,
    )
    worker.ensure_groups()
    monkeypatch.setenv("LEDGER_PARTITIONS", str(led.keyspace.partitions))
    argv = ["--url", led.settings.redis_url or "", "--prefix", led.settings.prefix]
    assert cli.main([*argv, "inspect", "dl-held"]) == cli.EXIT_OK
    assert "DEAD LETTER" not in capsys.readouterr().out
    worker.poll_once()  # the compactor raises: pending, its error recorded
    time.sleep(0.05)
    worker.poll_once()  # claimed again: delivered twice, dead-lettered
    assert session_hash(led, "dl-held")["kf"] == "1"  # counted as a failed compaction
    assert cli.main([*argv, "inspect", "dl-held"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    p = led.keyspace.partition_of("dl-held")
    [(eid, _)] = led.client.xrange(led.keyspace.dead_letters(p))
    assert "HELD BY A DEAD LETTER" in out and f"p{p}:{_text(eid)}" in out, out
    assert "summarizer down" in out
