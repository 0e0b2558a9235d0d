"""Throwaway Redis servers and worker processes for tests and benchmarks.

``standalone()`` starts a ``redis-server`` on a free port in a temporary directory and
stops it afterwards; ``cluster(n)`` makes an n-primary Redis Cluster the same way,
``replicated_cluster(n, replicas)`` one with replicas for failover tests;
``spawn_worker()`` runs ``ledger worker`` as a child process logging JSON lines to a
file. Nothing here touches a server you already run: every server is a child process
with its own port. Needs the ``redis-server`` and ``redis-cli`` binaries.

    from ledger import Ledger
    from ledger.testing import standalone

    with standalone() as server, Ledger.from_url(server.url) as ledger:
        ...
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(bus: bool = False) -> int:
    """A free port (and, for cluster nodes, port + 10000 free too)."""
    for _ in range(200):
        port = random.randint(20000, 40000)
        if _port_free(port) and (not bus or _port_free(port + 10000)):
            return port
    raise RuntimeError("no free port found")


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(
            f"{name} is not installed: the real-server tests need it (apt-get install redis-server)"
        )
    return path


@dataclass
class RedisProcess:
    port: int
    dir: Path
    extra: Sequence[str] = ()
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def listen_args(self) -> list[str]:
        return ["--port", str(self.port)]

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=1)

    def start(self) -> RedisProcess:
        args = [
            require_binary("redis-server"),
            *self.listen_args(),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            str(self.dir / "redis.log"),
            *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                log = self.dir / "redis.log"
                text = log.read_text() if log.exists() else ""
                raise RuntimeError(f"{self.url}: redis-server exited: {text[-2000:]}")
            with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError):
                r = self.client()
                try:
                    if r.ping():
                        return
                finally:
                    r.close()
            time.sleep(0.05)
        raise RuntimeError(f"{self.url}: redis-server did not answer within {timeout}s")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self, timeout: float = 15.0) -> RedisProcess:
        """Start a stopped (or killed) server again with the same port, dir and options
        (with ``appendonly yes`` it reloads its AOF)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"redis-server on {self.port} is still running")
        # redis-server binds with SO_REUSEADDR: the killed server's connections in
        # TIME_WAIT do not keep it from listening on the same port again.
        self.start()
        self.wait_ready(timeout)  # loading a long AOF can take a while
        return self


@contextlib.contextmanager
def standalone(*extra: str) -> Iterator[RedisProcess]:
    with tempfile.TemporaryDirectory(prefix="ledger-redis-") as d:
        server = RedisProcess(free_port(), Path(d), extra).start()
        try:
            yield server
        finally:
            server.stop()


@contextlib.contextmanager
def cluster(primaries: int = 3) -> Iterator[list[RedisProcess]]:
    """A Redis Cluster of `primaries` primaries (one or more, no replicas): each node
    takes an even range of the 16384 slots, then meets the first."""
    if primaries < 1:
        raise ValueError(f"a cluster needs at least one primary, got {primaries}")
    with tempfile.TemporaryDirectory(prefix="ledger-cluster-") as d:
        nodes: list[RedisProcess] = []
        try:
            for i in range(primaries):
                nd = Path(d) / f"n{i}"
                nd.mkdir()
                nodes.append(
                    RedisProcess(
                        free_port(bus=True),
                        nd,
                        (
                            "--cluster-enabled",
                            "yes",
                            "--cluster-config-file",
                            str(nd / "nodes.conf"),
                            "--cluster-node-timeout",
                            "2000",
                        ),
                    ).start()
                )
            clients = [redis.Redis(port=n.port) for n in nodes]
            for i, r in enumerate(clients):
                first, last = i * 16384 // primaries, (i + 1) * 16384 // primaries - 1
                r.cluster("set-config-epoch", i + 1)
                r.cluster("addslotsrange", first, last)
            for r in clients[1:]:
                r.cluster("meet", "127.0.0.1", nodes[0].port)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                infos = [r.cluster("info") for r in clients]
                if all(
                    i.get("cluster_state") == "ok"
                    and int(i.get("cluster_known_nodes", 0)) == primaries
                    for i in infos
                ):
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError("cluster did not reach state ok")
            for r in clients:
                r.close()
            yield nodes
        finally:
            for n in nodes:
                n.stop()


def _cluster_node(directory: Path, node_timeout_ms: int, *extra: str) -> RedisProcess:
    directory.mkdir()
    return RedisProcess(
        free_port(bus=True),
        directory,
        (
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(directory / "nodes.conf"),
            "--cluster-node-timeout", str(node_timeout_ms),
            *extra,
        ),
    ).start()  # fmt: skip


@dataclass
class ClusterNodes:
    """A running Redis Cluster with replicas: ``primaries[i]`` and ``replicas[i]``, the
    nodes that followed it when the cluster was made (after a failover a replica may be
    the primary: ask :meth:`primary_port`)."""

    primaries: list[RedisProcess]
    replicas: list[list[RedisProcess]]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.primaries[0].port}"

    def nodes(self) -> list[RedisProcess]:
        return [*self.primaries, *(r for rs in self.replicas for r in rs)]

    def primary_port(self, key: str, via: RedisProcess | None = None) -> int:
        """The port of the primary that serves ``key``'s slot, as a live node sees it."""
        alive = [
            n for n in ([via] if via else self.nodes()) if n and n.proc and n.proc.poll() is None
        ]
        r = redis.Redis(port=alive[0].port, socket_timeout=2)
        try:
            slot = int(r.cluster("keyslot", key))
            for row in r.execute_command("CLUSTER SLOTS"):  # type: ignore[no-untyped-call]
                if int(row[0]) <= slot <= int(row[1]):
                    return int(row[2][1])
        finally:
            r.close()
        raise RuntimeError(f"no primary serves the slot of {key!r}")


@contextlib.contextmanager
def replicated_cluster(
    primaries: int = 3,
    replicas: int | Sequence[int] = 1,
    *,
    node_timeout_ms: int = 2000,
    extra: Sequence[str] = (),
) -> Iterator[ClusterNodes]:
    """A Redis Cluster of ``primaries`` primaries, each with ``replicas`` replicas in sync
    (a number for all, or one per primary): made for failover tests, where a primary is
    killed and the cluster promotes one of its replicas after ``node_timeout_ms``. A
    primary given two replicas keeps one after such a failover (the other follows the
    promoted node), so writes that wait for a replica go on."""
    counts = [replicas] * primaries if isinstance(replicas, int) else list(replicas)
    if primaries < 1 or len(counts) != primaries or min(counts) < 0:
        raise ValueError(f"need 1+ primaries and a replica count for each, got {counts}")
    with tempfile.TemporaryDirectory(prefix="ledger-rcluster-") as d:
        made = ClusterNodes([], [])
        try:
            for i in range(primaries):
                made.primaries.append(_cluster_node(Path(d) / f"n{i}", node_timeout_ms, *extra))
            clients = [redis.Redis(port=n.port) for n in made.primaries]
            for i, r in enumerate(clients):
                first, last = i * 16384 // primaries, (i + 1) * 16384 // primaries - 1
                r.cluster("set-config-epoch", i + 1)
                r.cluster("addslotsrange", first, last)
            for r in clients[1:]:
                r.cluster("meet", "127.0.0.1", made.primaries[0].port)
            for r in clients:
                r.close()
            ids = []
            for p in made.primaries:
                r = redis.Redis(port=p.port, decode_responses=True)
                ids.append(str(r.execute_command("CLUSTER MYID")))  # type: ignore[no-untyped-call]
                r.close()
            for i, count in enumerate(counts):
                made.replicas.append([])
                for j in range(count):
                    node = _cluster_node(Path(d) / f"r{i}-{j}", node_timeout_ms, *extra)
                    made.replicas[i].append(node)
                    r = redis.Redis(port=node.port)
                    try:
                        r.cluster("meet", "127.0.0.1", made.primaries[0].port)
                        deadline = time.monotonic() + 30
                        while True:  # a replica must know its primary before following it
                            try:
                                r.cluster("replicate", ids[i])
                                break
                            except redis.ResponseError:
                                if time.monotonic() > deadline:
                                    raise
                                time.sleep(0.1)
                    finally:
                        r.close()
            for p, count in zip(made.primaries, counts, strict=True):
                wait_replicas(p, count)
            total = primaries + sum(counts)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                infos = []
                for n in made.nodes():
                    r = redis.Redis(port=n.port, decode_responses=True)
                    infos.append(r.cluster("info"))
                    r.close()
                if all(
                    i.get("cluster_state") == "ok" and int(i.get("cluster_known_nodes", 0)) == total
                    for i in infos
                ):
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError("the cluster did not reach state ok")
            yield made
        finally:
            for n in made.nodes():
                n.stop()


def wait_replicas(primary: RedisProcess, count: int, timeout: float = 30.0) -> None:
    """Until `count` replicas of `primary` are online (in sync)."""
    r = redis.Redis(port=primary.port, decode_responses=True)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = r.info("replication")
            online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            if len([v for v in online if v.get("state") == "online"]) >= count:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{primary.url}: {count} replica(s) did not come online")
    finally:
        r.close()


@contextlib.contextmanager
def replicated() -> Iterator[tuple[RedisProcess, RedisProcess]]:
    """A standalone primary and one replica of it, the replica in sync."""
    with standalone() as primary, tempfile.TemporaryDirectory(prefix="ledger-replica-") as d:
        replica = RedisProcess(
            free_port(), Path(d), ("--replicaof", "127.0.0.1", str(primary.port))
        ).start()
        try:
            wait_replicas(primary, 1)
            yield primary, replica
        finally:
            replica.stop()


@dataclass
class WorkerProc:
    consumer: str
    proc: subprocess.Popen[bytes]
    log: Path

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):  # a line cut by SIGKILL
                    out.append(json.loads(line))
        return out

    def messages(self, msg: str) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("msg") == msg]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def wait_started(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.consumer} exited: {self.tail()}")
            if self.messages("worker started"):
                return
            time.sleep(0.02)
        raise RuntimeError(f"worker {self.consumer} did not start within {timeout}s")

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 20 s; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def spawn_worker(consumer: str, env: Mapping[str, str], log: Path) -> WorkerProc:
    """A worker process with the LEDGER_* settings in env only (none inherited)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    full["LEDGER_WORKER_COMPACTOR"] = "ledger.workers.compactors:simulated"  # env may override
    full.update(env)
    full["LEDGER_WORKER_CONSUMER"] = consumer
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ledger.cli", "worker"],
            cwd=log.parent,
            env=full,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    return WorkerProc(consumer, proc, log)
