"""Soak: worker processes under random DELs of job streams and repeated out-of-memory
episodes, for LEDGER_SOAK_SECONDS (default 8; the issue asks for 60).

Its own redis-server with a small maxmemory (policy noeviction). While a producer
opens sessions and enqueues jobs (hard resets it appends itself, compactions enqueued
by end_turn), a chaos thread deletes a random partition's job stream every few
hundred milliseconds (capturing, in the same atomic step, the entries it deletes) and
fills memory past maxmemory for a second or two at a time. At the end:

* every worker process is still running (and stops with exit code 0);
* every job not captured by a DEL is applied exactly once (a hard reset moved its
  session to epoch 2, x:resets 1; a compaction: kn 1, nothing pending); a job lost
  with its stream is applied at most once;
* nothing is dead-lettered, nothing pending or undelivered.

The figures (jobs, DELs, OOM replies, groups made again, exit codes) are printed.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from ledger import Ledger, LedgerSettings
from ledger.errors import LedgerError
from ledger.testing import WorkerProc, spawn_worker
from tests.support import jobs, servers

SOAK_SECONDS = float(os.environ.get("LEDGER_SOAK_SECONDS", "8"))
PARTITIONS = 8
MAXMEMORY = 48 * 1024 * 1024
WORKERS = 2
# Deletes a stream and returns what it held, in one step: the jobs lost with it.
TAKE_AND_DELETE = (
    "local e = redis.call('XRANGE', KEYS[1], '-', '+') redis.call('DEL', KEYS[1]) return e"
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@dataclass
class Tally:
    resets: list[tuple[str, str]] = field(default_factory=list)  # (session, entry id)
    oom_resets: int = 0  # of which enqueued in the step that starts an OOM episode
    compactions: list[str] = field(default_factory=list)  # sessions whose job was enqueued
    refused: int = 0  # producer calls refused (OOM)
    lost: set[tuple[str, str]] = field(default_factory=set)  # (stream, entry id) deleted
    lost_sessions: set[str] = field(default_factory=set)  # the sessions they named
    dels: int = 0
    oom_episodes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def produce(led: Ledger, tally: Tally, stop: threading.Event) -> None:
    k = 0
    while not stop.wait(0.04):
        for sid in (f"reset-{k}", f"reset-{k}b"):
            try:
                epoch = led.open_session(sid, jobs.BUDGET).epoch
                fields = {"kind": "hard_reset", "session": sid, "epoch": epoch, "reason": "soak"}
                eid = jobs.text(led.client.xadd(jobs.jobs_of(led, sid), {**fields, "op": "x"}))
                with tally.lock:
                    tally.resets.append((sid, eid))
            except (LedgerError, redis.ResponseError):
                tally.refused += 1
        sid = f"compact-{k}"
        try:
            jobs.open_compaction(led, sid)  # end_turn enqueues the job in the same step
            with tally.lock:
                tally.compactions.append(sid)
        except LedgerError:
            tally.refused += 1
        k += 1


def chaos(admin: redis.Redis, led: Ledger, tally: Tally, stop: threading.Event) -> None:
    rng = random.Random(20_240_611)
    take = admin.register_script(TAKE_AND_DELETE)
    admin.script_load(TAKE_AND_DELETE)  # loaded now: SCRIPT LOAD may be refused under OOM
    next_oom = time.monotonic() + rng.uniform(0.5, 1.5)
    oom_until = 0.0
    while not stop.wait(rng.uniform(0.1, 0.4)):
        stream = led.keyspace.jobs(rng.randrange(PARTITIONS))
        gone = take(keys=[stream])
        with tally.lock:
            tally.dels += 1
            for eid, body in gone or []:
                tally.lost.add((stream, jobs.text(eid)))
                fields = dict(zip(body[::2], body[1::2], strict=True))
                tally.lost_sessions.add(jobs.text(fields.get(b"session", b"?")))
        now = time.monotonic()
        if oom_until and now >= oom_until:
            admin.delete(BALLAST)
            oom_until, next_oom = 0.0, now + rng.uniform(1.0, 2.5)
        elif not oom_until and now >= next_oom:
            start_oom(admin, led, tally, f"oom{tally.oom_episodes}")
            tally.oom_episodes += 1
            oom_until = now + rng.uniform(1.0, 2.0)
    admin.delete(BALLAST)


# Appends one hard-reset job per session (KEYS[i]: its stream, ARGV[i + 1]: the session,
# ARGV[n + 1 + i]: its epoch)
# and fills memory past maxmemory (ARGV[1] MiB in the hash KEYS[#KEYS]) in one step.
# Redis checks maxmemory only before a script's first write, and a pipelined SET of
# that size would be refused while it sits in the query buffer.
ENQUEUE_AND_FILL = """
local n = #KEYS - 1
local ids = {}
for i = 1, n do
  ids[i] = redis.call('XADD', KEYS[i], '*', 'kind', 'hard_reset', 'session', ARGV[i + 1],
    'epoch', ARGV[n + 1 + i], 'reason', 'soak', 'op', 'x')
end
local chunk = string.rep('x', 1048576)
for j = 1, tonumber(ARGV[1]) do redis.call('HSET', KEYS[n + 1], 'c' .. j, chunk) end
return ids
"""
BALLAST = "soak:ballast"


def start_oom(admin: redis.Redis, led: Ledger, tally: Tally, tag: str) -> None:
    """Fill memory past maxmemory in the same step as enqueueing hard resets of 20
    sessions without items (each reset's first write needs memory): the workers meet
    OOM on them until the episode ends."""
    sids, epochs = [], []
    for i in range(20):
        with contextlib.suppress(LedgerError):  # the producer may have filled memory
            epochs.append(led.open_session(f"{tag}-{i}", jobs.BUDGET).epoch)
            sids.append(f"{tag}-{i}")
    used = int(admin.info("memory")["used_memory"])
    mib = max(1, (MAXMEMORY - used) // 1_048_576 + 2)
    keys = [jobs.jobs_of(led, sid) for sid in sids] + [BALLAST]
    with contextlib.suppress(redis.exceptions.OutOfMemoryError):  # over the limit already
        got = admin.eval(ENQUEUE_AND_FILL, len(keys), *keys, mib, *sids, *epochs)
        with tally.lock:
            tally.resets += [(sid, jobs.text(eid)) for sid, eid in zip(sids, got, strict=True)]
            tally.oom_resets += len(sids)


def scrape(port: int) -> dict[str, float]:
    """A worker's metrics: 'name{label="v"}' -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@pytest.fixture
def server() -> Iterator[servers.RedisProcess]:
    with servers.standalone("--maxmemory", str(MAXMEMORY)) as s:
        yield s


@pytest.mark.timeout(int(SOAK_SECONDS * 4) + 180)
def test_workers_survive_stream_dels_and_oom(server: servers.RedisProcess, tmp_path: Path) -> None:
    admin = server.client()
    prefix = f"soak{uuid.uuid4().hex[:8]}"
    settings = LedgerSettings(redis_url=server.url, prefix=prefix, partitions=PARTITIONS)
    procs: list[tuple[WorkerProc, int]] = []
    with Ledger.from_settings(settings) as led, contextlib.ExitStack() as cleanup:
        for i in range(WORKERS):
            port = servers.free_port()
            env = {
                "LEDGER_REDIS_URL": server.url,
                "LEDGER_PREFIX": prefix,
                "LEDGER_PARTITIONS": str(PARTITIONS),
                "LEDGER_WORKER_CLAIM_IDLE_MS": "300",
                "LEDGER_WORKER_POLL_INTERVAL": "0.02",
                "LEDGER_WORKER_BACKOFF_MAX": "0.5",
                "LEDGER_WORKER_COMPACTOR": jobs.ENOUGH,
                "LEDGER_WORKER_METRICS_PORT": str(port),
            }
            w = spawn_worker(f"soak-{i}", env, tmp_path / f"soak-{i}.log")
            cleanup.callback(w.kill)
            procs.append((w, port))
        for w, _ in procs:
            w.wait_started()

        tally, stop = Tally(), threading.Event()
        threads = [
            threading.Thread(target=produce, args=(led, tally, stop)),
            threading.Thread(target=chaos, args=(admin, led, tally, stop)),
        ]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < SOAK_SECONDS:
                time.sleep(0.5)
                for w, _ in procs:
                    assert w.proc.poll() is None, w.tail()
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        admin.delete(BALLAST)

        jobs.wait_until(lambda: jobs.busy(led) == 0, 120, "every job still there to be done")
        alive = [w.proc.poll() for w, _ in procs]
        metrics = [scrape(port) for _, port in procs]

        def total(name: str) -> float:
            return sum(m.get(name, 0.0) for m in metrics)

        exits = [w.stop() for w, _ in procs]

        def lost(sid: str, eid: str) -> bool:
            return (jobs.jobs_of(led, sid), eid) in tally.lost

        lost_resets = [(s, e) for s, e in tally.resets if lost(s, e)]
        for sid, eid in tally.resets:
            ep, resets = jobs.counters(led, sid, "ep", "x:resets")
            if lost(sid, eid):
                assert (ep, resets) in (("1", "0"), ("2", "1")), (sid, eid, ep, resets)
            else:
                assert (ep, resets) == ("2", "1"), (sid, eid, ep, resets)
        compaction_lost = 0
        for sid in tally.compactions:
            kn, cd, failed = jobs.counters(led, sid, "kn", "cd", "x:failed_compactions")
            assert failed == "0" and kn in ("0", "1"), (sid, kn, failed)
            if kn == "0":  # its job went with a deleted stream
                compaction_lost += 1
                assert cd == "1" and sid in tally.lost_sessions, (sid, cd)
            else:
                assert cd == "0"
        dead = sum(int(led.client.xlen(f"{led.keyspace.tag(p)}:dead")) for p in range(PARTITIONS))
        figures = {
            "seconds": SOAK_SECONDS,
            "reset_jobs": len(tally.resets),
            "reset_jobs_enqueued_as_oom_began": tally.oom_resets,
            "compaction_jobs": len(tally.compactions),
            "producer_calls_refused": tally.refused,
            "stream_dels": tally.dels,
            "jobs_lost_with_streams": len(tally.lost),
            "reset_jobs_lost": len(lost_resets),
            "compaction_jobs_lost": compaction_lost,
            "oom_episodes": tally.oom_episodes,
            "worker_oom_replies": total('ledger_worker_errors_total{kind="oom"}'),
            "worker_nogroup": total('ledger_worker_errors_total{kind="nogroup"}'),
            "groups_made_again": total("ledger_job_streams_lost_total"),
            "jobs_processed": total('ledger_jobs_processed_total{kind="hard_reset"}')
            + total('ledger_jobs_processed_total{kind="compact"}'),
            "jobs_taken_over": total("ledger_jobs_taken_over_total"),
            "internal_errors": total('ledger_worker_errors_total{kind="internal"}'),
            "dead_letters": dead,
            "alive_at_end": alive,
            "exit_codes": exits,
        }
        print(f"\nsoak figures: {figures}")
        assert alive == [None] * WORKERS
        assert exits == [0] * WORKERS
        assert dead == 0
        assert figures["internal_errors"] == 0
        assert tally.dels >= SOAK_SECONDS  # the chaos did run
        assert tally.oom_episodes >= 1 and figures["worker_oom_replies"] >= 1
        assert figures["groups_made_again"] >= 1
        for w, _ in procs:
            assert "Traceback" not in w.log.read_text(), w.tail()
    admin.close()
