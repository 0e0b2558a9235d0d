"""Smoke test of bench/bench_full.py (and the correctness of bench/alternatives.py).

No speed assertions: the numbers only have to exist and be positive, every row must
have run without errors and left consistent state behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import redis

from bench import alternatives as alt
from tests.support import servers

ROOT = Path(__file__).resolve().parents[1]

ROW_NUMBERS = ("ops", "seconds", "ops_per_s", "p50_ms", "p99_ms", "cpu_us_per_op", "vs_floor")
LEDGER_ROW_OPS = {"admit_1", "admit_raw", "admit_16", "begin_turn", "release", "reserve_settle"}


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x > 0


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(600)
def test_bench_full_quick_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_full", "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout)

    env = res["env"]
    assert isinstance(env["redis_version"], str) and env["redis_version"]
    assert _positive(env["nproc"]) and env["cpu_model"]
    assert res["git"]
    assert res["params"]["quick"] is True

    rows = res["rows"]
    modes = {r["mode"] for r in rows}
    assert modes == {"sync", "asyncio", "pipelined"}
    ops = {(r["mode"], r["op"]) for r in rows}
    for mode in ("sync", "asyncio"):
        for op in ("floor", "watch", "lock", *LEDGER_ROW_OPS):
            assert (mode, op) in ops, (mode, op)
    for op in ("floor", "admit_1", "admit_16"):
        assert ("pipelined", op) in ops, op
    assert {r["procs"] for r in rows} == set(res["params"]["procs"])
    assert {r["layout"] for r in rows} == {"shared", "spread"}

    for r in rows:
        name = (r["mode"], r["op"], r["procs"], r["layout"])
        for metric in ROW_NUMBERS:
            assert _positive(r[metric]), (name, metric, r[metric])
        assert r["errors"] == 0, (name, r["first_error"])
        assert r["check"] == [], (name, r["check"])
        srv = r["server"]
        assert _positive(srv["usec_per_call"]), name
        assert _positive(srv["usec_per_op"]), name
        assert _positive(srv["commands_per_op"]), name
        if r["op"] in LEDGER_ROW_OPS:
            assert r["static_redis_call"]["_common.lua"] > 0, name
            assert srv["evalsha_calls"] >= r["ops"] // max(1, r["batch"]), name
        if r["op"] in ("watch", "lock"):
            assert srv["commands_per_op"] >= 4, name  # at least WATCH/SET, HMGET, MULTI, EXEC
        if r["op"] != "floor":
            for a in ("watch", "lock"):
                assert _positive(r[f"vs_{a}"]), (name, a)

    for name, v in res["calibration"].items():
        assert _positive(v["usec_per_call"]), name

    mem = res["memory"]["rows"]
    assert "fresh" in mem
    for name, v in mem.items():
        assert _positive(v["bytes"]), name
        assert _positive(v["fields"]), name
    assert _positive(res["memory"]["what_if_fresh_small_fields"]["bytes"])

    targets = res["targets"]
    assert len(targets) >= 8
    for t in targets:
        assert t["verdict"] in ("PASS", "MISS"), t
        assert _positive(t["measured"]) and _positive(t["ratio"]), t


# --- the alternatives are correct: concurrent admissions never exceed the window -------


def _hammer(url: str, impl_name: str, key: str, workers: int, per: int) -> dict[str, int]:
    statuses: dict[str, int] = {}
    lock = threading.Lock()

    def run(w: int) -> None:
        r = redis.Redis.from_url(url)
        impl = alt.WatchAdmit(r) if impl_name == "watch" else alt.LockAdmit(r)
        for k in range(per):
            res = impl.admit(key, f"w{w}.{k % (per // 2)}", 3)  # every id twice: duplicates
            with lock:
                statuses[res.status] = statuses.get(res.status, 0) + 1
        r.close()

    threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return statuses


@pytest.mark.redis
@pytest.mark.parametrize("impl_name", ["watch", "lock"])
def test_alternative_is_correct_under_contention(
    redis_server: servers.RedisProcess, impl_name: str
) -> None:
    server = redis_server
    r = redis.Redis.from_url(server.url)
    key = f"alt{uuid.uuid4().hex[:8]}"
    window = 100  # 33 items of 3 tokens fit, 1 token is left over
    assert alt.open_session(r, key, window)
    assert not alt.open_session(r, key, window)  # opening again changes nothing
    statuses = _hammer(server.url, impl_name, key, workers=6, per=20)

    assert alt.check(r, key) == []
    text = redis.Redis.from_url(server.url, decode_responses=True)
    fields = {str(k): int(v) for k, v in text.hgetall(key).items()}
    text.close()
    items = {k: v for k, v in fields.items() if k.startswith("i:")}
    assert fields["used"] == 3 * len(items) == 99
    assert statuses["ok"] == 33
    assert sum(statuses.values()) == 6 * 20
    assert statuses.get("refused", 0) > 0 and statuses.get("duplicate", 0) > 0

    res = (alt.WatchAdmit(r) if impl_name == "watch" else alt.LockAdmit(r)).admit(key, "x", 2)
    assert (res.status, res.charged, res.free) == ("refused", 0, 1)
    with pytest.raises(alt.NoSession):
        alt.WatchAdmit(r).admit(f"{key}:missing", "x", 1)
    r.close()
