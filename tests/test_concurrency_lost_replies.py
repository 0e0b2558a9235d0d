"""Timeouts and lost replies, on a real redis-server (the `redis_server` fixture): a call
that timed out while Redis was paused, a call Redis applied whose reply was lost, a
request that reached Redis only after the client had retried it, and redis-py's own
default retry: each is charged once.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from ledger import (
    Consumer,
    Item,
    Ledger,
    Session,
    SessionBudget,
    Snapshot,
)
from ledger import scripts as ledger_scripts
from tests.conftest import make_settings
from tests.support import servers

pytestmark = [pytest.mark.redis]


class FlakyProxy:
    """A TCP proxy in front of a Redis server. Armed, it meddles with the next EVALSHA:

    drop  forwards the request and loses its reply: Redis applied the call, the client
          times out and cannot know whether it took effect;
    hold  holds the request back for `hold` seconds and forwards it after the client
          has given up on it (and, usually, after its retry was applied).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port: int = self.listener.getsockname()[1]
        self.closing = threading.Event()
        self.lock = threading.Lock()
        self.mode: str | None = None
        self.hold = 0.0
        self.fired = 0
        self.socks: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def arm(self, mode: str, hold: float = 0.0) -> None:
        with self.lock:
            self.mode, self.hold = mode, hold

    def close(self) -> None:
        self.closing.set()
        self.thread.join(5)
        self.listener.close()
        with self.lock:
            for s in self.socks:
                with contextlib.suppress(OSError):
                    s.close()

    def __enter__(self) -> FlakyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self) -> tuple[str | None, float]:
        with self.lock:
            mode, self.mode = self.mode, None
            self.fired += mode is not None
            return mode, self.hold

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            client.settimeout(None)
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            lost = threading.Event()
            with self.lock:
                self.socks += [client, upstream]
            for target, args in (
                (self._requests, (client, upstream, lost)),
                (self._replies, (upstream, client, lost)),
            ):
                threading.Thread(target=target, args=args, daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, lost: Any) -> None:
        try:
            while data := client.recv(65536):
                if b"EVALSHA" in data:
                    mode, hold = self._take()
                    if mode == "drop":
                        lost.set()
                    elif mode == "hold":
                        time.sleep(hold)
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                upstream.shutdown(socket.SHUT_WR)

    def _replies(self, upstream: socket.socket, client: socket.socket, lost: Any) -> None:
        try:
            while data := upstream.recv(65536):
                if not lost.is_set():
                    with contextlib.suppress(OSError):
                        client.sendall(data)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.close()


LOSSY = {"socket_timeout": 0.2, "retry_attempts": 10, "retry_max_seconds": 5}
BUDGET = SessionBudget(window=32_000, system_prompt=2_100, tool_framing=150, output_reserve=1_024)


def evalsha_calls(admin: redis.Redis) -> int:
    """EVALSHA calls Redis has executed (INFO commandstats)."""
    return int(admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def count_sent(client: Any) -> Counter[str]:
    """Count the commands a redis-py client sends (each ledger attempt is one EVALSHA)."""
    sent: Counter[str] = Counter()
    send = client.execute_command

    def counting(*args: Any, **options: Any) -> Any:
        sent[str(args[0]).upper()] += 1
        return send(*args, **options)

    client.execute_command = counting
    return sent


@pytest.fixture
def admin(redis_server: servers.RedisProcess) -> Iterator[redis.Redis]:
    """A plain client straight to the server; the ledger scripts preloaded, so that
    no attempt below is spent on NOSCRIPT."""
    client = redis.Redis(port=redis_server.port)
    for name in ledger_scripts.NAMES:
        client.script_load(ledger_scripts.source(name))
    try:
        yield client
    finally:
        client.client_unpause()
        client.close()


def charged_once(s: Session, consumer: Consumer, tokens: int, items: int = 1) -> Snapshot:
    snap = s.snapshot()
    assert snap.used[consumer] == tokens
    assert snap.items[consumer] == items
    report = s.audit()
    assert report.clean, report.problems
    return snap


def test_timeout_while_redis_is_paused_is_retried_and_charged_once(
    redis_server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """CLIENT PAUSE holds the EVALSHA past the socket timeout. Redis drops a paused
    command whose client disconnected, so here the tries that timed out are never
    applied and the one after the pause is: the ledger keeps retrying the same op id
    until then, and charges it once."""
    with Ledger.from_settings(make_settings(redis_server.url, **LOSSY)) as led:
        s = led.open_session("paused", BUDGET)
        sent = count_sent(led.client)
        before = evalsha_calls(admin)
        admin.client_pause(600, all=False)  # WRITE: every script that may write waits
        t0 = time.monotonic()
        got = s.admit("retrieval", [Item("doc-1", 777)], op_id="paused-admit-1")
        elapsed = time.monotonic() - t0
        assert got.charged == 777 and got.admitted == 1 and got.duplicates == 0
        assert sent["EVALSHA"] >= 2, "the call never timed out: the pause did not hold it"
        assert elapsed >= 0.5
        applied = evalsha_calls(admin) - before
        assert 1 <= applied <= sent["EVALSHA"]
        charged_once(s, Consumer.RETRIEVAL, 777)
        # a late re-send of the same call gets the stored outcome and charges nothing
        assert s.admit("retrieval", [Item("doc-1", 777)], op_id="paused-admit-1") == got
        charged_once(s, Consumer.RETRIEVAL, 777)


def test_a_batch_whose_reply_is_lost_is_charged_once(
    redis_server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """run_many: Redis runs the whole MULTI/EXEC, its reply is lost, the retry sends the
    batch again and every call gets its stored outcome."""
    with (
        FlakyProxy(redis_server.port) as proxy,
        Ledger.from_settings(make_settings(proxy.url, **LOSSY)) as led,
    ):
        s = led.open_session("lost-batch", BUDGET)
        calls = [s.admit_call("retrieval", [Item(f"c{k}", 100)]) for k in range(8)]
        calls.append(s.release_call("retrieval", ["c0"]))
        applied = evalsha_calls(admin)
        proxy.arm("drop")
        got = led.run_many(calls)
        assert proxy.fired == 1
        assert evalsha_calls(admin) - applied >= 2 * len(calls)  # applied, then replayed
        assert [r.charged for r in got[:8]] == [100] * 8  # the first outcomes, replayed
        assert got[8].released == 100
        charged_once(s, Consumer.RETRIEVAL, 700, items=7)


def test_lost_replies_of_applied_calls_are_charged_once(
    redis_server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """Redis applies each call, its reply is lost, the ledger's retry (same op id) gets
    the stored outcome: the result is the first one (a re-evaluation would report a
    duplicate, a missing id, an unknown reservation or a conflict) and nothing moves
    twice."""
    with (
        FlakyProxy(redis_server.port) as proxy,
        Ledger.from_settings(make_settings(proxy.url, **LOSSY)) as led,
    ):
        s = led.open_session("lost", BUDGET)
        sent = count_sent(led.client)

        def lost(call: Callable[[], Any]) -> Any:
            fired, tries, applied = proxy.fired, sent["EVALSHA"], evalsha_calls(admin)
            proxy.arm("drop")
            out = call()
            assert proxy.fired == fired + 1
            assert sent["EVALSHA"] - tries >= 2  # timed out, then retried
            assert evalsha_calls(admin) - applied >= 2  # applied, then replayed
            return out

        got = lost(lambda: s.admit("retrieval", [Item("d1", 700), Item("d2", 300)], op_id="l-1"))
        assert (got.charged, got.admitted, got.duplicates) == (1_000, 2, 0)
        charged_once(s, Consumer.RETRIEVAL, 1_000, items=2)

        rel = lost(lambda: s.release("retrieval", ["d2"], op_id="l-2"))
        assert (rel.released, rel.count, rel.missing) == (300, 1, ())
        charged_once(s, Consumer.RETRIEVAL, 700)

        res = lost(lambda: s.reserve("scratchpad", "tool-1", 2_000, op_id="l-3"))
        assert res.id == "tool-1"
        assert s.snapshot().reserved[Consumer.SCRATCHPAD] == 2_000

        st = lost(lambda: s.settle("tool-1", 2_500, "tool-1-out", op_id="l-4"))
        assert (st.charged, st.item) == (2_500, "tool-1-out")
        snap = charged_once(s, Consumer.SCRATCHPAD, 2_500)
        assert snap.reserved[Consumer.SCRATCHPAD] == 0 and snap.open_reservations == 0

        s.reserve("recall", "tool-2", 1_200, op_id="l-5")
        vd = lost(lambda: s.void("tool-2", op_id="l-6"))
        assert vd.released == 1_200
        snap = s.snapshot()
        assert snap.reserved[Consumer.RECALL] == 0 and snap.open_reservations == 0
        assert snap.free == 32_000 - 2_100 - 150 - 1_024 - 700 - 2_500
        assert s.audit().clean


def test_request_that_arrives_after_its_retry_is_not_applied_again(
    redis_server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """The first try is held in the network until after the client timed out, retried
    (applied) and even released the item: when the stale request finally reaches Redis
    it gets the stored outcome and does not bring the item back."""
    with (
        FlakyProxy(redis_server.port) as proxy,
        Ledger.from_settings(make_settings(proxy.url, **LOSSY)) as led,
    ):
        s = led.open_session("held", BUDGET)
        before = evalsha_calls(admin)
        proxy.arm("hold", hold=1.0)
        got = s.admit("working_memory", [Item("turn-1", 900)], op_id="h-1")
        assert (got.charged, got.admitted) == (900, 1)
        assert proxy.fired == 1
        s.release("working_memory", ["turn-1"], op_id="h-2")
        # wait for the held request to reach Redis: admit retry, release, held admit
        deadline = time.monotonic() + 5
        while evalsha_calls(admin) - before < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert evalsha_calls(admin) - before >= 3, "the held request never reached Redis"
        charged_once(s, Consumer.WORKING_MEMORY, 0, items=0)
        assert s.snapshot().free == 32_000 - 2_100 - 150 - 1_024


def test_redis_py_default_retry_is_harmless(
    redis_server: servers.RedisProcess, admin: redis.Redis
) -> None:
    """A plain redis.Redis with redis-py's default Retry, wrapped in Ledger directly,
    the ledger's own retry off: the driver re-sends the timed-out EVALSHA by itself,
    with the same op id, and the call is charged once."""
    with FlakyProxy(redis_server.port) as proxy:
        client = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=0.2)
        assert client.get_retry() is not None and client.get_retry().get_retries() >= 1
        settings = make_settings(proxy.url, retry_attempts=1)
        with Ledger(client, settings) as led:
            s = led.open_session("driver-retry", BUDGET)
            sent = count_sent(client)
            before = evalsha_calls(admin)
            proxy.arm("drop")
            got = s.admit("recall", [Item("m-1", 1_234)], op_id="d-1")
            assert (got.charged, got.admitted, got.duplicates) == (1_234, 1, 0)
            assert proxy.fired == 1
            assert sent["EVALSHA"] == 1  # one ledger attempt ...
            assert evalsha_calls(admin) - before >= 2  # ... that the driver sent twice
            charged_once(s, Consumer.RECALL, 1_234)
