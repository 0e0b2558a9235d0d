"""A small TCP proxy for fault tests: forwards 127.0.0.1:<port> to a Redis server and,
on demand, cuts connections after a request was forwarded but before its reply, or
delays replies.

Threads, no asyncio: one accept thread, and per connection one thread per direction.
Faults act on the server -> client direction only, so a request always reaches
Redis and is applied there: exactly the case in which a client cannot know whether
its call took effect, and must retry with the same operation id.

    with TcpProxy(redis_port, drop_reply_rate=0.1, delay=0.3, delay_rate=0.05) as p:
        url = p.url   # redis://127.0.0.1:<p.port>/0
        ...
    p.stats           # connections, replies forwarded, dropped, delayed

Every fault decision comes from a seeded RNG; `faults_enabled` switches faults off
(e.g. to let clients settle uncertain calls through the same proxy).
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from dataclasses import dataclass


@dataclass
class ProxyStats:
    connections: int = 0
    requests: int = 0  # client -> server chunks forwarded
    replies: int = 0  # server -> client chunks forwarded
    dropped: int = 0  # connections cut instead of forwarding a reply
    delayed: int = 0  # replies held back by `delay` seconds


class TcpProxy:
    def __init__(
        self,
        target_port: int,
        *,
        drop_reply_rate: float = 0.0,
        delay: float = 0.0,
        delay_rate: float = 0.0,
        seed: int = 0,
        max_connections: int = 10_000,
    ) -> None:
        self.target = ("127.0.0.1", target_port)
        self.drop_reply_rate = drop_reply_rate
        self.delay = delay
        self.delay_rate = delay_rate
        self.faults_enabled = True
        self.max_connections = max_connections
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> TcpProxy:
        t = threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            self._shut(s)
        for t in list(self._threads):
            t.join(timeout=5)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cut_all(self) -> int:
        """Close every open connection now; returns how many pairs were cut."""
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            self._shut(s)
        return len(socks) // 2

    # --- internals -----------------------------------------------------------------------

    def _decide(self) -> str:
        if not self.faults_enabled:
            return "forward"
        with self._lock:
            x = self._rng.random()
        if x < self.drop_reply_rate:
            return "drop"
        if x < self.drop_reply_rate + self.delay_rate:
            return "delay"
        return "forward"

    @staticmethod
    def _shut(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.stats.connections >= self.max_connections:
                self._shut(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                self._shut(client)
                continue
            for s in (client, upstream):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.stats.connections += 1
                self._socks.update((client, upstream))
            pair = (client, upstream)
            for name, fn in (("up", self._pump_up), ("down", self._pump_down)):
                t = threading.Thread(target=fn, args=pair, name=f"proxy-{name}", daemon=True)
                t.start()
                with self._lock:
                    self._threads = [x for x in self._threads if x.is_alive()]
                    self._threads.append(t)

    def _drop_pair(self, client: socket.socket, upstream: socket.socket) -> None:
        with self._lock:
            self._socks.discard(client)
            self._socks.discard(upstream)
        self._shut(client)
        self._shut(upstream)

    def _pump_up(self, client: socket.socket, upstream: socket.socket) -> None:
        """client -> Redis: always forwarded at once."""
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                upstream.sendall(data)
                with self._lock:
                    self.stats.requests += 1
        except OSError:
            pass
        self._drop_pair(client, upstream)

    def _pump_down(self, client: socket.socket, upstream: socket.socket) -> None:
        """Redis -> client: forwarded, delayed, or the connection cut instead."""
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                action = self._decide()
                if action == "drop":
                    with self._lock:
                        self.stats.dropped += 1
                    break
                if action == "delay":
                    with self._lock:
                        self.stats.delayed += 1
                    if self._closing.wait(self.delay):
                        break
                client.sendall(data)
                with self._lock:
                    self.stats.replies += 1
        except OSError:
            pass
        self._drop_pair(client, upstream)


def wait_until(predicate: object, timeout: float, interval: float = 0.02) -> bool:
    """Poll `predicate()` until true or `timeout` seconds passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return True
        time.sleep(interval)
    return False
