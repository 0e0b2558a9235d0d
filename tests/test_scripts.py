"""The loader: each script gets exactly the _common.lua definitions it uses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

from ledger import scripts
from ledger.testing import RedisProcess

WORD = re.compile(r"[A-Za-z_]\w*")


def test_common_is_cut_into_named_definitions() -> None:
    defs = scripts.definitions()
    names = [n for d in defs for n in d.names]
    assert len(names) == len(set(names))
    assert {"fail", "int_arg", "op_args", "gate", "commit", "ACTIVE", "FLOOR", "NOSESSION"} <= set(
        names
    )
    common = (scripts.lua_dir() / "_common.lua").read_text()
    for d in defs:
        assert d.text in common
        assert d.text.lstrip().startswith(("local ", "--"))


@pytest.mark.parametrize("name", scripts.NAMES)
def test_each_script_has_every_helper_it_names_and_no_other(name: str) -> None:
    body = (scripts.lua_dir() / f"{name}.lua").read_text()
    src = scripts.source(name)
    prelude = scripts.prelude(body)
    assert src == scripts.wrap(prelude + "\n" + body) and body in src
    included = [d for d in scripts.definitions() if d.text in prelude]
    defined = {n for d in included for n in d.names}
    # Closed: every definition named by the script or by an included definition is there
    # (a missing one would be a global lookup failing at run time on that path only).
    # Checked on the text with comments too: a name only a comment mentions may be left
    # out, one the code uses never.
    code_and_comments = set(WORD.findall(body))
    assert code_and_comments & defined >= set(WORD.findall(scripts.strip_comments(body))) & {
        n for d in scripts.definitions() for n in d.names
    }
    used = set(WORD.findall(scripts.strip_comments(body))).union(*(d.uses for d in included))
    every = {n for d in scripts.definitions() for n in d.names}
    assert used & every <= defined
    # Minimal: nothing is included that nobody names.
    for d in included:
        assert d.names & used, (name, sorted(d.names))


def test_rarely_used_helpers_stay_out_of_the_hot_path() -> None:
    admit = scripts.source("admit")
    assert "local function open_reservation(" not in admit
    assert "local function zero_counters(" not in admit
    assert "local function enqueue(" not in admit
    # named in admit.lua's comments only
    assert "local function load(" not in admit and "local function reply(" not in admit


def test_comments_are_stripped_and_strings_kept() -> None:
    lua = "local a = 'x -- y' -- gate\nlocal b = \"q--\" --[[ load\n commit ]] c\n--[==[ zz ]==] d"
    out = scripts.strip_comments(lua)
    assert "'x -- y'" in out and '"q--"' in out
    assert not {"gate", "load", "commit", "zz"} & set(WORD.findall(out))
    assert {"a", "b", "c", "d"} <= set(WORD.findall(out))
    assert "local function open_reservation(" in scripts.source("settle")


def test_common_lua_may_hold_only_local_definitions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "_common.lua").write_text("local a = 1\nendpoint = 2\n")
    monkeypatch.setattr(scripts, "lua_dir", lambda: tmp_path)
    scripts.definitions.cache_clear()
    try:
        with pytest.raises(ValueError, match="only local definitions at top level"):
            scripts.definitions()
    finally:
        monkeypatch.undo()
        scripts.definitions.cache_clear()
    assert scripts.definitions()  # the real file again


def _run(r: redis.Redis, body: str, *keys: str) -> str:
    """EVAL of `body` under the wrapper, with its prelude: the error text, or ''."""
    try:
        r.eval(scripts.wrap(scripts.prelude(body) + "\n" + body), len(keys), *keys)
    except redis.exceptions.ResponseError as exc:
        return str(exc)
    return ""


def test_the_wrapper_sends_a_refusal_as_its_error_reply_and_passes_other_errors_on(
    redis_server: RedisProcess,
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    r.set("wrap:s", "text")
    # fail(): exactly 'LEDGER_<code> <msg>', the text the clients parse, nothing appended
    assert _run(r, "fail('BADARG', 'count must be an integer, got x')") == (
        "LEDGER_BADARG count must be an integer, got x"
    )
    assert _run(r, "local n = int_arg('x', 'count', 0, 9)\nreturn n") == (
        "LEDGER_BADARG count must be an integer written canonically (no sign on 0, no leading "
        "zero), got 'x'"
    )
    # A Redis command's error (its code too) and a Lua runtime error reach the client as
    # without the wrapper, but for the line Redis appends. These bodies use no
    # definition: the prelude is empty and the body starts on line 2 in both.
    bodies = (
        "return redis.call('INCR', KEYS[1])",
        "return redis.call('HGET', KEYS[1], 'f')",
        "local t = nil\nreturn t.x",
        "error({ err = 'X y' })",
    )
    for body in bodies:
        assert scripts.prelude(body) == ""
        bare = ""
        try:
            r.eval("\n" + body, 1, "wrap:s")
        except redis.exceptions.ResponseError as exc:
            bare = str(exc)
        wrapped = _run(r, body, "wrap:s")
        assert bare and wrapped.split(" script: ")[0] == bare.split(" script: ")[0]
    assert r.get("wrap:s") == b"text"
    r.delete("wrap:s")
