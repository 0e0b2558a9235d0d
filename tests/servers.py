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

    def start(self) -> RedisProcess:
        args = [
            require_binary("redis-server"),
            "--port",
            str(self.port),
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
                log = (
                    (self.dir / "redis.log").read_text()
                    if (self.dir / "redis.log").exists()
                    else ""
                )
                raise RuntimeError(f"redis-server on {self.port} exited: {log[-2000:]}")
            with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError):
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on {self.port} did not answer within {timeout}s")

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
