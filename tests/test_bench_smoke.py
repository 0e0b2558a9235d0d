"""Smoke test of bench/bench_core.py: it runs end to end and reports every phase.

No speed assertions: the numbers only have to exist and be positive.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SERVER_PHASES = {
    "return1",
    "prelude_return1",
    "admit_commands",
    "return1_warm",
    "admit_commands_warm",
    "admit_1_warm",
    "admit_1",
    "admit_16",
    "release_1",
    "reserve",
    "settle",
    "snapshot",
}
CLIENT_LOOPS = {"bare_evalsha", "ledger_admit", "raw_admit"}


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x > 0


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_bench_core_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_core", "--n", "50", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout)

    env = res["env"]
    assert isinstance(env["redis_version"], str) and env["redis_version"]
    assert _positive(env["nproc"])
    assert res["params"]["n"] == 50

    static = res["static_redis_call"]
    assert {"_common.lua", "admit.lua", "release.lua", "reserve.lua", "settle.lua"} <= set(static)
    assert all(isinstance(c, int) and c >= 0 for c in static.values())

    server = res["server"]
    assert set(server) == SERVER_PHASES
    for name, v in server.items():
        assert _positive(v["usec_per_call"]), name
        assert _positive(v["ratio_to_return1"]), name
        assert len(v["usec_per_call_reps"]) == res["params"]["reps"], name
        assert all(_positive(x) for x in v["usec_per_call_reps"]), name
        assert v["warnings"] == [], (name, v["warnings"])
        if name not in ("return1", "prelude_return1", "return1_warm"):
            assert v["inner_calls_per_call"], name  # every ledger script calls Redis

    client = res["client"]
    assert set(client) == CLIENT_LOOPS
    for name, v in client.items():
        for metric in ("ops_per_s", "wall_us_per_op", "cpu_us_per_op", "server_us_per_op"):
            assert _positive(v[metric]), (name, metric)
        assert _positive(v["slowdown_vs_bare"]), name

    for name, v in res["client_cpu_parts"].items():
        assert _positive(v["cpu_us_per_op"]), name

    memory = res["memory"]
    assert set(memory) == {"fresh", "after_40_turns"}
    for name, v in memory.items():
        assert _positive(v["bytes"]), name
        assert _positive(v["fields"]), name
    assert memory["after_40_turns"]["fields"] > memory["fresh"]["fields"]


@pytest.mark.slow
@pytest.mark.redis
def test_lua_costs_measures_every_piece() -> None:
    import redis

    from bench import lua_costs
    from tests.support.servers import standalone

    with standalone() as srv:
        costs = lua_costs.measure(redis.Redis.from_url(srv.url), n=200, reps=1)
    assert set(costs) == {*lua_costs.PIECES[1:], "empty loop"}
    assert all(isinstance(v, float) for v in costs.values())
    assert costs["empty loop"] > 0


@pytest.mark.slow
@pytest.mark.redis
def test_admit_steps_stops_admit_at_every_step() -> None:
    """Each variant stops admit at its command (before or after the first call of it),
    whatever the script's text; the measurement covers every variant."""
    import redis

    from bench import admit_steps
    from bench.bench_core import BENCH_BUDGET
    from ledger import Item, Ledger, LedgerSettings
    from tests.support.servers import standalone

    v = admit_steps.variants()
    assert len(v) == 4 + len(admit_steps.STEPS)
    with standalone() as srv:
        r = redis.Redis.from_url(srv.url)
        with Ledger.from_settings(LedgerSettings(redis_url=srv.url, prefix="steps")) as led:
            s = led.open_session("s", BENCH_BUDGET)
            for k, (name, when, cmd) in enumerate(admit_steps.STEPS):
                c = s.admit_call("retrieval", [Item(f"i{k}", 1)])
                r.config_resetstat()
                assert r.eval(v[name], len(c.keys), *c.keys, *c.args) == 1, name
                calls = {k[8:]: int(x["calls"]) for k, x in r.info("commandstats").items()}
                assert calls.get(cmd.lower(), 0) == (0 if when == "before" else 1), (name, calls)
                assert "hset" not in calls, (name, calls)  # stopped before any write
            assert not [f for f in r.hkeys(s.keys.session) if f.startswith(b"i:")]  # none admitted
            c = s.admit_call("retrieval", [Item("bad", 1)])
            with pytest.raises(redis.ResponseError, match="never came"):
                r.eval(admit_steps.stopped("before", "GEOADD"), len(c.keys), *c.keys, *c.args)
        per = admit_steps.measure(srv.url, calls=20, rounds=1)
    assert set(per) == set(v)
    assert all(len(x) == 1 and x[0] > 0 for x in per.values())


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_bench_cluster_spreads_the_calls(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import bench_cluster

    bench_cluster.main(["--sessions", "40", "--turns", "2", "--threads", "2", "--json"])
    res = json.loads(capsys.readouterr().out)
    by_n = {r["primaries"]: r for r in res["results"]}
    assert set(by_n) == {1, 2, 3}
    assert by_n[1]["capacity"] == pytest.approx(1.0)
    for n, r in by_n.items():
        nodes = r["nodes"]
        assert len(nodes) == n
        assert r["ops"] == 40 * (1 + 3 * 2) == sum(p["ledger_calls"] for p in nodes)
        assert sum(p["share"] for p in nodes) == pytest.approx(1.0)
        assert sum(p["session_share"] for p in nodes) == pytest.approx(1.0)
        assert sorted(q for p in nodes for q in p["partitions"]) == list(range(r["partitions"]))
        assert all(p["usec_per_call"] > 0 and p["all_calls"] >= p["ledger_calls"] for p in nodes)
        assert r["capacity"] > 0 and 0 < r["balance_capacity"] <= n + 1e-9
    assert all(p["ledger_calls"] > 0 for p in by_n[3]["nodes"])
    assert res["median"]["3"]["capacity"] == by_n[3]["capacity"]


@pytest.mark.slow
@pytest.mark.redis
def test_bench_durability_measures_both_sides(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import bench_durability

    report = bench_durability.main(["--calls", "20", "--rounds", "1", "--json"])
    assert json.loads(capsys.readouterr().out) == report
    plain, acked = report["plain"], report["replica_acks_1"]
    assert isinstance(plain, dict) and isinstance(acked, dict)
    assert plain["waits"] == 0 and acked["waits"] == 20  # one WAIT per write
    assert acked["wall_us"] > 0 and plain["wall_us"] > 0


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_bench_turn_prints_every_figure_beside_its_reference() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.bench_turn",
            *["--rounds", "2", "--calls", "20"],
            *["--outcomes", "3000", "--items", "300", "--held", "retrieval"],
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = proc.stdout.splitlines()[1:]
    assert len(rows) == 10, proc.stdout
    for line in rows:
        numbers = [float(x) for x in line[44:].split()[:2]]
        assert all(n > 0 for n in numbers), line
    assert "admit at 3,000 outcomes vs 1,000" in proc.stdout
    assert "retrieval held" in proc.stdout and "without the reclaim-order index" in proc.stdout


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("module", "args", "count", "unit"),
    [
        ("bench.bench_turn", ["--rounds", "2", "--procs", "2", "--seconds", "0.5",
                              "--contend-rounds", "1"], 20, "us"),
        # (no `ends` row: its child meters the ends in time)
        ("bench.turn_instructions", ["--rounds", "1", "--warmup", "0"], 15, "kinstr"),
    ],
    ids=["time", "instructions"],
)  # fmt: skip
def test_bench_turn_against_the_previous_head_prints_every_figure(
    module: str, args: list[str], count: int, unit: str
) -> None:
    """`--against a8b2daf`: this tree's turn beside protocol 2's, each client in its own
    process on its own tree, and beside the careful reference turn's three forms: in
    server time with the contention rows, or in instructions under callgrind."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--against", "a8b2daf", "--calls", "20", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in proc.stdout.splitlines()[2:] if not r.startswith("tokenizer")]
    assert len(rows) == count, proc.stdout
    for line in rows:
        numbers = [float(x.replace(",", "")) for x in line[44:].split()[:2]]
        assert all(n > 0 for n in numbers), line
    trips = next(r for r in rows if r.startswith("round trips per turn"))
    new, old = (float(x) for x in trips[44:].split()[:2])
    assert (new, old) == (2.0, 3.0), trips
    assert any(r.startswith(f"turn server {unit} vs the floor") for r in rows), rows
    assert any(r.startswith("  the careful two-call turn vs the floor") for r in rows), rows


@pytest.mark.redis
def test_the_reference_admit_keeps_its_promises(redis_server: object) -> None:
    """bench/admit_reference.lua is a fair reference only if it is careful: bad input
    is refused before any write, a retry gets the first reply and is not applied again,
    another call under the same op id is refused, an item that does not fit writes
    nothing."""
    import redis

    from ledger import Ledger, LedgerSettings, SessionBudget

    url = redis_server.url  # type: ignore[attr-defined]
    r = redis.Redis.from_url(url)
    ref = r.register_script((ROOT / "bench" / "admit_reference.lua").read_text())
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix="refadmit")) as led:
        s = led.open_session("s", SessionBudget(window=10_000, system_prompt=100))
        key = s.keys.session
        op = key.rsplit(":s:", 1)[0] + ":op:s:"

        def call(op_id: str, item: str, tokens: object) -> bytes:
            args = [op_id, s.epoch, "r", item, tokens, 0, 60_000]
            return ref(keys=[key, op + op_id], args=args)  # type: ignore[no-any-return]

        before = r.hgetall(key)
        for bad in ("0", "-5", "x", "05"):
            with pytest.raises(redis.ResponseError, match="BADARG"):
                call("op-bad", "a", bad)
        assert r.hgetall(key) == before and not r.exists(op + "op-bad")
        first = call("op-1", "a", 500)
        assert first.startswith(b"status=ok|charged=500")
        assert call("op-1", "a", 500) == first and s.snapshot().free == 10_000 - 100 - 500
        with pytest.raises(redis.ResponseError, match="OPREUSED"):
            call("op-1", "b", 500)
        assert call("op-2", "big", 50_000).startswith(b"status=refused")
        assert not r.hexists(key, "i:r:big")


@pytest.mark.redis
def test_the_reference_turn_keeps_its_promises(redis_server: object) -> None:
    """bench/turn_reference.lua is a fair reference only if it is careful: bad input is
    refused before any write, a retry gets the first reply and is not applied again,
    another call under the same op id is refused, a start that does not fit writes
    nothing, another owner's running lease refuses a start, and a finish by another owner
    or of another turn is refused."""
    import redis

    from ledger import Ledger, LedgerSettings, SessionBudget

    url = redis_server.url  # type: ignore[attr-defined]
    r = redis.Redis.from_url(url)
    ref = r.register_script((ROOT / "bench" / "turn_reference.lua").read_text())
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix="refturn")) as led:
        s = led.open_session("s", SessionBudget(window=10_000, system_prompt=100))
        k = s.keys
        op = k.session.rsplit(":s:", 1)[0] + ":op:s:"
        me, other = "a" * 32, "b" * 32

        def start(op_id: str, owner: str, tokens: object, item: str = "c1") -> bytes:
            args = ["start", op_id, s.epoch, owner, 30_000, 60_000, 1, "r", item, tokens, 0, "t"]
            return ref(keys=[k.session, k.content, k.order, k.deadlines, op + op_id], args=args)  # type: ignore[no-any-return]

        def finish(op_id: str, owner: str, turn: object) -> bytes:
            args = ["finish", op_id, s.epoch, owner, turn, 60_000, 900, "tool", 300, 0, "x"]
            return ref(keys=[k.session, k.content, k.order, k.deadlines, op + op_id], args=args)  # type: ignore[no-any-return]

        before = r.hgetall(k.session)
        for bad in ("0", "-5", "x", "05"):
            with pytest.raises(redis.ResponseError, match="BADARG"):
                start("op-bad", me, bad)
        assert r.hgetall(k.session) == before and not r.exists(op + "op-bad")
        assert start("op-big", me, 50_000).startswith(b"status=refused")
        assert r.hgetall(k.session) == before and not r.exists(k.content)
        first = start("op-1", me, 500)
        assert first.startswith(b"status=ok|turn=1|charged=500"), first
        assert start("op-1", me, 500) == first and s.snapshot().free == 10_000 - 100 - 500
        with pytest.raises(redis.ResponseError, match="OPREUSED"):
            start("op-1", me, 600)
        with pytest.raises(redis.ResponseError, match="TURNHELD"):
            start("op-2", other, 10, "c2")
        for who, turn in ((other, 1), (me, 2)):
            with pytest.raises(redis.ResponseError, match="TURNLOST"):
                finish(f"op-f{who[0]}{turn}", who, turn)
        wrong = [k.session, k.content, k.order, k.deadlines, "elsewhere"]
        with pytest.raises(redis.ResponseError, match="BADARG keys"):  # (before any write)
            ref(
                keys=wrong,
                args=["finish", "op-k", s.epoch, me, 1, 60_000, 900, "tool", 300, 0, "x"],
            )
        assert r.hget(k.session, "lo") is not None and r.hget(k.content, "s:tool") is None
        done = finish("op-3", me, 1)
        assert done.startswith(b"status=ok|turn=1|charged=300"), done
        assert not r.hexists(k.session, "lo") and r.hget(k.content, "s:tool") == b"x"
        assert s.snapshot().free == 10_000 - 100 - 800


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_fused_begin_replays_the_turn_start_and_prints_every_ratio() -> None:
    """bench/fused_begin.py: the turn's first round trip as sent (MULTI/EXEC of three
    script calls), fused into one EVALSHA and one FCALL, replies checked equal (the
    bench asserts it), each row a positive figure beside its reference."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fused_begin", "--rounds", "2", "--n", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = proc.stdout.splitlines()[1:]
    assert len(rows) == 7, proc.stdout
    for line in rows:
        numbers = [float(x) for x in line[44:].split()[:2]]
        assert all(n > 0 for n in numbers), line
    assert rows[0].startswith("B: turn start in one EVALSHA vs A"), rows[0]
    assert rows[1].startswith("C: B as FCALL vs A"), rows[1]


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_instructions_counts_every_phase_of_both_trees() -> None:
    """bench/instructions.py: each phase a positive count, for the working tree and a
    revision, and admit's ratio to the careful reference printed for both."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.instructions", "--against", "HEAD", "--calls", "20",
         "--turns", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("│")]
    assert len(rows) == 5, proc.stdout
    for row in rows[:4]:
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert float(cells[1].replace(",", "")) > 0 and float(cells[2].replace(",", "")) > 0, row
    assert rows[4].count("x") >= 2, rows[4]
