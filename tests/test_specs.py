"""Each script's one spec, its Lua header read by ledger/specs.py: every script has one,
what is derived from it (READ_ONLY) agrees with the code, and a header that does not say
what the spec needs is refused."""

from __future__ import annotations

import re

import pytest

from ledger import protocol, scripts, specs

# The Redis commands that write: a read-only script's full text (with the definitions of
# _common.lua it uses) calls none of them, a mutating script's calls one at least.
WRITES = {
    "DEL",
    "EXPIRE",
    "HDEL",
    "HINCRBY",
    "HSET",
    "PEXPIRE",
    "RENAME",
    "XADD",
    "XDEL",
    "ZADD",
    "ZREM",
    "ZREMRANGEBYSCORE",
}


def _commands(name: str) -> set[str]:
    return set(re.findall(r"redis\.call\('([A-Z]+)'", scripts.strip_comments(scripts.source(name))))


def test_every_script_has_a_spec() -> None:
    for name in scripts.NAMES:
        spec = scripts.spec(name)
        assert spec.name == name and spec.summary and spec.reply and spec.calls, name
        assert spec.keys[0].positions[0] == 1 and spec.argv[0].positions[0] == 1, name
        assert re.search(r"\d", spec.key_count), name


def test_read_only_is_what_the_headers_say_and_what_the_code_does() -> None:
    assert {n for n in scripts.NAMES if scripts.spec(n).read_only} == scripts.READ_ONLY
    assert {"snapshot", "audit", "worker_check", "read_spill"} <= scripts.READ_ONLY
    for name in scripts.NAMES:
        writes = _commands(name) & WRITES
        if scripts.spec(name).read_only:
            assert not writes, f"{name} is marked read-only but calls {sorted(writes)}"
        else:
            assert writes, f"{name} is marked mutating but writes nothing"


def test_a_mutating_scripts_spec_has_the_op_id_the_epoch_and_the_outcome_keys() -> None:
    for name in sorted(set(scripts.NAMES) - scripts.READ_ONLY):
        spec = scripts.spec(name)
        names = {p: a.name for a in spec.argv for p in a.positions}
        op = 2 if name == "set_scope" else 1  # the scope's call: its version first
        assert names[op] == "operation id" and spec.arg(op) is not None, name
        assert spec.arg(op).is_id, name  # type: ignore[union-attr]
        if name == "set_scope":
            continue
        assert names[2].startswith(("epoch", "v:epoch")), name
        last = [k.name for k in spec.keys][-3:]
        assert last == ["partition tally", "outcome hash", "previous outcome hash"], name
        # counted from the last when optional keys come before them
        optional = any(k.optional for k in spec.keys)
        assert all(k.where[0] == "-" for k in spec.keys[-3:]) is optional, name


def test_the_specs_ranges_units_and_ids() -> None:
    reserve = scripts.spec("reserve")
    tokens, lease, model = reserve.arg(6), reserve.arg(7), reserve.arg(8)
    assert tokens is not None and tokens.range == (1, 10**8) and tokens.unit == "tokens"
    assert lease is not None and lease.range == (1, protocol.LEASE_MAX_MS) and lease.unit == "ms"
    assert model is not None and model.optional and not reserve.arg(5).optional  # type: ignore[union-attr]
    assert reserve.arg(5).is_id and not tokens.is_id  # type: ignore[union-attr]
    check = scripts.spec("worker_check").arg(3)
    assert check is not None and check.range == (0, 2**31 - 1)
    window = scripts.spec("set_scope").arg(3)
    assert window is not None and window.range == (1000, 400 * 86_400_000)
    admit = scripts.spec("admit")
    assert [k.where for k in admit.keys] == ["1", "2", "3", "-3", "-2", "-1"]
    assert admit.keys[2].optional and admit.keys[2].name == "reclaim-order index"
    assert admit.argv[-2].where == "6..5+3n" and admit.argv[-2].positions == ()
    assert scripts.spec("open").arg(22) is scripts.spec("open").arg(21)  # ARGV[21..23]
    assert "TURNLOST" in admit.errors and "BADARG" in admit.errors


# A script's own check of an argument at a fixed position with literal bounds.
INT_ARG = re.compile(r"int_arg\(ARGV\[(\d+)\], *'[^']*', *([-\w.* ]+), *([-\w.* ]+)[,)]")
LUA_CONSTANTS = {"TOKENS_MAX": 10**8}


def _bound(text: str) -> int | None:
    """A literal bound of the Lua (``1e15``, ``TOKENS_MAX``, ``400 * 86400000``), else None."""
    factors = [LUA_CONSTANTS.get(f.strip(), f.strip()) for f in text.split("*")]
    if not all(isinstance(f, int) or re.fullmatch(r"-?\d+(e\d+)?", f) for f in factors):
        return None
    out = 1
    for f in factors:
        out *= f if isinstance(f, int) else int(float(f))
    return out


def test_the_ranges_the_specs_give_are_the_ones_the_scripts_check() -> None:
    checked = 0
    for name in scripts.NAMES:
        body = scripts.strip_comments((scripts.lua_dir() / f"{name}.lua").read_text())
        spec = scripts.spec(name)
        for m in INT_ARG.finditer(body):
            lo, hi = _bound(m.group(2)), _bound(m.group(3))
            if lo is None or hi is None:
                continue  # a bound the script computes (set_scope's bucket: the window)
            arg = spec.arg(int(m.group(1)))
            assert arg is not None and arg.range == (lo, hi), (name, m.group(0), arg)
            checked += 1
    assert checked >= 30


GOOD = """-- probe.lua: a probe.
--
-- KEYS[1]  session hash
-- ARGV[1]  protocol version  the call's
-- ARGV[2]  tokens            1..1e8
--
-- Mode: read-only
-- Reply: epoch=<n>
-- Errors: LEDGER_NOSESSION,
--         LEDGER_VERSION.
-- Calls: HGET.
return 1
"""


def test_a_good_header_is_read() -> None:
    spec = specs.parse("probe", GOOD)
    assert spec.read_only and spec.key_count == "1" and spec.errors == ("NOSESSION", "VERSION")
    assert spec.arg(2) == specs.Entry("ARGV", "2", "tokens", "1..1e8")
    assert spec.arg(2).range == (1, 10**8)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        ("-- probe.lua: a probe.", "-- a probe.", "first line"),
        ("-- Mode: read-only\n", "", "no '-- Mode:'"),
        ("-- Mode: read-only", "-- Mode: readonly", "not one of"),
        ("-- Reply: epoch=<n>\n", "", "no '-- Reply:'"),
        ("-- KEYS[1]  session hash", "-- KEYS[x]  session hash", "cannot read the position"),
        ("-- ARGV[2]", "-- ARGV[-2]", "cannot read the position"),
        ("-- KEYS[1]  session hash", "-- KEYS[1]  (optional) session hash", "KEYS count"),
        ("-- KEYS[1]  session hash\n", "", "no KEYS[1]"),
        ("-- Calls: HGET.", "-- Calls: HGET.\n-- Calls: HGET.", "a second"),
    ],
)
def test_a_header_without_what_the_spec_needs_is_refused(old: str, new: str, says: str) -> None:
    assert old in GOOD
    with pytest.raises(ValueError, match=re.escape(says)):
        specs.parse("probe", GOOD.replace(old, new))
