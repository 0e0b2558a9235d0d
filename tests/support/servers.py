"""Real Redis servers for the tests: the throwaway servers of ``ledger.testing``, and
TLS servers, restarts and slot migration for the fault, security and cluster suites."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from ledger.testing import (
    RedisProcess,
    cluster,
    free_port,
    replicated,
    require_binary,
    standalone,
    wait_replicas,
)

__all__ = [
    "RedisProcess",
    "cluster",
    "free_port",
    "replicated",
    "require_binary",
    "standalone",
    "wait_replicas",
]


# --- added for the fault, security and cluster suites ---------------------------------


def restartable(
    *extra: str, appendfsync: str = "always"
) -> contextlib.AbstractContextManager[RedisProcess]:
    """A standalone server with ``appendonly yes`` that :meth:`RedisProcess.restart`
    kills (-9) and starts again on the same port and directory (so it reloads its AOF)."""
    return standalone("--appendonly", "yes", "--appendfsync", appendfsync, *extra)


def make_self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl CLI); returns (cert, key)."""
    openssl = require_binary("openssl")
    cert, key = directory / "redis.crt", directory / "redis.key"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def tls_supported() -> tuple[bool, str]:
    """Whether this redis-server build speaks TLS, and redis-server's own words.

    A TLS build started with ``--tls-port`` and no certificate complains about the
    certificate; a build without TLS refuses the option itself."""
    with tempfile.TemporaryDirectory(prefix="ledger-tlscheck-") as d:
        try:
            out = subprocess.run(
                [
                    require_binary("redis-server"),
                    "--port",
                    "0",
                    "--tls-port",
                    str(free_port()),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    d,
                    "--save",
                    "",
                ],
                capture_output=True,
                timeout=10,
                text=True,
            )
        except subprocess.TimeoutExpired:  # it started: only a TLS build would
            return True, "redis-server started with --tls-port"
    text = (out.stdout + out.stderr).strip()
    return "tls-cert-file" in text, text[-500:]


@dataclass
class TlsRedisProcess(RedisProcess):
    """A redis-server listening on TLS only (``--port 0``)."""

    cert: Path = Path()
    key: Path = Path()

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def listen_args(self) -> list[str]:
        return [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(self.cert),
            "--tls-key-file",
            str(self.key),
            "--tls-ca-cert-file",
            str(self.cert),
            "--tls-auth-clients",
            "no",
        ]

    def client(self) -> redis.Redis:
        return redis.Redis(
            port=self.port,
            ssl=True,
            ssl_cert_reqs="none",
            ssl_check_hostname=False,
            socket_timeout=1,
        )


@contextlib.contextmanager
def tls_standalone(*extra: str) -> Iterator[TlsRedisProcess]:
    """A TLS-only redis-server with a fresh self-signed certificate for 127.0.0.1."""
    with tempfile.TemporaryDirectory(prefix="ledger-tls-") as d:
        cert, key = make_self_signed_cert(Path(d))
        server = TlsRedisProcess(free_port(), Path(d), extra, cert=cert, key=key)
        server.start()
        try:
            yield server
        finally:
            server.stop()


def cluster_slot_owners(port: int) -> dict[int, str]:
    """slot -> 'host:port' of its primary, from CLUSTER SLOTS on the node at `port`."""
    r = redis.Redis(port=port, decode_responses=True)
    try:
        rows = r.execute_command("CLUSTER SLOTS")
    finally:
        r.close()
    owners: dict[int, str] = {}
    for row in rows:
        lo, hi, primary = int(row[0]), int(row[1]), row[2]
        for s in range(lo, hi + 1):
            owners[s] = f"{primary[0]}:{primary[1]}"
    return owners


def cluster_node_id(port: int) -> str:
    r = redis.Redis(port=port, decode_responses=True)
    try:
        return str(r.execute_command("CLUSTER MYID"))
    finally:
        r.close()


def migrate_slot(
    slot: int,
    source: RedisProcess,
    target: RedisProcess,
    others: Sequence[RedisProcess] = (),
    *,
    batch: int = 10,
    pause: float = 0.0,
    timeout_ms: int = 5000,
    on_batch: object = None,
) -> int:
    """Move one slot from `source` to `target` with the standard resharding steps:
    SETSLOT IMPORTING on the target, SETSLOT MIGRATING on the source, MIGRATE ...
    KEYS in batches (GETKEYSINSLOT), then SETSLOT NODE on the target, the source and
    every other primary. Returns the number of keys moved. `pause` seconds between
    batches widen the window in which the slot's keys are split across two nodes."""
    src = redis.Redis(port=source.port, decode_responses=True)
    dst = redis.Redis(port=target.port, decode_responses=True)
    try:
        src_id, dst_id = cluster_node_id(source.port), cluster_node_id(target.port)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        for _ in range(100_000):  # bounded: a slot never holds that many of our keys
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            src.execute_command(
                "MIGRATE", "127.0.0.1", target.port, "", 0, timeout_ms, "KEYS", *keys
            )
            moved += len(keys)
            if callable(on_batch):
                on_batch(keys)
            if pause:
                time.sleep(pause)
        for node in (target, source, *others):
            r = redis.Redis(port=node.port, decode_responses=True)
            try:
                r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
            finally:
                r.close()
        return moved
    finally:
        src.close()
        dst.close()


# --- replicas, for the durability suite ---------------------------------------------------


@contextlib.contextmanager
def cluster_with_replicas(
    primaries: int = 3,
) -> Iterator[tuple[list[RedisProcess], list[RedisProcess]]]:
    """A cluster of `primaries` primaries, each with one replica in sync: (primaries,
    replicas), replicas[i] the replica of primaries[i]."""
    with cluster(primaries) as nodes, tempfile.TemporaryDirectory(prefix="ledger-creplica-") as d:
        replicas: list[RedisProcess] = []
        try:
            for i, primary in enumerate(nodes):
                nd = Path(d) / f"r{i}"
                nd.mkdir()
                replica = RedisProcess(
                    free_port(bus=True),
                    nd,
                    (
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", str(nd / "nodes.conf"),
                        "--cluster-node-timeout", "2000",
                    ),
                ).start()  # fmt: skip
                replicas.append(replica)
                r = redis.Redis(port=replica.port)
                try:
                    r.cluster("meet", "127.0.0.1", nodes[0].port)
                    want = cluster_node_id(primary.port)
                    deadline = time.monotonic() + 30
                    while True:  # the replica must know its primary before it follows it
                        try:
                            r.execute_command("CLUSTER", "REPLICATE", want)
                            break
                        except redis.ResponseError:
                            if time.monotonic() > deadline:
                                raise
                            time.sleep(0.1)
                finally:
                    r.close()
            for primary in nodes:
                wait_replicas(primary, 1)
            yield nodes, replicas
        finally:
            for replica in replicas:
                replica.stop()
