"""The schema (ledger/schema/) defines every stored field: the Lua legend is generated
from it, and no script or Python module uses a field it does not define."""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger import Item, Ledger, schema, scripts
from tests.support import jobs, tools

# --- the legend -----------------------------------------------------------------------


_legend = tools.load("legend")


def test_the_legend_of_common_lua_is_generated_from_the_schema() -> None:
    assert _legend.main(["--check"]) == 0


def test_a_stale_legend_is_found() -> None:
    source = _legend.common_lua().read_text()
    stale = source.replace("--   ca ", "--   ca_gone ", 1)
    assert stale != source and schema.with_legend(stale) == source
    with pytest.raises(ValueError, match="markers"):
        schema.with_legend(source.replace(schema.BEGIN, "-- no marker"))


def test_the_legend_lists_every_field() -> None:
    legend = schema.legend()
    listed = set(re.findall(r"^--   (\S+)", legend, re.M))
    scripts_fields = {f.wire for f in schema.FIELDS if f.owner not in schema.WORKER_OWNERS}
    assert scripts_fields == listed
    # the fields a hand-written legend once left out
    assert {"ca", "te", "dt", "dr", "dp", "df"} <= listed
    # the worker's own records are defined, but no script's business: not in the legend
    worker = [f for f in schema.FIELDS if f.owner in schema.WORKER_OWNERS]
    assert {f.wire for f in worker} == {"job", "why", "error", "<entry_id>"}
    assert not any(f"\n-- {owner}: " in legend for owner in schema.WORKER_OWNERS)


def test_wire_names_are_unique_per_owner_and_long_names_too() -> None:
    seen: set[tuple[str, str]] = set()
    names: set[tuple[str, str]] = set()
    for f in schema.FIELDS:
        assert (f.owner, f.wire) not in seen, f
        assert (f.owner, f.name) not in names, f
        seen.add((f.owner, f.wire))
        names.add((f.owner, f.name))
        assert f.unit in schema.UNITS and f.owner in schema.OWNERS and f.meaning


def test_a_letter_has_one_meaning() -> None:
    """A consumer letter means that consumer wherever it appears: in per-consumer fields,
    and in the claim groups' fields, spelled with their consumers' letters (``rm``: the
    memory group of retrieval and recall)."""
    assert schema.lookup("u_m") is schema.HELD and schema.HELD.of("m") == "u_m"
    assert schema.ACTIVE_MEMORY.name.endswith("memory_group")
    assert schema.MEMORY_FLOOR.name.endswith("memory_group")
    for f in schema.fields("session"):
        if "<c>" in f.wire:
            assert "group" not in f.meaning, f
    groups = {"a_w": "w", "F_w": "w", "a_rm": "rm", "F_rm": "rm", "a_s": "s", "F_s": "s"}
    for wire, letters in groups.items():  # each group's letters: the consumers it holds
        assert schema.lookup(wire).wire.split("_")[1] == letters
        assert all(schema.CONSUMERS[c] in schema.lookup(wire).meaning
                   or c in "ws" for c in letters), wire  # fmt: skip
    claim_letters = {c for letters in groups.values() for c in letters}
    assert claim_letters == set(schema.CONSUMERS), claim_letters


def test_patterns() -> None:
    assert schema.lookup("u_w") is schema.HELD and schema.lookup("u_x") is None
    assert schema.lookup("i:m:doc-1") is schema.ITEM and schema.item_field("m", "d") == "i:m:d"
    assert schema.lookup("x:last_reset") is schema.LAST_RESET
    assert schema.lookup("x:refused") is schema.COUNTER
    assert schema.lookup("refused", "tally") is not None
    assert schema.content_field("w", "m0") == "w:m0"
    with pytest.raises(ValueError):
        schema.HELD.of("w", "extra")


# --- the records ----------------------------------------------------------------------


def test_job_entry_reads_what_the_scripts_write(ledger: Ledger) -> None:
    sid = "schema-job"
    jobs.open_compaction(ledger, sid)
    [(_, fields)] = jobs.entries_for(ledger, sid)
    assert tuple(fields) == schema.JOB_FIELDS  # the fields, in the order written
    entry = schema.JobEntry.from_fields(fields)
    assert entry.kind == "compact" and entry.session == sid and entry.inc > 0
    assert entry.to_fields() == fields
    with pytest.raises(KeyError):
        schema.JobEntry.from_fields({"kind": "compact"})


def test_summary_record_reads_what_compact_writes(ledger: Ledger) -> None:
    s = ledger.open_session("schema-summary", jobs.BUDGET)
    s.admit("working_memory", [Item("m0", 100)], texts=["old"])
    s.compact(["m0"], Item("w1", 10), summary_text='a "quoted" summary')
    raw = ledger.client.hget(s.keys.compacted, "w1")
    assert raw is not None
    rec = schema.SummaryRecord.from_json(raw)
    assert rec.text == 'a "quoted" summary' and rec.replaced == ("w:m0",) and rec.at > 0
    assert rec.replaced_items() == [("w", "m0")]
    assert schema.SummaryRecord.from_json(rec.to_json()) == rec
    assert ledger.client.hget(s.keys.content, schema.content_field("w", "w1")) is not None
    with pytest.raises(ValueError):
        schema.SummaryRecord.from_json("[1, 2]")


# --- every field used is defined ------------------------------------------------------

# A Lua string literal, single- or double-quoted (its text is group 1 or group 2).
_STR = r"""(?:'([^'\\\n]*)'|"([^"\\\n]*)")"""
# A command call: redis.call or redis.pcall, its name in either quotes and either case.
_CALL = r"""redis\.p?call\(\s*['"]"""
_HCALL = re.compile(_CALL + r"""([Hh][A-Za-z]+)['"]\s*,""")
_XADD = re.compile(_CALL + r"""[Xx][Aa][Dd][Dd]['"]\s*,""")
_LIT = re.compile(rf"^{_STR}$")
_PREFIX = re.compile(rf"^{_STR}\s*\.\.")
_UNPACK = re.compile(r"^unpack\((\w+)")
_MAPPED = re.compile(r"^([A-Z]+)\[\w+\]$")
# the maps of _common.lua a script may index (ACTIVE[c], FLOOR[c])
_COMMON = scripts.strip_comments((scripts.lua_dir() / "_common.lua").read_text())
# the hash each key expression names in the scripts
_KEY_OWNER = {"OUT": "outcome", "OLD": "outcome", "TALLY": "tally", "key": "session"}
_KEY_OWNER["KEYS[1]"] = "session"


def _balanced(src: str, start: int, open_: str = "(", close: str = ")") -> str:
    """The text between the bracket before ``start`` and its match."""
    depth, i = 1, start
    while depth:
        c = src[i]
        if c in "'\"":
            i = src.index(c, i + 1)
        elif c == open_:
            depth += 1
        elif c == close:
            depth -= 1
        i += 1
    return src[start : i - 1]


def _split(args: str) -> list[str]:
    """Top-level comma-separated expressions."""
    out, depth, cur, i = [], 0, "", 0
    while i < len(args):
        c = args[i]
        if c in "'\"":
            j = args.index(c, i + 1)
            cur += args[i : j + 1]
            i = j + 1
            continue
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        if c == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += c
        i += 1
    return [*out, cur.strip()] if cur.strip() else out


def _table(src: str, name: str) -> list[str]:
    """The elements of the table constructors assigned to local ``name`` in ``src``,
    and of the literals appended to it (``name[#name + 1] = ...``, ``name[k + 12] = ...``)."""
    out: list[str] = []
    for m in re.finditer(rf"\blocal\s+{name}\b[^=\n]*=\s*\{{", src):
        out += _split(_balanced(src, m.end(), "{", "}"))
    for m in re.finditer(rf"\b{name}\[[^\]]*\](?:,\s*{name}\[[^\]]*\])?\s*=\s*([^\n]+)", src):
        out += _split(m.group(1))
    for m in re.finditer(rf"ipairs\(\{{([^}}]*)\}}\)\s*do\s+{name}\[#{name} \+ 1\] = kv", src):
        out += _split(m.group(1))
    return out


Use = tuple[str, str, str]  # (owner or '', a field or a prefix ending with '*', where)


def _aliases(src: str) -> dict[str, str]:
    """Locals bound to a literal or to ``MAP[c]`` (``local A, F = ACTIVE[c], FLOOR[c]``)."""
    out = {}
    for m in re.finditer(r"^\s*local\s+([\w\s,]+?)\s*=\s*([^\n]+)", src, re.M):
        names, exprs = re.split(r"\s*,\s*", m.group(1)), _split(m.group(2))
        for name, expr in zip(names, exprs, strict=False):
            if _MAPPED.match(expr) or _LIT.match(expr):
                out[name] = expr
    return out


def _text(m: re.Match[str]) -> str:
    """The text of the string literal _STR matched (the first of its groups that did)."""
    return next(g for g in m.groups() if g is not None)


def _names(exprs: list[str], where: str, owner: str, src: str = "") -> Iterator[Use]:
    """The fields the expressions name: a literal, a literal prefix, or ``MAP[c]`` where
    ``local MAP = { w = 'a_w', ... }`` (each of its values)."""
    for e in exprs:
        if m := _LIT.match(e):
            yield owner, _text(m), where
        elif m := _PREFIX.match(e):
            yield owner, _text(m) + "*", where
        elif re.fullmatch(r"[A-Za-z_]\w*", e) and (alias := _aliases(src).get(e)):
            yield from _names([alias], where, owner, src)
        elif (m := _MAPPED.match(e)) and (
            t := re.search(rf"\blocal\s+{m.group(1)}\s*=\s*\{{([^}}]*)\}}", _COMMON + src)
        ):
            for v in re.finditer(rf"\w+\s*=\s*{_STR}", t.group(1)):
                yield owner, _text(v), where


def lua_uses(src: str, where: str) -> Iterator[Use]:
    """The hash fields a script's source names: the literal fields of HGET, HMGET, HDEL,
    HEXISTS, HSET, HINCRBY (and of the tables they unpack), the field lists given to
    `load`, the indicators counted with `indicate`, and the table-key reads of what `load`
    returned or an HGETALL was decoded into. A literal prefix (``'u_' .. c``) is a use
    of a field starting with it. A command is found sent by ``redis.call`` or
    ``redis.pcall``, its name in either case (``'HGET'``, ``'hget'``), and a literal in
    either quotes (``'ep'``, ``"ep"``)."""
    src = scripts.strip_comments(src)
    for m in _HCALL.finditer(src):
        cmd = m.group(1).upper()
        if cmd in ("HGETALL", "HLEN", "HSCAN"):
            continue  # (no field named: HSCAN's are a cursor, MATCH and COUNT)
        args = _split(_balanced(src, src.index("(", m.start()) + 1))[1:]
        owner = _KEY_OWNER.get(args[0], "")
        rest = args[1:]
        kv = cmd in ("HSET", "HSETNX", "HINCRBY", "HINCRBYFLOAT")
        named = rest[::2] if kv else rest
        for e in named:
            if u := _UNPACK.match(e):
                table = _table(src, u.group(1))
                yield from _names(table[::2] if kv else table, where, owner, src)
        yield from _names(named, where, owner, src)
    for m in re.finditer(r"\bcommit\(", src):  # commit(key, now, op, fp, out, args, J)
        args = _split(_balanced(src, m.end()))
        if len(args) == 7 and args[5].startswith("{"):
            yield from _names(_split(args[5][1:-1])[::2], where, "session", src)
        elif len(args) == 7:
            yield from _names(_table(src, args[5])[::2], where, "session", src)
    for m in _XADD.finditer(src):  # XADD stream * k v ...
        args = _split(_balanced(src, src.index("(", m.start()) + 1))
        yield from _names(args[3::2], where, "job", src)
    for lit in re.findall(r"'([^'\n]*)'", src):  # the keys of a JSON record built in a string
        for key in re.findall(r'"(\w+)":', lit):
            yield "summary", key, where
    for m in re.finditer(r"\bload\(\s*\w+\s*,\s*", src):
        after = src[m.end() :]
        if after.startswith("{"):
            yield from _names(_split(_balanced(src, m.end() + 1, "{", "}")), where, "session", src)
        elif t := re.match(r"\w+", after):
            yield from _names(_table(src, t.group(0)), where, "session", src)
    for m in re.finditer(rf"\bindicate\(\s*\w+\s*,\s*({_STR}(?:\s*\.\.)?)", src):
        yield from _names([m.group(1)], where, "tally")
    decoded = set(re.findall(r"local\s+(\w+)(?:,\s*\w+)?\s*=\s*load\(", src))
    decoded |= set(re.findall(r"^\s*(\w+),\s*\w+\s*=\s*load\(", src, re.M))
    decoded |= set(re.findall(r"(\w+)\[all\[i\]\]\s*=\s*all\[i \+ 1\]", src))
    for var in decoded:
        for m in re.finditer(rf"(?<![\w.]){var}\.([A-Za-z_]\w*)", src):
            yield "session", m.group(1), where
        for m in re.finditer(rf"(?<![\w.]){var}\[{_STR}\]", src):
            yield "session", _text(m), where


# redis-py's hash commands whose arguments after the key are fields (a list or tuple
# literal of fields too: hmget(k, ["a", "b"])), and those of one field and its value.
_PY_FIELDS = {"hget", "hexists", "hdel", "hmget", "hstrlen"}
_PY_FIELD_VALUE = {"hset", "hsetnx", "hincrby", "hincrbyfloat"}


def _elements(e: ast.expr | None) -> list[ast.expr]:
    """An expression, or the elements of a list or tuple literal."""
    if e is None:
        return []
    return list(e.elts) if isinstance(e, ast.List | ast.Tuple) else [e]


def _keys(e: ast.expr | None) -> list[ast.expr]:
    """The keys of a dict literal (none of anything else, nor of a ``**`` in it)."""
    return [k for k in e.keys if k is not None] if isinstance(e, ast.Dict) else []


def _arg(call: ast.Call, i: int, name: str) -> ast.expr | None:
    """A call's argument by position or keyword."""
    if len(call.args) > i and not isinstance(call.args[i], ast.Starred):
        return call.args[i]
    return next((k.value for k in call.keywords if k.arg == name), None)


def _command_fields(call: ast.Call) -> list[ast.expr]:
    """The field expressions of a redis-py command call (``client.hget(k, "ep")``,
    ``pipe.hset(k, mapping={...})``, ``client.xadd(stream, {...})``), or none."""
    if not isinstance(call.func, ast.Attribute):
        return []
    cmd = call.func.attr
    if cmd in _PY_FIELDS:
        return [e for a in call.args[1:] for e in _elements(a)]
    if cmd in _PY_FIELD_VALUE:
        items = _elements(_arg(call, 4, "items"))[::2] if cmd == "hset" else []
        return [*_elements(_arg(call, 1, "key")), *_keys(_arg(call, 3, "mapping")), *items]
    if cmd == "xadd":  # xadd(name, fields, ...): the names of a dict literal's fields
        return _keys(_arg(call, 1, "fields"))
    return []


_SCOPES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a module or function but those of the functions defined in it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, _SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def _hgetall_reads(tree: ast.AST) -> Iterator[ast.expr]:
    """The literal keys read, in one function (or a module's top level), of a local bound
    there to what an hgetall returned (``h = client.hgetall(k)``, or awaited): ``h["ep"]``,
    ``h.get("ep")``. A dict made from one (``{text(k): ...}``) is not followed."""
    for scope in (n for n in ast.walk(tree) if isinstance(n, _SCOPES)):
        nodes = list(_own_nodes(scope))
        bound = set()
        for n in nodes:
            if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None:
                value = n.value.value if isinstance(n.value, ast.Await) else n.value
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if (
                    isinstance(value, ast.Call)
                    and isinstance(value.func, ast.Attribute)
                    and value.func.attr == "hgetall"
                ):
                    bound |= {t.id for t in targets if isinstance(t, ast.Name)}
        for n in nodes:
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name):
                if n.value.id in bound:
                    yield n.slice
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "get"
                and isinstance(n.func.value, ast.Name)
                and n.func.value.id in bound
                and n.args
            ):
                yield n.args[0]


def python_uses(src: str, where: str) -> Iterator[Use]:
    """The hash and stream fields Python code names as literals: the fields of hget,
    hexists, hdel, hmget (a list of them too), hstrlen, hset (its field, its ``mapping``
    dict literal's keys, its ``items``), hsetnx, hincrby; the keys of a dict literal
    given to xadd; the keys read of what an hgetall returned (:func:`_hgetall_reads`);
    and the keys read of a snapshot's raw fields (``snap.raw.get("ws")``,
    ``snap.raw["ws"]``)."""
    tree = ast.parse(src)
    lits: list[ast.expr] = list(_hgetall_reads(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            lits += _command_fields(node)
            if f.attr == "get" and isinstance(f.value, ast.Attribute) and f.value.attr == "raw":
                lits += node.args[:1]
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "raw"
        ):
            lits.append(node.slice)
    for lit in lits:
        if isinstance(lit, ast.Constant) and isinstance(lit.value, str | bytes):
            v = lit.value.decode() if isinstance(lit.value, bytes) else lit.value
            yield "", v, f"{where}:{lit.lineno}"


def undefined(uses: Iterator[Use]) -> list[Use]:
    """The uses the schema does not define (a prefix: no field of the owner starts with
    it, nor is a pattern it fills)."""
    bad = []
    for owner, name, where in uses:
        of = owner or None
        if name.endswith("*"):
            p = name[:-1]
            ok = any(f.wire.startswith(p) for f in schema.fields(of)) or bool(
                schema.lookup(p + "x", of)
            )
        else:
            ok = schema.lookup(name, of) is not None or (not owner and name in schema.REPLY_ONLY)
        if not ok:
            bad.append((owner, name, where))
    return bad


def lua_files() -> list[Path]:
    return sorted(scripts.lua_dir().glob("*.lua"))


def python_files() -> list[Path]:
    """Every module of the ledger package (its workers included, wherever they live)."""
    roots: set[Path] = set()
    for pkg in ("ledger", "ledger.workers", "workers"):
        spec = importlib.util.find_spec(pkg)
        if spec and spec.submodule_search_locations:
            roots.update(Path(p).resolve() for p in spec.submodule_search_locations)
    files = {p.resolve() for root in roots for p in root.rglob("*.py")}
    return sorted(p for p in files if p.parent.name != "schema")  # (ledger/schema/ defines)


def test_every_field_a_script_uses_is_defined() -> None:
    uses = [u for p in lua_files() for u in lua_uses(p.read_text(), p.name)]
    found = {name for _, name, _ in uses}
    # the scan sees the fields the scripts use: the session's, the outcome hashes', the tally's
    assert {"ep", "kf", "cd", "ca", "rq", "te", "dt", "dr", "dp", "df", "e", "k", "g"} <= found
    assert {"u_*", "i:*", "x:*", "refused", "rolled_back"} <= found
    assert len(found) > 80
    assert undefined(iter(uses)) == []
    # and every field defined is one a script uses (but the opaque ones, whose names are
    # data, and the indicator loud, counted under a name the script computes)
    # no script names a field only the worker stores (its dead letters, its errors hash)
    worker_only = [
        u for u in uses if (f := schema.lookup(u[1])) and f.owner in schema.WORKER_OWNERS
    ]
    assert worker_only == []
    unused = [
        f.wire
        for f in schema.FIELDS
        if not f.opaque
        and f.owner not in schema.WORKER_OWNERS
        and not any(
            (o == f.owner or not o)
            and (f.matches(n) if not n.endswith("*") else f.wire.startswith(n[:-1]))
            for o, n, _ in uses
        )
    ]
    assert unused == ["loud"]


def test_every_field_python_reads_is_defined() -> None:
    files = python_files()
    assert any(p.name == "runner.py" for p in files)
    assert any(p.parent.name == "views" for p in files)  # ledger/views/
    uses = [u for p in files for u in python_uses(p.read_text(), p.name)]
    assert undefined(iter(uses)) == []


def test_the_scans_find_an_undefined_field() -> None:
    """A synthetic script and module that use fields the schema does not define."""
    lua = """
local H, R = load(key, { 'ep', 'zq' }, 2)
local args = { 'fr', 1, 'zz', 2 }
redis.call('HSET', key, unpack(args))
redis.call('HINCRBY', key, 'zk', 1)
redis.call('HGET', KEYS[1], 'zh')
redis.call('HMGET', OUT, 'e', 'zo')
redis.call('HSET', key, 'q_' .. c, 1)
local ZMAP = { w = 'zm_w', r = 'a_rm' }
local Z, ok = ZMAP[c], 1
redis.call('HMGET', key, 'ep', Z)
indicate(key, 'no_such_indicator', 1)
if H.zr then end
redis.call('XADD', stream, '*', 'kind', kind, 'zj', 1)
local json = '{"text":' .. t .. ',"zs":1}'
return commit(key, now, op, fp, out, { 'zc', 1 }, J)
-- redis.call('HGET', key, 'in_a_comment')
redis.pcall('HGET', key, 'zp')
redis.call("HGET", KEYS[1], "zd")
redis.call('hget', key, 'zl')
redis.pcall("hset", key, "zu", "a value, not a field")
redis.call('hincrby', OUT, "zv", 1)
redis.call('HGET', key, "zf_" .. c)
local DMAP = { w = "zn_w" }
redis.call('hmget', key, DMAP[c])
redis.call("xadd", stream, "*", "kind", kind, "zy", 1)
indicate(key, "no_such_either", 1)
if H["zb"] then end
"""
    bad = {(o, n) for o, n, _ in undefined(lua_uses(lua, "synthetic.lua"))}
    assert bad == {
        ("session", "zq"),
        ("session", "zz"),
        ("session", "zk"),
        ("session", "zh"),
        ("outcome", "zo"),
        ("session", "q_*"),
        ("session", "zm_w"),
        ("tally", "no_such_indicator"),
        ("session", "zr"),
        ("job", "zj"),
        ("summary", "zs"),
        ("session", "zc"),
        # redis.pcall, double quotes, lowercase command names
        ("session", "zp"),
        ("session", "zd"),
        ("session", "zl"),
        ("session", "zu"),
        ("outcome", "zv"),
        ("session", "zf_*"),
        ("session", "zn_w"),
        ("job", "zy"),
        ("tally", "no_such_either"),
        ("session", "zb"),
    }
    # a field of another hash is not one of the session's
    assert undefined(iter([("session", "e", "x")])) == [("session", "e", "x")]
    py = """
snap.raw.get("zw")
client.hget(k, "zt")
client.hget(k, schema.EPOCH)
snap.raw["ws"]
client.hset(k, "zs1", "a value, not a field")
pipe.hset(k, key="zs2", value=1)
client.hset(k, mapping={"zs3": 1, schema.EPOCH: 2, "ep": 3})
client.hset(k, items=["zs4", 1])
client.hsetnx(k, "zn", "not_a_field")
client.hincrby(k, "zi", 1)
client.hmget(k, ["zm", "ep"])
client.hdel(k, "zd1", b"zd2")
client.xadd(stream, {"zx": 1, "kind": "compact"})
client.xadd(dead, fields={"job": eid, "why": why, "error": "", "zx2": 1})
def f(client):
    h = client.hgetall(k)
    return h["zg"], h.get(b"zb"), h.get("ep"), h.get(schema.EPOCH)
async def g(client):
    h2: dict = await client.hgetall(k)
    return h2["za"]
def unrelated(h):
    return h["not_read_of_an_hgetall"], h.get("nor_this")
"""
    bad = [n for _, n, _ in undefined(python_uses(py, "synthetic.py"))]
    planted = "zw zt zs1 zs2 zs3 zs4 zn zi zm zd1 zd2 zx zx2 zg zb za"
    assert sorted(bad) == sorted(planted.split())
    assert len(bad) == len(set(bad))  # each found once (a nested function's reads too)
