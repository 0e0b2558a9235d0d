"""Background-worker benchmark: job throughput and takeover time on one Redis server;
with --idle, what an idle worker costs and how fast it picks up a job.

    python -m bench.bench_workers [--jobs N] [--json] [--reps R] [--partitions P]
    python -m bench.bench_workers --metrics SESSIONS [--rounds R] [--latency-jobs N]
    python -m bench.bench_workers --queue-wait [--wait-seconds S] [--baseline DIR]
    python -m bench.bench_workers --idle [--partitions P] [--idle-seconds S]
                                  [--latency-jobs N] [--cluster]

It starts its own redis-server (ledger.testing.standalone); the workers are real
``python -m ledger.cli worker`` processes configured through ``LEDGER_*`` environment
variables, each logging JSON to its own file; a fresh key prefix for every run.

1. Throughput, one worker process and two: N sessions opened, the workers started, then
   N ``hard_reset`` jobs, one per session, appended to the partition streams in one
   pipeline; the clock runs until every stream is empty and nothing is pending (polled
   every 5 ms). Every session's epoch is checked to have moved exactly once.
2. Takeover: two workers A and B; once A holds pending jobs it is killed with SIGKILL
   (a kill that finds it holding nothing is not counted, and repeated); the time from
   the kill until B has completed every job A held. A dead worker's jobs are claimable
   ``claim_idle_ms`` after their delivery and B looks every claim_idle_ms / 4: expect at
   most 1.25 claim_idle_ms plus the work. R repetitions, median and max.
3. Idle (--idle, instead): one worker with its default settings and no session, left
   alone 1 s; then over --idle-seconds the Redis commands it sends per second (INFO
   commandstats over every node, INFO left out) and its CPU share of one core; then
   pickup latency: one hard_reset job at a time after a random 20-120 ms pause, from the
   XADD until the entry is gone (polled every 0.5 ms), median and p99. --cluster: on a
   3-primary Redis Cluster.
4. Metrics (--metrics SESSIONS, instead): pickup latency as in 3 with that many live
   sessions, a worker with a metrics port and OBSERVE_INTERVAL=1 against one without,
   in interleaved rounds; the median per round and the median ratio on / off (min-max).
5. Queue wait (--queue-wait, instead): one worker at its default max_in_flight (16)
   with an async LLM-like compactor (3-6 s a summary, asyncio.sleep); a new session
   becomes due for compaction every 0.4 s for --wait-seconds (about 11 compactions in
   flight: slots stay free); each job's wait from its enqueueing (the entry id's time)
   to its start (its "job done" time minus its duration), p50, p90 and max. --baseline
   DIR runs the same with the worker imported from DIR (a checkout of another commit,
   e.g. ``git worktree add /tmp/old <commit>``): the before / after figure.

Worker processes, redis-server and this script share the CPUs (``nproc`` is reported).
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from bench.common import ROOT, cpu_seconds, emit, environment
from ledger import Ledger, LedgerSettings, SessionBudget
from ledger import testing as servers
from ledger.testing import WorkerProc, spawn_worker

GROUP = "ledger-workers"
BUDGET = SessionBudget(window=10_000, system_prompt=500, output_reserve=500)
CLAIM_IDLE_MS, POLL_INTERVAL = 500, 0.02


class Run:
    """One fresh prefix on the server: sessions, jobs and worker processes."""

    def __init__(self, url: str, partitions: int, logs: Path) -> None:
        self.url, self.partitions, self.logs = url, partitions, logs
        self.prefix = f"bw{uuid.uuid4().hex[:10]}"
        self.led = Ledger.from_settings(
            LedgerSettings(redis_url=url, prefix=self.prefix, partitions=partitions)
        )
        self.r: redis.Redis = self.led.client  # type: ignore[assignment]
        self.workers: list[WorkerProc] = []
        self.sids: list[str] = []

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        for w in self.workers:
            w.kill()
        keys = list(self.r.scan_iter(match=f"{self.prefix}:*", count=1000))
        for k in range(0, len(keys), 500):
            self.r.delete(*keys[k : k + 500])
        self.led.close()

    def spawn(self, consumer: str, defaults: bool = False, **extra: str) -> WorkerProc:
        """A worker process; `defaults`: the worker's own settings (idle), from ROOT."""
        env = {
            "LEDGER_REDIS_URL": self.url,
            "LEDGER_PREFIX": self.prefix,
            "LEDGER_PARTITIONS": str(self.partitions),
        }
        if defaults:
            env["PYTHONPATH"] = str(ROOT)
        else:
            env["LEDGER_WORKER_CLAIM_IDLE_MS"] = str(CLAIM_IDLE_MS)
            env["LEDGER_WORKER_POLL_INTERVAL"] = str(POLL_INTERVAL)
            env["LEDGER_WORKER_SWEEP_INTERVAL"] = "60"  # no lease sweeps in the measurement
        w = spawn_worker(consumer, env | extra, self.logs / f"{self.prefix}-{consumer}.log")
        self.workers.append(w)
        return w

    def open_sessions(self, n: int) -> None:
        self.sids = [f"s{i}" for i in range(n)]
        self.epochs = [self.led.open_session(sid, BUDGET).epoch for sid in self.sids]

    def enqueue(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        for sid, epoch in zip(self.sids, self.epochs, strict=True):
            pipe.xadd(self.stream(sid), {"kind": "hard_reset", "session": sid, "epoch": epoch,
                                         "reason": "bench", "op": "bench"})  # fmt: skip
        pipe.execute()

    def stream(self, sid: str) -> str:
        return self.led.keyspace.jobs(self.led.keyspace.partition_of(sid))

    @property
    def streams(self) -> list[str]:
        return [self.led.keyspace.jobs(p) for p in range(self.partitions)]

    def backlog(self) -> int:
        """Jobs not yet done: entries pending in the group, plus entries after its last
        delivered id. (Not XLEN: a worker killed between its XACK and its XDEL leaves an
        acknowledged entry in the stream for ever; see leftovers().)"""
        pipe = self.r.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xinfo_groups(stream)
        groups = [next(g for g in gs if g["name"] == GROUP.encode()) for gs in pipe.execute()]
        pending = sum(int(g["pending"]) for g in groups)
        if pending:
            return pending
        pipe = self.r.pipeline(transaction=False)
        for stream, g in zip(self.streams, groups, strict=True):
            pipe.xrange(stream, min=b"(" + g["last-delivered-id"], max="+", count=1)
        return sum(len(rows) for rows in pipe.execute())

    def leftovers(self) -> int:
        """Entries acknowledged but never deleted (their worker died between the two)."""
        return sum(self.r.xlen(stream) for stream in self.streams)

    def wait_drained(self, timeout: float = 120.0, step: float = 0.005) -> None:
        deadline = time.monotonic() + timeout
        while self.backlog():
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs not drained within {timeout}s: {self.backlog()} left")
            time.sleep(step)

    def check_each_applied_once(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        for sid in self.sids:
            pipe.hmget(self.led.keyspace.session(sid).session, "ep", "inc", "x:resets")
        # A new session's epoch is its creation time ("inc"); a reset adds one.
        bad = [
            sid
            for sid, (ep, inc, resets) in zip(self.sids, pipe.execute(), strict=True)
            if (int(ep) - int(inc), resets) != (1, b"1")
        ]
        if bad:
            raise RuntimeError(f"{len(bad)} sessions not reset exactly once, e.g. {bad[:5]}")

    def held_by(self, consumer: str) -> list[tuple[str, bytes]]:
        return [
            (stream, row["message_id"])
            for stream in self.streams
            for row in self.r.xpending_range(stream, GROUP, "-", "+", 100_000, consumer)
        ]

    def still_there(self, entries: list[tuple[str, bytes]]) -> int:
        pipe = self.r.pipeline(transaction=False)
        for stream, eid in entries:
            pipe.xrange(stream, eid, eid)
        return sum(1 for rows in pipe.execute() if rows)


def throughput(url: str, a: argparse.Namespace, logs: Path, workers: int) -> dict[str, Any]:
    with Run(url, a.partitions, logs) as run:
        run.open_sessions(a.jobs)
        procs = [run.spawn(f"tp{workers}-{k}") for k in range(workers)]
        for w in procs:
            w.wait_started()
        t0 = time.perf_counter()
        run.enqueue()
        t_enq = time.perf_counter()
        run.wait_drained()
        elapsed = time.perf_counter() - t0
        codes = [w.stop() for w in procs]
        run.check_each_applied_once()
        if run.leftovers():
            raise RuntimeError(f"{run.leftovers()} entries left in the streams")
        per_worker = {w.consumer: len(w.messages("job done")) for w in procs}
        if sum(per_worker.values()) != a.jobs or any(codes):
            raise RuntimeError(f"jobs done {per_worker}, exit codes {codes}")
        return {"workers": workers, "jobs": a.jobs, "seconds": round(elapsed, 4),
                "enqueue_seconds": round(t_enq - t0, 4), "jobs_per_s": round(a.jobs / elapsed, 1),
                "per_worker": per_worker}  # fmt: skip


def takeover_once(url: str, a: argparse.Namespace, logs: Path) -> dict[str, Any] | None:
    """One kill; None when the victim held no job at the kill (it acknowledged its last
    ones just before, or the jobs were all done before it was seen holding one)."""
    with Run(url, a.partitions, logs) as run:
        run.open_sessions(min(a.jobs, 1000))
        victim, taker = run.spawn("victim"), run.spawn("taker")
        victim.wait_started()
        taker.wait_started()
        run.enqueue()
        time.sleep(random.uniform(0.02, 0.1))
        deadline = time.monotonic() + 30
        while not run.held_by(victim.consumer):  # kill it while it holds jobs
            if time.monotonic() > deadline:
                raise RuntimeError("the victim never held a job")
            if not run.backlog():  # all done before the victim was seen holding one
                victim.kill()
                taker.stop()
                return None
            time.sleep(0.001)
        t_kill = time.perf_counter()
        victim.proc.kill()
        victim.proc.wait(10)
        held = run.held_by(victim.consumer)
        if not held:
            taker.stop()
            return None
        while run.still_there(held):
            if time.perf_counter() - t_kill > 60:
                raise RuntimeError("the held jobs were not taken over within 60 s")
            time.sleep(0.002)
        took = time.perf_counter() - t_kill
        run.wait_drained()
        code = taker.stop()
        run.check_each_applied_once()
        if code:
            raise RuntimeError(f"taker exited with {code}")
        return {"held": len(held), "seconds": round(took, 4), "acked_not_deleted": run.leftovers()}


def commands(clients: list[redis.Redis]) -> dict[str, int]:
    """Commands served so far by name, over every node (INFO itself left out)."""
    total: dict[str, int] = {}
    for c in clients:
        for k, v in c.info("commandstats").items():
            if k != "cmdstat_info":
                total[k[8:]] = total.get(k[8:], 0) + int(v["calls"])
    return total


def pickup(run: Run, w: WorkerProc, sids: list[str], epochs: list[int]) -> list[float]:
    """One hard_reset job at a time, each after a random pause of 20-120 ms: seconds from
    its XADD until it is gone from its stream (done), sorted."""
    lat = []
    for sid, epoch in zip(sids, epochs, strict=True):
        time.sleep(random.uniform(0.02, 0.12))
        stream = run.stream(sid)
        fields = {"kind": "hard_reset", "session": sid, "epoch": epoch, "reason": "bench"}
        t = time.perf_counter()
        eid = run.r.xadd(stream, fields)  # type: ignore[arg-type]
        while run.r.xrange(stream, eid, eid):
            if time.perf_counter() - t > 30:
                raise RuntimeError(f"job {sid} not picked up within 30 s: {w.tail()}")
            time.sleep(0.0005)
        lat.append(time.perf_counter() - t)
    return sorted(lat)


def with_metrics(a: argparse.Namespace) -> dict[str, Any]:
    """Pickup latency with `a.metrics` sessions open, the worker's metrics on (a pass over
    every session each second, OBSERVE_INTERVAL=1, in its own thread) against off, in
    interleaved rounds (off, on, off, on, ...) of latency_jobs jobs each."""
    with (
        servers.standalone() as server,
        tempfile.TemporaryDirectory(prefix="bench-workers-") as d,
        Run(server.url, a.partitions, Path(d)) as run,
    ):
        ids = [f"live-{i}" for i in range(a.metrics)]
        for k in range(0, a.metrics, 500):
            run.led.run_many([run.led.open_call(sid, BUDGET, None) for sid in ids[k : k + 500]])
        out: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(a.rounds):
            for mode in ("off", "on"):
                extra = {}
                if mode == "on":
                    extra = {
                        "LEDGER_WORKER_METRICS_PORT": str(servers.free_port()),
                        "LEDGER_WORKER_OBSERVE_INTERVAL": "1",
                    }
                w = run.spawn(f"{mode}-{r}", **extra)
                w.wait_started()
                time.sleep(1.5)  # the first metrics pass is under way
                sids = [f"j-{mode}-{r}-{i}" for i in range(a.latency_jobs)]
                epochs = [run.led.open_session(sid, BUDGET).epoch for sid in sids]
                out[mode].append(statistics.median(pickup(run, w, sids, epochs)))
                w.stop()
        env = environment(run.r)
    ratios = [on / off for on, off in zip(out["on"], out["off"], strict=True)]
    return {"env": env, "live_sessions": a.metrics, "rounds": a.rounds,
            "jobs_per_round": a.latency_jobs,
            "pickup_ms_median": {m: [round(1000 * x, 2) for x in v] for m, v in out.items()},
            "ratio_on_off": round(statistics.median(ratios), 3),
            "ratio_min_max": [round(min(ratios), 3), round(max(ratios), 3)]}  # fmt: skip


def idle(a: argparse.Namespace) -> dict[str, Any]:
    """An idle worker (its default settings): commands/s, CPU, pickup."""
    with (
        servers.cluster(3) if a.cluster else servers.standalone() as server,
        tempfile.TemporaryDirectory(prefix="bench-workers-") as d,
    ):
        procs = server if isinstance(server, list) else [server]
        url = f"redis+cluster://127.0.0.1:{procs[0].port}" if a.cluster else procs[0].url
        nodes = [redis.Redis(port=n.port) for n in procs]
        env = environment(nodes[0])
        with Run(url, a.partitions, Path(d)) as run:
            w = run.spawn("idle", defaults=True)
            w.wait_started()
            time.sleep(1.0)
            c0, cpu0, t0 = commands(nodes), cpu_seconds(w.proc.pid), time.perf_counter()
            time.sleep(a.idle_seconds)
            c1, cpu1, t1 = commands(nodes), cpu_seconds(w.proc.pid), time.perf_counter()
            per_s = {k: (n - c0.get(k, 0)) / (t1 - t0) for k, n in c1.items()}
            run.open_sessions(a.latency_jobs)
            lat = pickup(run, w, run.sids, run.epochs)
            code = w.stop()
            run.check_each_applied_once()
            if code:
                raise RuntimeError(f"idle worker exited with {code}: {w.tail()}")
        for n in nodes:
            n.close()
    return {
        "env": env,
        "params": {
            "partitions": a.partitions,
            "idle_seconds": a.idle_seconds,
            "latency_jobs": a.latency_jobs,
            "cluster": a.cluster,
        },
        "commands_per_s": round(sum(per_s.values()), 1),
        "by_command": {k: round(v, 1) for k, v in sorted(per_s.items()) if v >= 0.05},
        "cpu_percent": round(100 * (cpu1 - cpu0) / (t1 - t0), 2),
        "pickup_ms_median": round(1000 * statistics.median(lat), 2),
        "pickup_ms_p99": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
    }


def print_idle(r: dict[str, Any]) -> None:
    p, env = r["params"], r["env"]
    print(
        f"idle ledger worker: redis {env['redis_version']} "
        f"({'a 3-primary cluster' if p['cluster'] else 'one server'}), {env['nproc']} CPUs, "
        f"python {env['python']}, {p['partitions']} partitions, no session, "
        f"{p['idle_seconds']} s; pickup over {p['latency_jobs']} jobs\n"
        f"{'cmds/s':>9} {'cpu %':>7} {'pickup p50 ms':>14} {'p99 ms':>8}\n"
        f"{r['commands_per_s']:>9.1f} {r['cpu_percent']:>7.2f} "
        f"{r['pickup_ms_median']:>14.2f} {r['pickup_ms_p99']:>8.2f}\n{'':>9} per s: "
        + ", ".join(f"{k} {v}" for k, v in r["by_command"].items())
    )


def run(a: argparse.Namespace) -> dict[str, Any]:
    with (
        servers.standalone() as server,
        tempfile.TemporaryDirectory(prefix="bench-workers-") as d,
    ):
        logs = Path(d)
        env = environment(redis.Redis.from_url(server.url))
        tp = {str(n): throughput(server.url, a, logs, n) for n in (1, 2)}
        reps: list[dict[str, Any]] = []
        for _ in range(a.reps * 10):
            rep = takeover_once(server.url, a, logs)
            if rep is not None:
                reps.append(rep)
            if len(reps) == a.reps:
                break
        else:
            raise RuntimeError("the victim held no job at the kill, too often")
    times = [r["seconds"] for r in reps]
    return {
        "env": env,
        "params": {"jobs": a.jobs, "partitions": a.partitions, "claim_idle_ms": CLAIM_IDLE_MS,
                   "poll_interval_s": POLL_INTERVAL, "batch": 16, "takeover_reps": a.reps},
        "throughput": tp,
        "takeover": {"reps": reps, "median_s": round(statistics.median(times), 4),
                     "max_s": round(max(times), 4), "claim_idle_ms": CLAIM_IDLE_MS},
    }  # fmt: skip


def print_table(res: dict[str, Any]) -> None:
    p, env, tk = res["params"], res["env"], res["takeover"]
    print(
        f"ledger worker benchmark: redis {env['redis_version']}, {env['nproc']} CPUs, "
        f"python {env['python']}, load {env['loadavg']}\n{p['jobs']} hard_reset jobs over "
        f"{p['jobs']} sessions, {p['partitions']} partitions, claim_idle_ms "
        f"{p['claim_idle_ms']}, poll {p['poll_interval_s']} s\n\n"
        f"{'workers':>8} {'jobs':>6} {'seconds':>9} {'jobs/s':>9}  per worker"
    )
    for t in res["throughput"].values():
        per = ", ".join(f"{k}={v}" for k, v in t["per_worker"].items())
        print(
            f"{t['workers']:>8} {t['jobs']:>6} {t['seconds']:>9.3f} {t['jobs_per_s']:>9.1f}  {per}"
        )
    print(f"\ntakeover after kill -9 (claim_idle_ms {tk['claim_idle_ms']}):")
    print(f"{'rep':>8} {'held':>6} {'seconds':>9}  acked, not deleted")
    for i, r in enumerate(tk["reps"], 1):
        print(f"{i:>8} {r['held']:>6} {r['seconds']:>9.3f}  {r['acked_not_deleted']}")
    print(f"{'median':>8} {'':>6} {tk['median_s']:>9.3f}\n{'max':>8} {'':>6} {tk['max_s']:>9.3f}")


def print_metrics(res: dict[str, Any]) -> None:
    med = res["pickup_ms_median"]
    print(
        f"pickup latency, {res['live_sessions']} live sessions, {res['rounds']} rounds "
        f"of {res['jobs_per_round']} jobs: median per round off {med['off']} ms, on "
        f"{med['on']} ms; on / off {res['ratio_on_off']} (min-max {res['ratio_min_max']})"
    )


# The compactor of --queue-wait, written next to the worker's log (its working directory,
# so `python -m ledger.cli worker` imports it whichever checkout the ledger comes from).
LLM_LIKE = """
import asyncio, random
from ledger import Item
from ledger.workers.compactors import CompactionPlan

async def llm_like(request):
    await asyncio.sleep(random.uniform(3.0, 6.0))  # a summary from a remote LLM
    wm = [i for i in request.items if i.consumer.value == "working_memory"]
    old = wm[:-2]
    summary = Item(f"sum-{request.turn}", max(1, sum(i.tokens for i in old) // 10), 1000)
    return CompactionPlan(tuple((i.consumer, i.id) for i in old), summary)
"""


def queue_wait_once(url: str, a: argparse.Namespace, logs: Path, old: str | None) -> dict[str, Any]:
    from ledger import Item

    (logs / "llm_like_compactor.py").write_text(LLM_LIKE)
    with Run(url, a.partitions, logs) as run:
        env = {"LEDGER_WORKER_COMPACTOR": "llm_like_compactor:llm_like"}
        if old is not None:
            env["PYTHONPATH"] = old
        w = run.spawn("queue-wait" + ("-old" if old else ""), **env)
        w.wait_started()
        items = [Item(f"old{k}", 250) for k in range(8)] + [Item(f"big{k}", 3_100) for k in (1, 2)]
        sids, deadline, k = [], time.monotonic() + a.wait_seconds, 0
        while time.monotonic() < deadline:
            sid = f"q{k}"
            s = run.led.open_session(sid, BUDGET)
            s.admit("working_memory", items)
            assert s.end_turn(0, 8_000).compaction_due
            sids.append(sid)
            k += 1
            time.sleep(0.4)
        run.wait_drained(timeout=120)
        waits = []
        for r in w.messages("job done"):
            if r.get("kind") != "compact":
                continue
            done = datetime.datetime.fromisoformat(r["ts"].replace("Z", "+00:00")).timestamp()
            start = done - r["duration_ms"] / 1000
            waits.append(start - int(r["job"].split("-")[0]) / 1000)
        if len(waits) != len(sids):
            raise RuntimeError(f"{len(waits)} compactions done of {len(sids)}")
        waits.sort()
        q = statistics.quantiles(waits, n=10)
        return {
            "jobs": len(waits),
            "p50_s": round(statistics.median(waits), 3),
            "p90_s": round(q[8], 3),
            "max_s": round(waits[-1], 3),
        }


def queue_wait(a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, servers.standalone() as server:
        logs = Path(tmp)
        res: dict[str, Any] = {
            "environment": environment(redis.Redis.from_url(server.url)),
            "wait_seconds": a.wait_seconds,
        }
        res["this"] = queue_wait_once(server.url, a, logs, None)
        if a.baseline:
            res["baseline"] = queue_wait_once(server.url, a, logs, str(Path(a.baseline)))
    return res


def print_queue_wait(res: dict[str, Any]) -> None:
    for name in ("baseline", "this"):
        if name in res:
            r = res[name]
            print(
                f"{name:>8}: {r['jobs']} compactions of 3-6 s, queue wait p50 {r['p50_s']} s, "
                f"p90 {r['p90_s']} s, max {r['max_s']} s"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_workers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--jobs", type=int, default=2000, help="hard_reset jobs per run")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    ap.add_argument("--reps", type=int, default=5, help="takeover repetitions")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--idle", action="store_true", help="measure an idle worker instead")
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--latency-jobs", type=int, default=50)
    ap.add_argument("--cluster", action="store_true", help="--idle on a 3-primary cluster")
    ap.add_argument("--metrics", type=int, metavar="SESSIONS", help="instead: pickup latency")
    ap.add_argument("--rounds", type=int, default=3, help="--metrics: interleaved rounds")
    ap.add_argument("--queue-wait", action="store_true", help="instead: queue wait of jobs")
    ap.add_argument("--wait-seconds", type=float, default=20.0, help="--queue-wait: feeding")
    ap.add_argument("--baseline", help="--queue-wait: also with the worker of this checkout")
    a = ap.parse_args(argv)
    if a.jobs < 1 or a.reps < 1 or a.latency_jobs < 1:
        ap.error("--jobs, --reps and --latency-jobs must be at least 1")
    if a.queue_wait:
        emit(queue_wait(a), a.json, print_queue_wait)
    elif a.metrics:
        emit(with_metrics(a), a.json, print_metrics)
    elif a.idle:
        emit(idle(a), a.json, print_idle)
    else:
        emit(run(a), a.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
