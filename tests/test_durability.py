"""Durable writes (``replica_acks``): a call returns once its write is on the replicas, or
raises NotReplicated; without the setting an acknowledged write may exist only on the
primary, which a failover loses. Real primaries and replicas, standalone and Cluster."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from ledger import (
    AsyncLedger,
    ConfigurationError,
    Consumer,
    Item,
    Ledger,
    LedgerError,
    LedgerSettings,
    NotReplicated,
    SessionBudget,
)
from ledger.testing import replicated_cluster
from tests.support import servers

WM = Consumer.WORKING_MEMORY
BUDGET = SessionBudget(window=10_000, system_prompt=100)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[servers.RedisProcess, servers.RedisProcess]]:
    with servers.replicated() as both:
        yield both


@contextlib.contextmanager
def stopped(server: servers.RedisProcess) -> Iterator[None]:
    """The server frozen (SIGSTOP): it holds its connections but reads nothing."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def settings(url: str, **kw: object) -> LedgerSettings:
    return LedgerSettings(redis_url=url, prefix=f"d{uuid.uuid4().hex[:10]}", **kw)  # type: ignore[arg-type]


def on_replica(
    replica: servers.RedisProcess, key: str, field: str, cluster: bool = False
) -> bytes | None:
    r = redis.Redis(port=replica.port)
    try:
        if cluster:
            r.execute_command("READONLY")  # a cluster replica serves reads only so
        return r.hget(key, field)  # type: ignore[return-value]
    finally:
        r.close()


@pytest.mark.redis
def test_an_acknowledged_write_is_on_the_replica(
    pair: tuple[servers.RedisProcess, servers.RedisProcess],
) -> None:
    primary, replica = pair
    with Ledger.from_settings(settings(primary.url, replica_acks=1)) as led:
        s = led.open_session("s-1", BUDGET)
        s.admit(WM, [Item("m0", 10)])
        # read at once, with no wait: WAIT returned only once the replica held it
        assert on_replica(replica, s.keys.session, "i:w:m0") is not None
        [done] = led.run_many([s.admit_call(WM, [Item("m1", 10)])])
        assert done.charged == 10
        assert on_replica(replica, s.keys.session, "i:w:m1") is not None


@pytest.mark.redis
def test_a_write_the_replica_did_not_get_is_not_acknowledged_and_a_retry_waits_again(
    pair: tuple[servers.RedisProcess, servers.RedisProcess],
) -> None:
    primary, replica = pair
    durable = settings(primary.url, replica_acks=1, replica_ack_timeout_ms=1_000)
    with Ledger.from_settings(durable) as led:
        s = led.open_session("s-2", BUDGET)
        call = s.admit_call(WM, [Item("durable", 10)])
        with stopped(replica):
            with pytest.raises(NotReplicated) as info:
                led.run(call)
            assert (info.value.acked, info.value.wanted) == (0, 1)
            with pytest.raises(NotReplicated):
                led.run_many([s.admit_call(WM, [Item("batch", 10)])])
        # the replica is back: the same call again is answered from its stored outcome
        # and waits again; charged once
        assert led.run(call).charged == 10
        assert on_replica(replica, s.keys.session, "i:w:durable") is not None
        assert s.snapshot().used[WM] == 20 and s.audit().clean


@pytest.mark.redis
def test_a_failover_loses_what_only_the_primary_held() -> None:
    """Without replica_acks an acknowledged write can be lost by a failover (the
    replication window); with it, the write that did not reach the replica was never
    acknowledged."""
    with servers.replicated() as (primary, replica):
        durable = settings(primary.url, replica_acks=1, replica_ack_timeout_ms=1_000)
        plain = durable.model_copy(update={"replica_acks": 0})
        with Ledger.from_settings(durable) as led, Ledger.from_settings(plain) as fast:
            s = led.open_session("s-f", BUDGET)
            s.admit(WM, [Item("before", 10)])
            f = fast.session("s-f")
            # the replica cut off from its primary (as by a partition, or a lag the
            # failover does not wait for); it is then promoted
            promoted = redis.Redis(port=replica.port)
            promoted.execute_command("REPLICAOF", "NO", "ONE")
            assert f.admit(WM, [Item("plain", 10)]).charged == 10  # acknowledged
            with pytest.raises(NotReplicated):
                s.admit(WM, [Item("durable", 10)])  # not acknowledged
            primary.kill()  # -9: the writes only it held are gone
        try:
            held = promoted.hgetall(s.keys.session)
        finally:
            promoted.close()
        assert b"i:w:before" in held
        assert b"i:w:plain" not in held  # acknowledged, then lost in the failover
        assert b"i:w:durable" not in held  # lost too, but the caller was told


@pytest.mark.redis
async def test_the_async_face_waits_too(
    pair: tuple[servers.RedisProcess, servers.RedisProcess],
) -> None:
    primary, replica = pair
    async with AsyncLedger.from_settings(
        settings(primary.url, replica_acks=1, replica_ack_timeout_ms=1_000)
    ) as led:
        s = await led.open_session("s-3", BUDGET)
        await s.admit(WM, [Item("m0", 10)])
        assert on_replica(replica, s.keys.session, "i:w:m0") is not None
        with stopped(replica), pytest.raises(NotReplicated):
            await s.admit(WM, [Item("m1", 10)])


@pytest.mark.embedded
def test_the_embedded_backend_refuses_replica_acks() -> None:
    with pytest.raises(ConfigurationError, match="replica"):
        Ledger.from_settings(settings(f"embedded://{uuid.uuid4().hex}", replica_acks=1))


@pytest.mark.cluster
@pytest.mark.slow
async def test_on_a_cluster_each_write_waits_for_its_slots_replica() -> None:
    with servers.cluster_with_replicas(3) as (primaries, replicas):
        url = f"redis+cluster://127.0.0.1:{primaries[0].port}"
        # healthy replicas get time to answer under a loaded machine; the frozen one is
        # waited for briefly (a second ledger with a short timeout)
        durable = settings(url, replica_acks=1, replica_ack_timeout_ms=5_000)
        brief = durable.model_copy(update={"replica_ack_timeout_ms": 200})
        owners = {p.port: r for p, r in zip(primaries, replicas, strict=True)}
        with Ledger.from_settings(durable) as led, Ledger.from_settings(brief) as quick:
            sessions = [led.open_session(f"c-{i}", BUDGET) for i in range(12)]
            by_node: dict[int, list[object]] = {}
            for s in sessions:
                s.admit(WM, [Item("m0", 10)])
                node = led.client.get_node_from_key(s.keys.session)  # type: ignore[union-attr]
                replica = owners[int(node.port)]
                assert on_replica(replica, s.keys.session, "i:w:m0", cluster=True) is not None
                by_node.setdefault(int(node.port), []).append(s)
            assert len(by_node) >= 2
            # one primary's replica frozen: its sessions' writes are not acknowledged,
            # the other primaries' are
            frozen_port, *others = sorted(by_node)
            with stopped(owners[frozen_port]):
                for s in by_node[frozen_port]:
                    q = quick.session(s.keys.session_id)  # type: ignore[attr-defined]
                    with pytest.raises(NotReplicated):
                        q.admit(WM, [Item("m1", 10)])
                for port in others:
                    for s in by_node[port]:
                        s.admit(WM, [Item("m1", 10)])  # type: ignore[attr-defined]
        async with AsyncLedger.from_settings(durable) as aled:
            a = await aled.session("c-0")
            await a.admit(WM, [Item("m2", 10)])


@pytest.mark.cluster
@pytest.mark.slow
def test_durable_writes_follow_a_cluster_failover(capsys: pytest.CaptureFixture[str]) -> None:
    """replica_acks=1 on a 3-primary Cluster, a primary killed (-9) under load: once the
    cluster has promoted its replica, the writes to its slots go to the promoted node
    (they used to keep going to the dead one, refused, until something else read the
    slot map again), and every acknowledged write is on the promoted node."""
    # the victim has two replicas: the one not promoted follows the promoted node, so
    # a write there can still be held by a replica. It is not the node the URL names
    # (a client made after the kill reads the slot map from that one).
    with replicated_cluster(3, (1, 2, 1)) as c:
        durable = settings(c.url, replica_acks=1, replica_ack_timeout_ms=3_000)
        victim = c.primaries[1]
        sids: list[str] = []
        key = ""  # a session key of the victim's slots
        with Ledger.from_settings(durable) as led:
            for i in range(300):
                s = led.open_session(f"fo-{i}", BUDGET.model_copy(update={"window": 10**7}))
                if c.primary_port(s.keys.session) == victim.port:
                    sids.append(s.id)
                    key = s.keys.session
                if len(sids) == 3:
                    break
        assert len(sids) == 3
        stop = threading.Event()
        acked: dict[str, list[tuple[float, str]]] = {sid: [] for sid in sids}

        def write(sid: str) -> None:
            with Ledger.from_settings(durable) as mine:
                s = mine.session(sid)
                n = 0
                while not stop.is_set():
                    n += 1
                    with contextlib.suppress(LedgerError):  # refused while none serves
                        s.admit(WM, [Item(f"{sid}-{n}", 1)])
                        acked[sid].append((time.monotonic(), f"{sid}-{n}"))

        threads = [threading.Thread(target=write, args=(sid,)) for sid in sids]
        for t in threads:
            t.start()
        try:
            time.sleep(1.0)
            assert all(acked.values()), "every writer acknowledged writes before the kill"
            killed = time.monotonic()
            victim.kill()
            promoted = c.replicas[1]
            deadline = killed + 60
            while time.monotonic() < deadline:  # until a live node names a new primary
                port = c.primary_port(key, via=promoted[0])
                if port != victim.port:
                    break
                time.sleep(0.05)
            else:
                pytest.fail("the cluster promoted no replica within 60 s")
            failover = time.monotonic()
            time.sleep(max(3.0, 2 * (failover - killed)))
        finally:
            stop.set()
            stopped = time.monotonic()
            for t in threads:
                t.join(30)
        after = {sid: [t for t, _ in acked[sid] if t > failover] for sid in sids}
        with capsys.disabled():
            print(
                f"\nfailover: promoted {failover - killed:.1f} s after the kill; first write "
                "acknowledged after it: "
                + ", ".join(f"{a[0] - failover:.2f} s" for a in after.values() if a)
                + f"; acknowledged in the {stopped - failover:.1f} s after it: "
                + ", ".join(str(len(a)) for a in after.values())
                + "; before the kill: "
                + ", ".join(str(sum(t <= killed for t, _ in acked[sid])) for sid in sids)
            )
        for sid in sids:
            # writes resumed soon after the promotion (within the failover's own time,
            # or 5 s on a loaded machine), and kept going
            assert after[sid], f"{sid}: no write acknowledged after the failover"
            assert after[sid][0] - failover < max(5.0, failover - killed), (sid, after[sid][0])
            assert len(after[sid]) >= 5
        plain = durable.model_copy(update={"replica_acks": 0})
        with Ledger.from_settings(plain) as led:
            for sid in sids:
                held = {h.id for h in led.items(sid)}
                lost = [i for _, i in acked[sid] if i not in held]
                assert lost == [], f"{sid}: acknowledged and lost: {lost[:5]}"
            assert all(led.session(sid).audit().clean for sid in sids)
