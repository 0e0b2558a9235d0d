"""A history run: real servers, client processes, a worker, faults; then the checker.

``run(seed)`` starts a ``redis-server`` with ``appendonly yes`` and ``appendfsync
always``, a TCP proxy in front of it that loses replies (the clients connect through
it), a real ``ledger worker`` and client processes (``client.py``) that take turns on a
few shared sessions; injects the faults the seed schedules (kill -9 of a client, of the
worker, of Redis, a client paused past its turn lease); stops the clients, lets the
leases run out and sweeps them; reads the final state of each session; and checks the
recorded history against it (``check.py``). ``run(seed, failover=True)`` does the same
on a 3-primary Redis Cluster with replicas and ``replica_acks=1``, and kills (-9) the
primary of the sessions' slots: a failover.

Reproducible by its seed: the schedule and every client's choices come from it (the
exact interleaving depends on timing, which the checker does not need: it checks what
was recorded, whatever the order).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from ledger import Ledger, LedgerSettings, Session, SessionBudget, schema
from ledger.testing import (
    ClusterNodes,
    RedisProcess,
    WorkerProc,
    replicated_cluster,
    spawn_worker,
    standalone,
)
from tests.support.history.check import Final, Report, check, load
from tests.support.history.client import Recorder
from tests.support.tcp_proxy import TcpProxy

ROOT = Path(__file__).resolve().parents[3]
FAULTS = ("kill_client", "pause", "kill_worker", "kill_redis", "lost_replies")
# Over its high-water mark a session's end_turn asks the worker for a compaction: its
# summary replaces old working-memory items between turns, and is delivered to the next
# turn (with what it replaced). A failed compaction is retried, never escalated to a reset.
BUDGET = SessionBudget(
    window=4_000,
    system_prompt=200,
    high_water_mark=0.5,
    eviction_threshold=1.0,
    max_failed_compactions=100,
)


@dataclass
class Plan:
    seed: int
    seconds: float = 8.0
    clients: int = 3
    sessions: int = 2
    lease_ms: int = 700
    reservation_ms: int = 1_500
    faults: tuple[str, ...] = FAULTS
    every: float = 0.0  # long form: each fault again every this many seconds
    plant: str | None = None
    window: int = BUDGET.window  # each session's window (its room: less the system prompt)
    linger_rate: float = 0.05  # turns that outlast their lease (a slow model call)
    failover: bool = False
    worker: bool = True  # a real `ledger worker` (its lease sweep; restarted when killed)
    workdir: Path | None = None


@dataclass
class Fleet:
    plan: Plan
    dir: Path
    cfg: Path
    url: str  # what the clients connect to
    direct: str  # what the worker and the checker connect to
    prefix: str
    sids: list[str]
    key: str  # the first session's key (on a cluster: its slot's primary is killed)
    clients: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    worker: WorkerProc | None = None
    born: int = 0
    done: Counter[str] = field(default_factory=Counter)

    def start_client(self) -> None:
        name = f"c{self.born}"
        self.born += 1
        with (self.dir / f"{name}.log").open("wb") as log:  # (the child keeps its own fd)
            self.clients[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.support.history.client", str(self.cfg), name],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def start_worker(self) -> None:
        env = {
            "LEDGER_REDIS_URL": self.direct,
            "LEDGER_PREFIX": self.prefix,
            "LEDGER_WORKER_SWEEP_INTERVAL": "0.2",
            # the simulated compactor, each plan recorded for the checker (compactor.py)
            "LEDGER_WORKER_COMPACTOR": "tests.support.history.compactor:recording",
            "HISTORY_COMPACTIONS": str(self.dir / "worker.compactions.jsonl"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.worker = spawn_worker(f"hw{self.done['kill_worker']}", env, self.dir / "worker.log")

    def wait_recording(self, timeout: float = 30.0) -> None:
        """Until every client has sent its first call (the run's clock starts then)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all((self.dir / f"{n}.jsonl").exists() and (self.dir / f"{n}.jsonl").stat().st_size
                   for n in self.clients):  # fmt: skip
                return
            time.sleep(0.05)
        raise RuntimeError(f"the clients did not start within {timeout} s: see {self.dir}")

    def live(self) -> list[str]:
        return [n for n, p in self.clients.items() if p.poll() is None]


def schedule(plan: Plan, rng: random.Random) -> list[tuple[float, str]]:
    """(second, fault) for each fault kind: once in the run's middle, and with ``every``
    again after each such period."""
    events = []
    kinds = [f for f in plan.faults if f != "lost_replies"]
    if plan.failover:
        kinds = ["failover", *(k for k in kinds if k in ("kill_client", "pause"))]
    for kind in kinds:
        # (a failover early: the cluster takes seconds to promote, the run goes on after)
        t = rng.uniform(0.15, 0.3 if kind == "failover" else 0.6) * plan.seconds
        while t < plan.seconds - 1.0:
            events.append((t, kind))
            if not plan.every:
                break
            t += plan.every * rng.uniform(0.7, 1.3)
    return sorted(events)


def inject(fleet: Fleet, kind: str, rng: random.Random, server: object) -> None:
    lease = fleet.plan.lease_ms / 1000
    if kind == "kill_client":
        live = fleet.live()
        if live:
            fleet.clients[rng.choice(live)].kill()
            fleet.start_client()
    elif kind == "pause":
        live = fleet.live()
        if live:
            proc = fleet.clients[rng.choice(live)]
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(lease * 2.5)  # past its turn lease: another owner may take over
            os.kill(proc.pid, signal.SIGCONT)
    elif kind == "kill_worker":
        if fleet.worker is None:
            return
        fleet.worker.kill()
        fleet.done[kind] += 1  # (the new worker's name)
        fleet.start_worker()
        fleet.done[kind] -= 1
    elif kind == "kill_redis":
        assert isinstance(server, RedisProcess)
        server.kill()
        time.sleep(0.2)
        server.restart()
    elif kind == "failover":
        assert isinstance(server, ClusterNodes)
        failover(server, fleet.key)
    fleet.done[kind] += 1


def failover(c: ClusterNodes, key: str) -> None:
    """Kill (-9) the primary that serves ``key``, wait for the cluster to promote one of
    its replicas, then start the killed node again: it comes back as a replica of the
    promoted one (as a supervisor would restart it), so a later failover finds a replica
    to promote and writes that wait for one still find one."""
    port = c.primary_port(key)
    victim = next(n for n in c.nodes() if n.port == port)
    victim.kill()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # (a node may be busy promoting)
            if c.primary_port(key) != port:
                break
        time.sleep(0.1)
    else:
        raise RuntimeError("the cluster promoted no replica within 60 s")
    victim.restart()
    # until it is a replica in sync: only then can a later failover promote it
    r = redis.Redis(port=victim.port, decode_responses=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                info = r.info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") == "up":
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{victim.url} did not come back as a replica in sync within 60 s")
    finally:
        r.close()


Servers = tuple[str, str, RedisProcess, TcpProxy | None, ClusterNodes | None]


@contextlib.contextmanager
def servers(plan: Plan, rng: random.Random) -> Iterator[Servers]:
    """(the clients' URL, the direct URL, the server the faults kill, the proxy, the
    cluster). The failover's victim has two replicas: the one not promoted follows the
    new primary, so writes that wait for a replica go on after the failover."""
    if plan.failover:
        with replicated_cluster(3, (1, 2, 1)) as c:
            yield c.url, c.url, c.primaries[1], None, c
        return
    with standalone("--appendonly", "yes", "--appendfsync", "always") as server:
        if "lost_replies" not in plan.faults:
            yield server.url, server.url, server, None, None
            return
        with TcpProxy(
            server.port, drop_reply_rate=0.02, delay=0.3, delay_rate=0.01, seed=rng.randrange(2**32)
        ) as proxy:
            yield proxy.url, server.url, server, proxy, None


def open_sessions(
    plan: Plan, url: str, prefix: str, victim: RedisProcess, c: ClusterNodes | None
) -> tuple[list[str], str]:
    """The run's sessions, and the first one's key; on a cluster, sessions the primary the
    run kills serves."""
    sids: list[str] = []
    key = ""
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
        for i in range(500):
            s = led.open_session(f"h{i}", BUDGET.model_copy(update={"window": plan.window}))
            if c is None or c.primary_port(s.keys.session) == victim.port:
                sids.append(s.id)
                key = key or s.keys.session
            if len(sids) == plan.sessions:
                return sids, key
    raise RuntimeError("no session of the victim's slots")


def undelivered(led: Ledger, s: Session) -> bool:
    """Whether the session has deliveries queued for its next turn, or a staged compaction
    that lands at it."""
    fields = (schema.QUEUED_SUMMARIES, schema.QUEUED_DROPS, schema.STAGED_COMPACTION)
    return any(led.client.hmget(s.keys.session, list(fields)))


def final_state(
    url: str, prefix: str, sids: list[str], d: Path, worker: bool = True
) -> dict[str, Final]:
    """Every lease swept, then for each session last turns of the checker's own
    (recorded, so the summaries not delivered yet are; with a ``worker``, each once it
    has no compaction pending, until none is pending and nothing is queued after the
    last), then what the session holds."""
    out = {}
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
        for p in range(led.keyspace.partitions):
            while led.expire_due(p):
                pass
        rec = Recorder(d / "last.jsonl", "last")
        for sid in sids:
            s = led.session(sid, owner="last")
            for _ in range(5):
                deadline = time.monotonic() + (10 if worker else 0)
                while s.snapshot().compaction_pending and time.monotonic() < deadline:
                    time.sleep(0.1)
                ok, began = rec.call(led, "begin_turn", sid, s.begin_turn_call(0), {})
                if ok:
                    rec.call(
                        led, "end_turn", sid, s.end_turn_call(began.turn, 1), {"turn": began.turn}
                    )
                # (a compaction pending at this turn may commit as soon as it ends: not
                # pending any more, its summary queued for a turn still to come)
                if not worker or not (s.snapshot().compaction_pending or undelivered(led, s)):
                    break
        os.close(rec.fd)
        for sid in sids:
            s = led.session(sid)
            snap = s.snapshot()
            out[sid] = Final(
                items={h.id: h.tokens for h in led.items(sid)},
                open_reservations=snap.open_reservations,
                clean=led.audit(sid).clean,
                free=snap.free,
                epoch=snap.epoch,
            )
    return out


def run(plan: Plan) -> Report:
    rng = random.Random(plan.seed)
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        d = plan.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hist-")))
        url, direct, server, proxy, c = stack.enter_context(servers(plan, rng))
        prefix = f"h{uuid.uuid4().hex[:8]}"
        sids, key = open_sessions(plan, direct, prefix, server, c)
        cfg = d / "config.json"
        cfg.write_text(json.dumps({
            "url": url, "prefix": prefix, "sessions": sids, "seed": plan.seed, "dir": str(d),
            "lease_ms": plan.lease_ms, "reservation_ms": plan.reservation_ms,
            "plant": plan.plant, "linger_rate": plan.linger_rate,
            "replica_acks": 1 if plan.failover else 0,
            "retry_max_seconds": 15.0, "window": plan.window,
        }))  # fmt: skip
        fleet = Fleet(plan, d, cfg, url, direct, prefix, sids, key)
        t0 = time.monotonic()
        try:
            if plan.worker:
                fleet.start_worker()
            for _ in range(plan.clients):
                fleet.start_client()
            if fleet.worker is not None:
                fleet.worker.wait_started()
            fleet.wait_recording()
            start = time.monotonic()
            timings = {"setup": t0 - began, "start": start - t0}
            for at, kind in schedule(plan, rng):
                time.sleep(max(0.0, start + at - time.monotonic()))
                inject(fleet, kind, rng, c if plan.failover else server)
            time.sleep(max(0.0, start + plan.seconds - time.monotonic()))
            (d / "stop").touch()
            t_stop = time.monotonic()
            timings["run"] = t_stop - start
            for p in fleet.clients.values():
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
            if proxy is not None:
                proxy.faults_enabled = False
                fleet.done["lost_replies"] = proxy.stats.dropped
            # every lease runs out, then the sweep ends what is left
            time.sleep(max(plan.lease_ms, plan.reservation_ms) / 1000 + 0.5)
            timings["stop"] = time.monotonic() - t_stop
            final = final_state(direct, prefix, sids, d, plan.worker)
        finally:
            if fleet.worker is not None:
                fleet.worker.kill()  # (the final state is read: no need to wait for it)
            for p in fleet.clients.values():
                if p.poll() is None:
                    p.kill()
        (d / "final.json").write_text(json.dumps({k: vars(v) for k, v in final.items()}))
        report = check(load(d), final)
        report.faults = dict(fleet.done)
        report.timings = {k: round(v, 1) for k, v in timings.items()}
        return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.support.history", description=__doc__)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--long", action="store_true", help="60 s, 4 clients, faults every 6 s")
    ap.add_argument("--failover", action="store_true", help="on a Redis Cluster, kill a primary")
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--dir", type=Path, help="keep the history and logs here (a new folder)")
    ap.add_argument("--check", type=Path, help="check the history kept in this folder again")
    args = ap.parse_args(argv)
    if args.check:
        final = json.loads((args.check / "final.json").read_text())
        again = check(load(args.check), {k: Final(**v) for k, v in final.items()})
        print(again.summary())
        return 1 if again.anomalies else 0
    plan = Plan(seed=args.seed, failover=args.failover)
    if args.long:
        plan.seconds, plan.clients, plan.every = 60.0, 4, 6.0
    if args.seconds:
        plan.seconds = args.seconds
    if args.dir:
        args.dir.mkdir(parents=True)
        plan.workdir = args.dir
    started = time.monotonic()
    report = run(plan)
    report.timings["total"] = time.monotonic() - started
    print(f"seed {plan.seed}{' failover' if plan.failover else ''}: {report.summary()} "
          f"({time.monotonic() - started:.0f} s)")  # fmt: skip
    return 1 if report.anomalies else 0
