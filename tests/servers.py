"""Real Redis servers for the tests: started on free ports, stopped afterwards.

Nothing here touches the machine's shared Redis on 6379: every server is our
own child process with its own port and a temporary directory.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
    """A Redis Cluster of `primaries` primaries made by `redis-cli --cluster create`."""
    cli = require_binary("redis-cli")
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
            addrs = [f"127.0.0.1:{n.port}" for n in nodes]
            subprocess.run(
                [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=60,
            )
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                infos = [redis.Redis(port=n.port).cluster("info") for n in nodes]
                if all(i.get("cluster_state") == "ok" for i in infos):
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError("cluster did not reach state ok")
            yield nodes
        finally:
            for n in nodes:
                n.stop()


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
