"""The wire protocol of docs/protocol.md: its test vectors hold for the code, and a client
that only has the dumped script text and a Redis connection can speak it."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis

from ledger import Ledger, LedgerSettings, SessionBudget, cli, protocol, schema, scripts, views
from ledger.keys import KeySpace
from ledger.models import (
    BegunBy,
    CallCost,
    Consumer,
    Item,
    ScopeBudget,
    Usage,
    canonical_json,
)
from tests.support.servers import RedisProcess

ROOT = Path(__file__).resolve().parent.parent
VECTORS: dict[str, Any] = json.loads((ROOT / "tests/support/protocol_vectors.json").read_text())
DOC = (ROOT / "docs" / "protocol.md").read_text()


def op_fingerprint(script: str, argv: list[str]) -> str:
    """The rule of docs/protocol.md, written out independently of the Lua: ARGV[2]
    counts with its epoch only (no version, turn or owner token)."""
    epoch = re.sub(r"^\d+:", "", argv[1]).partition("!")[0].partition("@")[0]
    signed = [script, epoch, *argv[2:]]
    return hashlib.sha1("\x1f".join(signed).encode()).hexdigest()[:12]


def test_vectors_are_of_this_protocol_version() -> None:
    assert VECTORS["protocol_version"] == protocol.VERSION == 4
    assert f"protocol version {protocol.VERSION}" in DOC.lower()
    assert all(c["argv"][1].startswith(f"{protocol.VERSION}:") for c in VECTORS["calls"])
    lua = (scripts.lua_dir() / "_common.lua").read_text()
    line = (
        f"local VERSION, LAYOUT, OLDEST_LAYOUT = "
        f"{protocol.VERSION}, {protocol.LAYOUT}, {protocol.OLDEST_LAYOUT}\n"
    )
    assert line in lua


@pytest.mark.parametrize("v", VECTORS["numbers"], ids=lambda v: v["float"])
def test_number_vectors(v: dict[str, str]) -> None:
    assert canonical_json(float(v["float"])) == v["json"]
    assert float(v["json"]) == float(v["float"])  # it reads back as the same double


@pytest.mark.parametrize("v", VECTORS["partition"], ids=lambda v: v["session_id"])
def test_partition_vectors(v: dict[str, Any]) -> None:
    assert zlib.crc32(v["session_id"].encode("utf-8")) == v["crc32"]
    for n, p in v["partitions"].items():
        assert KeySpace("ledger", int(n)).partition_of(v["session_id"]) == p
        assert v["crc32"] % int(n) == p


def test_key_vectors() -> None:
    v = VECTORS["keys"]
    ks = KeySpace(v["prefix"], v["partitions"])
    k = ks.session(v["session_id"])
    assert k.partition == v["partition"]
    assert (k.session, k.deadlines, k.jobs, k.content, k.compacted) == (
        v["session"],
        v["deadlines"],
        v["jobs"],
        v["content"],
        v["compacted"],
    )
    assert (k.outcomes, k.outcomes_old, k.tally) == (v["outcomes"], v["outcomes_old"], v["tally"])
    # A mutating script's KEYS: the session, its own keys, the partition's tally and the
    # two outcome hashes last.
    assert protocol.reset(k, "op", 1, "why").keys == (
        v["session"], v["deadlines"], v["content"], v["compacted"], v["tally"], v["outcomes"],
        v["outcomes_old"],
    )  # fmt: skip
    assert (k.spills, k.spilled, k.history, k.order) == (
        v["spills"], v["spilled"], v["history"], v["order"]
    )  # fmt: skip
    assert ks.session_key_parts(v["session"]) == (v["partition"], v["session_id"])
    # The worker's own keys in the partition (dead letters, job errors).
    assert f"{ks.tag(k.partition)}:dead" == v["dead_letter"]
    assert f"{ks.tag(k.partition)}:errors" == v["errors"]
    assert ks.dead_letters(k.partition) == v["dead_letter"]
    assert ks.job_errors(k.partition) == v["errors"]


@pytest.mark.parametrize("v", VECTORS["budgets"], ids=lambda v: v["sha256"][:8])
def test_budget_vectors(v: dict[str, Any]) -> None:
    b = SessionBudget(**v["given"])
    text = b.canonical_json()
    assert text == v["canonical_json"]
    assert b.fingerprint() == v["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    # The rules, checked on the text: no whitespace, sorted keys, no '.0'.
    assert not re.search(r"\s", text)
    data = json.loads(text)
    assert list(data) == sorted(data) == sorted(SessionBudget.model_fields)
    assert not re.search(r"\d\.0*[,}\]]", text)


def test_integral_floats_and_key_order_do_not_change_the_fingerprint() -> None:
    a = SessionBudget(window=8000, system_prompt=500, amplification_fragmentation=3)
    b = SessionBudget(amplification_fragmentation=3.0, system_prompt=500, window=8000)
    assert a.canonical_json() == b.canonical_json() and a.fingerprint() == b.fingerprint()
    assert '"amplification_fragmentation":3,' in a.canonical_json()
    c = SessionBudget(window=8000, system_prompt=500, amplification_fragmentation=3.5)
    assert c.fingerprint() != a.fingerprint()


def test_canonical_json_of_strings_and_nesting() -> None:
    assert canonical_json({"b": [1, 2.0, None, True], "a": 'é\n"x"'}) == (
        '{"a":"é\\n\\"x\\"","b":[1,2,null,true]}'
    )


def test_call_vectors() -> None:
    k = KeySpace(VECTORS["keys"]["prefix"], VECTORS["keys"]["partitions"])
    for v in VECTORS["calls"]:
        keys = k.session(v["session_id"])
        call: protocol.Call[Any]
        if v["script"] == "open":
            budget = SessionBudget(**VECTORS["budgets"][v["budget"]]["given"])
            call = protocol.open_session(keys, v["argv"][0], budget, v["op_retention_ms"])
        elif v["script"] == "finish_turn":
            epoch = int(v["argv"][1].partition(":")[2].partition("@")[0])
            tools = [(i, t, c) for i, t, c in v["tools"]]
            call = protocol.finish_turn(keys, v["argv"][0], epoch, v["turn"],
                                        v["final_prompt_tokens"], tools, v["owner_token"],
                                        mark=v["mark"], keep_text=v["keep_text"])  # fmt: skip
        else:
            items = [Item(i, t, priority=p) for i, t, p in v["items"]]
            epoch = int(v["argv"][1].partition(":")[2])
            call = protocol.admit(keys, v["argv"][0], epoch, v["consumer"], items, v["partial"])
        assert call.script == v["script"]
        assert list(call.keys) == v["keys"]
        assert [a.decode() if isinstance(a, bytes) else a for a in call.args] == v["argv"]
        assert op_fingerprint(v["script"], v["argv"]) == v["op_fingerprint"]


def doc_reply_codes() -> dict[str, str]:
    """The table of reply codes in docs/protocol.md: control character -> '|<key>='."""
    rows = re.findall(r"^\| 0x([0-9a-f]{2}) \| `(\w+)` \|$", DOC, re.M)
    return {chr(int(code, 16)): f"|{key}=" for code, key in rows}


def encode_outcome(op_id: str, fingerprint: str, reply: str, base: int) -> str:
    """A stored outcome as docs/protocol.md describes it, written out independently of the
    Lua: 0x1E, hex digits 3-16 of SHA-1(op id), the fingerprint, the coded reply, whose
    epoch is written as its difference to the generation's base."""
    relative = re.sub(r"\|epoch=(\d+)", lambda m: f"|epoch={int(m.group(1)) - base}", reply)
    coded = re.sub(
        r"\|\w+=",
        lambda m: {v: k for k, v in doc_reply_codes().items()}.get(m.group(0), m.group(0)),
        "|" + relative,
    )
    key = hashlib.sha1(op_id.encode()).hexdigest()[2:16]
    return f"\x1e{key}{fingerprint}{coded}"


def test_the_docs_reply_codes_are_the_scripts() -> None:
    assert len(doc_reply_codes()) >= 29
    assert doc_reply_codes() == scripts.reply_codes()


@pytest.mark.parametrize("v", VECTORS["outcomes"], ids=lambda v: v["op_id"])
def test_outcome_vectors(v: dict[str, str]) -> None:
    assert hashlib.sha1(v["op_id"].encode()).hexdigest()[:2] == v["bucket"]
    assert scripts.outcome_key(v["op_id"]) == (v["bucket"], v["key"])
    assert encode_outcome(v["op_id"], v["fingerprint"], v["reply"], int(v["base"])) == v["record"]
    # Two records in one bucket read back apart (the decoder `ledger inspect` uses).
    first = VECTORS["outcomes"][0]
    assert v["base"] == first["base"]  # outcomes of one generation
    got = scripts.stored_outcomes(v["record"] + first["record"], int(v["base"]))
    assert got == [
        (v["key"], v["fingerprint"], v["reply"]),
        (first["key"], first["fingerprint"], first["reply"]),
    ]


def test_the_doc_names_every_scripts_keys_and_argv_as_its_lua_header_does() -> None:
    """docs/protocol.md names every KEYS and ARGV position the script's spec (its Lua
    header) names (the keys counted from the last: after the optional ones)."""
    where = re.compile(r"(?:KEYS|ARGV)\[[^\]]+\]")
    for name in scripts.NAMES:
        spec = scripts.spec(name)
        section = re.search(rf"^### `{name}`\n(.*?)(?=^### |\Z)", DOC, re.S | re.M)
        assert section is not None, f"docs/protocol.md has no section for {name}"
        lua = {f"{e.kind}[{e.where}]" for e in spec.keys + spec.argv if e.where[0] != "-"}
        assert len(lua) >= 2 and set(where.findall(section.group(1))) >= lua, name


# --- a client with no ledger code: raw EVAL of the dumped text ------------------------------


def _reply(raw: bytes) -> dict[str, str]:
    return dict(part.partition("=")[::2] for part in raw.decode().split("|"))


def test_raw_eval_of_the_dumped_scripts_speaks_the_protocol(
    redis_server: RedisProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["scripts", str(tmp_path)]) == cli.EXIT_OK
    printed = dict(line.split()[::-1] for line in capsys.readouterr().out.splitlines())
    text = {name: (tmp_path / f"{name}.lua").read_bytes() for name in scripts.NAMES}
    r = redis.Redis.from_url(redis_server.url)
    for name, body in text.items():  # EVALSHA digests: what SCRIPT LOAD answers
        assert r.script_load(body) == printed[str(tmp_path / f"{name}.lua")]
    opened, other, admit = VECTORS["calls"][:3]
    okeys = opened["keys"]  # the session, its five data keys, the tally, the outcome hashes
    key, content, tally, out, old = okeys[0], okeys[1], okeys[-3], okeys[-2], okeys[-1]
    order = VECTORS["keys"]["order"]
    adk = [key, content, order, tally, out, old]  # admit's KEYS (the order key optional)
    assert content == VECTORS["keys"]["content"] and admit["keys"] == adk
    assert (out, old) == (VECTORS["keys"]["outcomes"], VECTORS["keys"]["outcomes_old"])
    assert tally == VECTORS["keys"]["tally"]
    everything = (*okeys, order, VECTORS["keys"]["jobs"], VECTORS["keys"]["deadlines"])
    r.delete(*everything)

    def bucket(name: str, op_id: str) -> str:
        raw = r.hget(name, hashlib.sha1(op_id.encode()).hexdigest()[:2])
        assert raw is not None, (name, op_id)
        return raw.decode()

    try:
        # Without the tally and the outcome hashes as its last three KEYS a mutating
        # script refuses.
        for keys in ([key], [*okeys[:-2], old, out], [*okeys[:-1], f"{old}x"],
                     [*okeys[:-3], out, old]):  # fmt: skip
            with pytest.raises(redis.ResponseError, match=r"^LEDGER_BADARG "):
                r.eval(text["open"], len(keys), *keys, *opened["argv"])
        assert r.exists(key, out, old) == 0
        got = _reply(r.eval(text["open"], 9, *okeys, *opened["argv"]))
        assert (got["status"], got["created"], got["turn"]) == ("ok", "1", "0")
        epoch = got["epoch"]
        v = f"{protocol.VERSION}:"  # every ARGV[2] starts with the protocol version
        # A call of protocol 1 (no version: '<epoch>' alone) is refused before anything is
        # written, naming both versions.
        before = r.hgetall(key)
        mismatch = r"^LEDGER_VERSION .*of protocol {}[ ,].*of protocol " + str(protocol.VERSION)
        with pytest.raises(redis.ResponseError, match=mismatch.format(1)):
            r.eval(text["admit"], 6, *adk, admit["argv"][0], epoch, *admit["argv"][2:])
        with pytest.raises(redis.ResponseError, match=mismatch.format(2)):
            r.eval(text["snapshot"], 1, key, "2")
        assert r.hgetall(key) == before and r.hget(key, "lv") == str(protocol.LAYOUT).encode()
        # What the server stored: the budget fingerprint as sent, and the outcome under
        # the op id, with the server's own fingerprint of the call, in its bucket of the
        # current generation: the vector's record, whose epoch is 0 as the generation's
        # first outcome sets the generation's base 'e' to its own epoch.
        assert r.hget(key, "cfg") == VECTORS["budgets"][0]["sha256"].encode()
        stored = VECTORS["outcomes"][0]
        assert stored["op_id"] == opened["argv"][0]
        assert stored["fingerprint"] == opened["op_fingerprint"]
        assert bucket(out, opened["argv"][0]) == stored["record"]
        assert r.hget(out, "e") == epoch.encode()
        # beside the bucket and 'e': the generation's count 'k' and 'g' = 0 (it began with
        # no previous generation, so none is read)
        assert r.hmget(out, "k", "g") == [b"1", b"0"] and r.hlen(out) == 4
        assert r.exists(old) == 0
        assert not [f for f in r.hkeys(key) if f.startswith(b"o:") or f in (b"ol", b"cl")]
        # The same call again is answered from the record.
        assert _reply(r.eval(text["open"], 9, *okeys, *opened["argv"]))["epoch"] == epoch
        # Another budget under another op id: the session exists with another budget.
        with pytest.raises(redis.ResponseError, match=r"^LEDGER_CONFLICT "):
            r.eval(text["open"], 9, *okeys, *other["argv"])
        # The first op id with other arguments.
        with pytest.raises(redis.ResponseError, match=r"^LEDGER_OPREUSED "):
            r.eval(text["open"], 9, *okeys, opened["argv"][0], *other["argv"][1:])
        # admit, fenced by the epoch open answered.
        argv = [admit["argv"][0], v + epoch, *admit["argv"][2:]]
        got = _reply(r.evalsha(printed[str(tmp_path / "admit.lua")], 6, *adk, *argv))
        # a new session's reclaim-order index is built by its first turn that needs it: an
        # admit before that adds nothing to it
        assert r.exists(order) == 0 and r.hget(key, "oq") is None
        assert (got["status"], got["charged"], got["admitted"]) == ("ok", "200", "2")
        reply = "|".join(f"{k}={v}" for k, v in got.items())
        fp = op_fingerprint("admit", argv)
        assert encode_outcome(argv[0], fp, reply, int(epoch)) in bucket(out, argv[0])
        with pytest.raises(redis.ResponseError, match=r"^LEDGER_STALE "):
            r.eval(  # (without the order key, as protocol 1 clients before it send)
                text["admit"],
                5,
                key,
                content,
                tally,
                out,
                old,
                "op-admit-2",
                v + str(int(epoch) - 1),
                *argv[2:],
            )
        # Rotation: the first call at or after gz renames the current generation to the
        # previous one (TTL: the op retention), sets gz one op retention ahead and starts a
        # new generation; a retry is still answered from the previous one.
        retention = int(opened["argv"][11])
        r.hset(key, "gz", 0)
        got = _reply(
            r.eval(text["release"], 4, key, tally, out, old, "op-rel-1", v + epoch, "r", "1", "x")
        )
        assert (got["status"], got["count"], got["missing"]) == ("ok", "0", "x")
        assert 0 < r.pttl(old) <= retention and r.pttl(out) > 0
        key_of = hashlib.sha1(argv[0].encode()).hexdigest()[2:16]
        assert r.hmget(out, "k", "g") == [b"1", b"1"] and r.hlen(out) == 4
        assert "\x1e" + key_of in bucket(old, argv[0])
        assert int(r.hget(key, "gz") or 0) > int(epoch)
        again = r.eval(text["admit"], 6, *adk, *argv)
        assert _reply(again) == _reply(r.eval(text["admit"], 6, *adk, *argv))
        assert _reply(again)["charged"] == "200" and r.hlen(out) == 4
        with pytest.raises(redis.ResponseError, match=r"^LEDGER_OPREUSED "):
            r.eval(text["admit"], 6, *adk, *argv[:-1], "1")
        # A turn that ends above the high-water mark (5760 of 8000) writes a compaction
        # job to the partition's stream, with the fields of docs/protocol.md, in order.
        sid, jobs = opened["session_id"], VECTORS["keys"]["jobs"]
        dl = VECTORS["keys"]["deadlines"]
        begin = [
            key,
            jobs,
            dl,
            tally,
            out,
            old,
            "op-b1",
            f"{v}{epoch}!{'a1' * 16}",  # the owner token of the turn, 32 hex digits
            "0",
            "-",
            sid,
            "node-1",
            "30000",
            "0",
        ]
        got = _reply(r.eval(text["begin_turn"], 6, *begin))
        assert (got["status"], got["turn"], got["rolled_back"]) == ("ok", "1", "0")
        assert r.zscore(dl, f"{sid}|~") == int(got["lease"])  # the turn lease's member
        # The turn is held: another owner's begin_turn and a call of no turn are refused.
        other_begin = [*begin[:6], "op-b2", f"{v}{epoch}!{'b2' * 16}", *begin[8:11], "node-2"]
        other_begin += ["30000", "0"]
        with pytest.raises(redis.ResponseError, match=r"^LEDGER_TURNHELD turn 1 is held by node-1"):
            r.eval(text["begin_turn"], 6, *other_begin)
        with pytest.raises(redis.ResponseError, match=r"^LEDGER_TURNHELD "):
            r.eval(
                text["admit"],
                5,
                key,
                content,
                tally,
                out,
                old,
                "op-w0",
                v + epoch,
                "w",
                "all",
                "1",
                "x",
                "1",
                "0",
            )
        # The turn's calls carry '<epoch>@<turn>!<owner token>': without the token that
        # began it (or with another) a call naming the turn is refused.
        for stamp in (f"{v}{epoch}@1", f"{v}{epoch}@1!{'b2' * 16}"):
            w0 = ["op-w0", stamp, "w", "all", "1", "turn-1", "6000", "0"]
            with pytest.raises(redis.ResponseError, match=r"^LEDGER_TURNHELD .*owner token"):
                r.eval(text["admit"], 6, *adk, *w0)
        w1 = ["op-w1", f"{v}{epoch}@1!{'a1' * 16}", "w", "all", "1", "turn-1", "6000", "0"]
        r.eval(text["admit"], 6, *adk, *w1)
        sums = VECTORS["keys"]["compacted"]
        end = [key, jobs, dl, content, sums, tally, out, old, "op-e1", f"{v}{epoch}@1!{'a1' * 16}"]
        end += ["1", "6700", "0", sid, "ck-1"]
        ended = _reply(r.eval(text["end_turn"], 8, *end))
        assert ended["reset"] == ""  # (no hard reset staged: none applied)
        assert ended["compaction_due"] == "1"
        # The indicator it counted: the session's x:class:<class> and the partition's tally.
        counted = f"class:{ended['class']}"
        assert r.hget(key, f"x:{counted}") == b"1" and r.hget(tally, counted) == b"1"
        assert r.zscore(dl, f"{sid}|~") is None and r.hget(key, "cm") == b"ck-1"
        [(_, fields)] = r.xrange(jobs)
        table = re.search(
            r"## The job stream\n.*?\| field \| value \|\n\| --- \| --- \|\n(.*?)\n\n", DOC, re.S
        )
        assert table is not None
        names = re.findall(r"^\| `(\w+)` \|", table.group(1), re.M)
        assert [k.decode() for k in fields] == names
        assert fields[b"kind"] == b"compact" and fields[b"session"] == sid.encode()
        assert fields[b"epoch"] == epoch.encode() and fields[b"op"] == b"op-e1"
        assert fields[b"reason"] == b"high_water_mark" and fields[b"inc"] == r.hget(key, "inc")
        # A turn of two calls (protocol 3): begin_turn, then finish_turn with a tool result
        # admitted whole and the turn ended in one step, its outcome stored as any call's.
        begin[6:8] = ["op-b3", f"{v}{epoch}!{'a1' * 16}"]
        assert _reply(r.eval(text["begin_turn"], 6, *begin))["turn"] == "2"
        free = int(r.hget(key, "fr") or 0)
        fin = ["op-f1", f"{v}{epoch}@2!{'a1' * 16}", "2", "6800", "0", sid, "-", "1", "1"]
        fin += ["call-1", "10", "grep: 3 matches"]
        fkeys = [key, jobs, dl, content, sums, tally, out, old]
        finished = _reply(r.eval(text["finish_turn"], 8, *fkeys, *fin))
        assert (finished["status"], finished["turn"], finished["tools"]) == ("ok", "2", "10;call-1")
        assert int(finished["free"]) == free - 10 and r.hget(key, "te") == b"2"
        assert r.hget(key, "i:s:call-1") == f"10|2|0|{int(r.hget(key, 'sq') or 0)}".encode()
        assert r.hget(content, "s:call-1") == b"grep: 3 matches" and r.hget(key, "lo") is None
        reply = "|".join(f"{k}={v}" for k, v in finished.items())
        fp = op_fingerprint("finish_turn", fin)
        assert encode_outcome(fin[0], fp, reply, int(epoch)) in bucket(out, fin[0])
        # The Python client agrees: the same budget is the same session.
        settings = LedgerSettings(
            redis_url=redis_server.url,
            prefix=VECTORS["keys"]["prefix"],
            partitions=VECTORS["keys"]["partitions"],
        )
        with Ledger.from_settings(settings) as led:
            budget = SessionBudget(**VECTORS["budgets"][0]["given"])
            s = led.open_session(opened["session_id"], budget)
            assert s.epoch == int(epoch)
            assert s.snapshot().used[Consumer.RETRIEVAL] == 200
    finally:
        r.delete(*everything)


# --- one session id under two partitions ------------------------------------------------------


def _split_id(stem: str) -> str:
    """An id that 64, 3 and 9 partitions put in three different partitions."""
    for i in range(1000):
        sid = f"{stem}-{i}"
        if len({zlib.crc32(sid.encode()) % n for n in (64, 3, 9)}) == 3:
            return sid
    raise AssertionError("no such id among 1000")


def test_audit_reports_a_session_under_two_partitions(
    redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = f"t{uuid.uuid4().hex[:12]}"
    budget = SessionBudget(window=1000, system_prompt=10)

    def ledger(partitions: int) -> Ledger:
        return Ledger.from_settings(
            LedgerSettings(redis_url=redis_server.url, prefix=prefix, partitions=partitions)
        )

    twice, elsewhere = _split_id("twice"), _split_id("elsewhere")
    with ledger(64) as led, ledger(3) as three, ledger(9) as nine:
        led.open_session("solo", budget)
        led.open_session(twice, budget)
        three.open_session(twice, budget)
        three.open_session(elsewhere, budget)  # neither copy where 64 partitions put it
        nine.open_session(elsewhere, budget)
        where = views.placements(led)
        assert where["solo"] == [led.keyspace.partition_of("solo")]
        assert where[twice] == sorted(
            [led.keyspace.partition_of(twice), three.keyspace.partition_of(twice)]
        )
        assert views.listed(led) == sorted(["solo", twice, elsewhere])
        argv = ["--url", redis_server.url, "--prefix", prefix, "audit"]
        assert cli.main([*argv, "solo"]) == cli.EXIT_OK
        capsys.readouterr()
        assert cli.main([*argv, "--verbose"]) == cli.EXIT_VIOLATION
        out = capsys.readouterr().out
        assert "solo: clean" in out and f"{twice}: clean" not in out
        for sid, clients in ((twice, (led, three)), (elsewhere, (three, nine))):
            line = next(x for x in out.splitlines() if x.startswith(f"{sid}: "))
            for c in clients:
                p = c.keyspace.partition_of(sid)
                assert f"p{p}" in line and c.keyspace.session(sid).session in line
        assert "2 under two partitions" in out
        # Asked for by name: found the same way.
        assert cli.main([*argv, elsewhere]) == cli.EXIT_VIOLATION
        assert f"{elsewhere}: under 2 partitions" in capsys.readouterr().out
        # Once one copy is deleted, the id is clean again.
        three.session(twice).delete()
        r = redis.Redis.from_url(redis_server.url)
        r.delete(three.keyspace.session(twice).session)  # the tombstone too
        assert cli.main([*argv, "solo", twice]) == cli.EXIT_OK


def test_the_doc_gives_every_session_field_a_meaning() -> None:
    """Every field `snapshot` answers and every field the scripts write to a session hash
    has a row in docs/protocol.md's table of session fields."""
    table = re.search(r"^### Session fields\n(.*?)(?=^### |^## )", DOC, re.S | re.M)
    assert table is not None
    documented: set[str] = set()
    for cell in re.findall(r"^\| (.+?) \| ", table.group(1), re.M):
        documented.update(re.findall(r"`([^`]+)`", cell))
    counters = re.search(r"^\| `x:<name>` \| (.*)$", table.group(1), re.M)
    assert counters is not None
    documented.update(f"x:{name}" for name in re.findall(r"`([a-z_]+)`", counters.group(1)))
    snapshot = (scripts.lua_dir() / "snapshot.lua").read_text()
    fields = re.search(r"local FIELDS = \{(.*?)\}", snapshot, re.S)
    assert fields is not None
    answered = set(re.findall(r"'([^']+)'", fields.group(1)))
    # every field of the session hash in the schema (which the legend of _common.lua is
    # generated from, and every script's field is checked against: tests/test_schema.py)
    written = {f.wire for f in schema.fields("session")}
    generic = {f for f in documented if "<" in f}
    missing = {f for f in answered | written if f not in documented}
    missing -= {f for f in missing if any(f.startswith(g.split("<")[0]) for g in generic)}
    assert len(answered) > 50 and len(written) > 50 and not missing, sorted(missing)


def _key_counts() -> dict[str, set[int]]:
    """How many KEYS each script's calls have, by the Python client's builders, with and
    without each optional key."""
    k = KeySpace("ledger", 64).session("s-1")
    b = SessionBudget(window=8000, system_prompt=10)
    it = [Item("a", 1)]
    calls: list[protocol.Call[Any]] = [
        protocol.open_session(k, "o", b, 60_000),
        protocol.admit(k, "o", 1, "retrieval", it),
        protocol.release(k, "o", 1, "retrieval", ["a"]),
        protocol.reserve(k, "o", 1, "scratchpad", "r", 5, 1000),
        protocol.settle(k, "o", 1, "r", 5),
        protocol.void(k, "o", 1, "r"),
        protocol.expire(k, "o", ["r"]),
        protocol.reset(k, "o", 1, "why"),
        protocol.delete(k, "o", 1),
        protocol.begin_turn(k, "o", 1, 0, None, "me", 1000),
        protocol.begin_turn(k, "o", 1, 0, None, "me", 1000, await_compaction=True),
        protocol.renew_turn(k, "o", 1, 1, 1000),
        protocol.abort_turn(k, "o", 1, 1),
        protocol.record_span(k, "o", 1, 1, "search", 1, 0),
        protocol.end_turn(k, "o", 1, 1, 10, 0),
        protocol.finish_turn(k, "o", 1, 1, 10, [("c", 1, "x")], "0" * 32),
        protocol.compact(k, "o", 1, ["a"], Item("s", 1)),
        protocol.admit_tool(k, "o", 1, "c", 1, "x"),
        protocol.reconcile(k, "o", 1, {"retrieval": it}),
        protocol.read_spill(k, "c"),
        protocol.snapshot(k),
        protocol.audit(k),
        protocol.worker_check("ledger:{p0}:deadlines", "ledger:{p0}:jobs", "g", 1),
        protocol.set_scope(KeySpace("ledger", 64), "o", "acme", ScopeBudget(window_ms=86_400_000)),
        protocol.open_child(k, "o", 1, "r", "c", 5),
        protocol.draw_child(k, "o", 1, "r", "c", 5),
    ]
    # with one, two and three budget scopes (a tenant's session)
    kt = KeySpace("ledger", 64).session("@acme/s-1")
    for scopes in (("acme",), ("acme", "acme/k"), ("acme", "acme/k", "acme/u")):
        cost = CallCost(model="m", input=5, output=1, scopes=scopes)
        billed = Usage(input=5, output=1)
        calls += [
            protocol.reserve(kt, "o", 1, "scratchpad", "r", 5, 1000, cost=cost),
            protocol.settle(kt, "o", 1, "r", 5, billed=billed, scopes=scopes),
            protocol.void(kt, "o", 1, "r", scopes=scopes),
        ]
    counts: dict[str, set[int]] = {}
    for c in calls:
        n = len(c.keys)
        optional = sum(1 for key in c.keys if ":order:" in key or ":compacted:" in key)
        # (the summaries hash is no optional key of these: a reset clears it)
        required = ("delete", "reset", "compact", "open", "end_turn", "abort_turn", "finish_turn")
        if c.script in required:
            optional = sum(1 for key in c.keys if ":order:" in key)
        counts.setdefault(c.script, set()).update({n, n - optional} if optional else {n})
    counts["begin_turn"].add(8)  # the summaries hash and the order index (checked above)
    return counts


def test_the_doc_gives_each_scripts_key_count_as_the_client_sends_them() -> None:
    """The table of KEYS counts in docs/protocol.md (generated from the scripts' specs) is
    the one count of each script: the Python client's calls have those counts, and a
    script the calls below do not make has its spec's count of KEYS lines."""
    table = re.search(r"^\| script \| KEYS \|.*?\n\n", DOC, re.S | re.M)
    assert table is not None
    doc: dict[str, set[int]] = {}
    for name, cell in re.findall(r"`(\w+)` \| ([^|]+) \|", table.group(0)):
        doc[name] = {int(n) for n in re.findall(r"\d+", cell)}
    counts = _key_counts()
    assert {name: doc.get(name) for name in counts} == counts
    assert set(doc) == set(scripts.NAMES)
    for name in set(doc) - set(counts):  # an operation added since (the tests' probe)
        keys = scripts.spec(name).keys
        assert sum(len(k.positions) for k in keys if not k.optional) in doc[name], name


def test_a_call_is_handed_to_redis_py_as_the_bytes_it_would_pack() -> None:
    """The client hands redis-py each call's KEYS and ARGV already encoded
    (``protocol.evalsha_args``): every argument bytes, and the packed EVALSHA byte for byte
    the one redis-py packs from the call's own strings (op ids, turn stamps, numbers,
    texts with non-ASCII characters)."""
    keys = KeySpace("wire", 8).session("s-1")
    token = protocol.new_token()
    stamp = protocol.stamp(3, BegunBy("op-begin"), token)
    calls = [
        protocol.begin_turn(keys, "op-begin", 3, 0, None, "host:1:ab", 30_000, False, True, token),
        protocol.admit(
            keys,
            "op-2",
            stamp,
            "retrieval",
            [Item("a", 3), Item("b", 4)],
            True,
            ["plain", "é \u4e2d"],
        ),
        protocol.finish_turn(keys, "op-3", 3, 7, 1_000, [("t1", 5, "tool é")], token, mark="m1"),
        protocol.snapshot(keys),
    ]
    conn = redis.Connection()  # (packs without connecting)
    sha = "0" * 40
    for call in calls:
        args = protocol.evalsha_args(call)
        assert args[0] == len(call.keys)
        assert all(type(a) is bytes for a in args[1:])
        mine = conn.pack_command("EVALSHA", sha, *args)
        assert mine == conn.pack_command("EVALSHA", sha, len(call.keys), *call.keys, *call.args)
