"""Pure request building and reply parsing for every script: no I/O.

A :class:`Call` names a script, its KEYS and ARGV, and how to read its reply.
The sync and asyncio clients only differ in how they send a call.
"""

from __future__ import annotations

import functools
import re
import secrets
import struct
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ledger import schema
from ledger.errors import (
    AdmissionRefused,
    CeilingReached,
    ConfigurationError,
    ContextDrift,
    ContextDriftWarning,
    DamagedSession,
    FanoutRefused,
    InvalidArgument,
    UnknownScope,
    WorkingMemoryStarvation,
)
from ledger.keys import KeySpace, SessionKeys, check_scope, tenant_of
from ledger.models import (
    Admitted,
    AuditReport,
    BegunBy,
    CallCost,
    ChildDrawn,
    ChildOpened,
    Classification,
    Compaction,
    CompactionOutcome,
    Consumer,
    Deleted,
    DriftFlag,
    Expired,
    HeldItem,
    Item,
    Opened,
    PartitionCheck,
    Reconciled,
    Regime,
    Released,
    Reservation,
    ResetDone,
    ScopeBudget,
    ScopeSet,
    ScopeUsage,
    SessionBudget,
    Settled,
    Snapshot,
    SpanRecorded,
    StagedReset,
    ToolResult,
    ToolResultOutcome,
    TurnAborted,
    TurnFinished,
    TurnRenewed,
    TurnReport,
    TurnStarted,
    Usage,
    Voided,
)

T = TypeVar("T")
Reply = dict[str, str]

# The protocol version (docs/protocol.md#versions), defined here only: every call carries
# it (ARGV[2] '<version>:...' of a mutating call, ARGV[1] of a read), the scripts refuse a
# call of another one (LEDGER_VERSION, :class:`~ledger.errors.VersionMismatch`). Bumped by
# every change a client or script of the previous version would misread (KEYS, ARGV,
# a reply field's meaning, a stored field's name or meaning); `python tools/legend.py`
# writes it into _common.lua. 2: the owner token, the version itself, the layout field.
# 3: a budget scope's config and live counters packed, and the two-call turn (finish_turn;
# begin_turn, end_turn and admit_tool as they were) (docs/protocol.md#version-3).
# 4: a hard reset waits for an open turn's end (reset's wait, the staged reset rz, reset=
# in the replies of the calls that end a turn, whose KEYS name the content store and the
# summaries) (docs/protocol.md#version-4).
VERSION = 4
# The oldest stored layout these scripts read and write (a session without 'lv' is of
# layout 1): layout 2 only adds fields (lv, lk) that layout 1's scripts never read, so a
# fleet upgrades from 1 to 2 with both versions running (docs/operations.md#upgrades);
# protocol 3 stores what protocol 2 stores, so it keeps its layout (LAYOUT); protocol 4
# adds one field (rz) that protocols 2 and 3 never read, so it keeps it too.
OLDEST_LAYOUT = 1
# The stored layout of a session these scripts open (field 'lv') and the newest they read,
# bumped only when a session's fields change so that the previous release's scripts would
# misread them: a release whose protocol changes but whose sessions do not keeps it, so
# the previous release's processes keep serving the sessions this one opens during a
# rolling upgrade. 2: lv and lk (protocols 2 and 3 write the same session fields, and 4
# only adds rz, which the scripts of 2 and 3 leave alone).
LAYOUT = 2

ID_RE = re.compile(r"[A-Za-z0-9._:/@+=#-]{1,128}")


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One script invocation, ready to send, and the parser of its reply."""

    script: str
    keys: tuple[str, ...]
    args: tuple[str | bytes, ...]
    parse: Callable[[Reply], T]


def evalsha_args(call: Call[Any]) -> tuple[Any, ...]:
    """EVALSHA's numkeys, then the call's KEYS and ARGV each as the bytes sent: what
    redis-py's encoder makes of them (a str as UTF-8; ids, keys and numbers are ASCII,
    texts are bytes already), made in one pass instead of argument by argument."""
    keys = call.keys
    sent = _KEYS.get(keys)
    if sent is None:  # (a session's KEYS recur call after call: encoded once)
        if len(_KEYS) >= 1024:
            _KEYS.clear()
        sent = _KEYS[keys] = [k.encode() if isinstance(k, str) else k for k in keys]
    return (len(keys), *sent, *[a.encode() if isinstance(a, str) else a for a in call.args])


_KEYS: dict[tuple[str, ...], list[Any]] = {}  # KEYS as evalsha_args sends them


def utf8(text: object, what: str) -> bytes:
    """Text as the UTF-8 bytes a script receives; bytes as they are. A str that is not
    valid Unicode (a lone surrogate) is an InvalidArgument, not a driver error."""
    if isinstance(text, bytes):
        return text
    if not isinstance(text, str):
        raise InvalidArgument(f"{what} must be str or bytes, got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"{what} is not valid Unicode: {exc.reason} at character {exc.start}"
        ) from None


def check_id(value: object, what: str) -> str:
    """Validate an identifier locally (the scripts check again)."""
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise InvalidArgument(
            f"{what} must be 1-128 characters of [A-Za-z0-9._:/@+=#-], got {value!r}"
        )
    return value


def _num(value: object) -> str:
    # bool is an int subclass: send it as text so the script refuses it.
    return str(value) if type(value) is int else repr(value)


def decode(raw: object) -> Reply:
    """Split a script reply 'k=v|k=v' into a dict."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    out: Reply = {}
    for part in text.split("|"):
        k, _, v = part.partition("=")
        out[k] = v
    return out


def _ids(text: str) -> tuple[str, ...]:
    return tuple(text.split(",")) if text else ()


def _refusal(r: Reply) -> None:
    if r.get("status") != "refused":
        return
    if "shortfall" in r:
        raise WorkingMemoryStarvation(r)
    if r["reason"] == "fanout_guard":
        raise FanoutRefused(r)
    if r["reason"] == "ceiling_reached":
        raise CeilingReached(r)
    raise AdmissionRefused(
        reason=r["reason"],
        requested=int(r.get("requested", 0)),
        free=int(r.get("free", 0)),
        detail=r,
    )


def _pairs(text: str) -> tuple[tuple[Consumer, str], ...]:
    out = []
    for part in _ids(text):
        code, _, item = part.partition(":")
        out.append((Consumer.from_code(code), item))
    return tuple(out)


class Stamp(str):
    """ARGV[2] of a call made in a turn: '<epoch>@<turn>' (see :func:`stamp`)."""

    __slots__ = ()


Epoch = int | str  # an epoch, '*' (unfenced), or a Stamp


TOKEN_RE = re.compile(r"[0-9a-f]{16,64}")


def check_token(token: object) -> str:
    """An owner token: 16-64 lowercase hex digits (a handle's secret, see
    :func:`new_token`)."""
    if not isinstance(token, str) or not TOKEN_RE.fullmatch(token):
        raise InvalidArgument("an owner token must be 16-64 lowercase hex digits")
    return token


def new_token() -> str:
    """A fresh owner token: 128 random bits, known only to the handle that made it."""
    return secrets.token_hex(16)


def stamp(epoch: int, turn: int | BegunBy | None, token: str | None = None) -> Epoch:
    """ARGV[2] of a call (after the version): the epoch, and the turn the call belongs to
    when it is made in one ('<epoch>@<turn>', docs/protocol.md#turns): only calls of the
    open turn are accepted while a turn is open, and only with the owner token of the
    handle that began it ('<epoch>@<turn>!<token>'). A turn named by its begin
    (:class:`BegunBy`) is '<epoch>@~<op id>!<token>'."""
    if turn is None:
        return epoch
    end = "" if token is None else "!" + check_token(token)
    if isinstance(turn, BegunBy) and type(epoch) is int:
        return Stamp(f"{epoch}@~{check_id(turn.op_id, 'op id of the turn')}{end}")
    if type(epoch) is not int or type(turn) is not int or turn < 1:
        raise InvalidArgument(
            f"a turn stamp needs an int epoch and turn >= 1, got {epoch!r}@{turn!r}"
        )
    return Stamp(f"{epoch}@{turn}{end}")


def _mutating(
    script: str,
    keys: SessionKeys,
    own: Sequence[str],
    op_id: str,
    epoch: Epoch,
    body: Sequence[str | bytes],
    parse: Callable[[Reply], T],
) -> Call[T]:
    """A mutating script's call. Its KEYS: the session hash, the script's ``own`` keys,
    then the partition's tally and the two outcome hashes, always last. Its ARGV: the op
    id, the protocol version and the epoch (or turn stamp), '<version>:<epoch>', then
    ``body``."""
    check_id(op_id, "operation id")
    head = epoch if isinstance(epoch, Stamp) or epoch == "*" else _num(epoch)
    head = f"{VERSION}:{head}"
    layout = (keys.session, *own, keys.tally, keys.outcomes, keys.outcomes_old)
    return Call(script=script, keys=layout, args=(op_id, head, *body), parse=parse)


# A consumer's one-letter code in the scripts, by the Consumer or its name.
_CODE: dict[object, str] = {c: c.code for c in Consumer}


def _code(consumer: Consumer | str) -> str:
    """The consumer's code for a call; an unknown consumer is an InvalidArgument."""
    try:
        return _CODE[consumer]
    except (KeyError, TypeError):
        return Consumer.parse(consumer).code  # (raises InvalidArgument)


# --- open ---------------------------------------------------------------------------


def _opened(r: Reply) -> Opened:
    return Opened(created=r["created"] == "1", epoch=int(r["epoch"]), turn=int(r["turn"]))


def open_session(
    keys: SessionKeys, op_id: str, budget: SessionBudget, op_retention_ms: int
) -> Call[Opened]:
    cfg = budget.canonical_json()
    b = budget
    body = [
        str(x)
        for x in (
            b.window,
            b.system_prompt,
            b.tool_framing,
            b.working_memory_floor,
            b.min_memory,
            b.output_reserve,
            b.high_water_tokens,
            b.eviction_tokens,
            b.idle_ttl_seconds * 1000,
            op_retention_ms,
        )
    ]
    body += [budget.fingerprint(), cfg]
    released = "".join(sorted(c.code for c in b.release_each_turn)) or "-"
    body += (
        [released]
        + [
            str(x)
            for x in (
                b.spill_preview_tokens,
                b.spill_ttl_seconds * 1000,
                b.max_failed_compactions,
                b.rollup_turns,
                round(b.rollup_fraction * 1000),
                round(b.amplification_saturation * 1000),
                round(b.amplification_fragmentation * 1000),
                round(b.amplification_pathological * 1000),
                -1 if b.framing_tolerance is None else b.framing_tolerance,
            )
        ]
        + [str(b.compaction), str(b.compaction_min_gain_tokens)]
    )
    return _mutating("open", keys, keys.data, op_id, 0, body, _opened)


# --- admit / release ----------------------------------------------------------------


def _admitted(r: Reply) -> Admitted:
    _refusal(r)
    return Admitted(
        charged=int(r["charged"]),
        admitted=int(r["admitted"]),
        duplicates=int(r["duplicates"]),
        skipped=_ids(r["skipped"]),
        free=int(r["free"]),
        epoch=int(r["epoch"]),
        turn=int(r["turn"]),
    )


def admit(
    keys: SessionKeys,
    op_id: str,
    epoch: Epoch,
    consumer: Consumer | str,
    items: Sequence[Item],
    partial: bool = False,
    texts: Sequence[str | bytes] | None = None,
) -> Call[Admitted]:
    """``texts``: the items' texts, in order, written to the content store for the items
    admitted, in the same step (None: none written)."""
    if not items:
        raise InvalidArgument("admit needs at least one item")
    if not isinstance(items, (list, tuple)):
        raise InvalidArgument("items must be a list or tuple of Item")
    mode = ("prefix" if partial else "all") + ("+text" if texts is not None else "")
    body: list[str | bytes] = [_code(consumer), mode, str(len(items))]
    for it in items:
        if not isinstance(it, Item):
            raise InvalidArgument("items must be a list or tuple of Item")
        body += (check_id(it.id, "item id"), _num(it.tokens), _num(it.priority))
    if texts is not None:
        if len(texts) != len(items):
            raise InvalidArgument(f"{len(texts)} texts for {len(items)} items")
        try:  # a str's UTF-8 (utf8, inline), else utf8 says what is wrong
            body += [t.encode() if type(t) is str else utf8(t, "") for t in texts]
        except (UnicodeEncodeError, InvalidArgument):
            body += [
                utf8(t, f"the text of item {it.id}") for t, it in zip(texts, items, strict=True)
            ]
    return _mutating("admit", keys, (keys.content, keys.order), op_id, epoch, body, _admitted)


def _released(r: Reply) -> Released:
    return Released(
        released=int(r["released"]),
        count=int(r["count"]),
        missing=_ids(r["missing"]),
        free=int(r["free"]),
        epoch=int(r["epoch"]),
        turn=int(r["turn"]),
    )


def release(
    keys: SessionKeys, op_id: str, epoch: Epoch, consumer: Consumer | str, item_ids: Sequence[str]
) -> Call[Released]:
    if not isinstance(item_ids, (list, tuple)) or not item_ids:
        raise InvalidArgument("release needs a non-empty list or tuple of item ids")
    ids = [check_id(i, "item id") for i in item_ids]
    body = [_code(consumer), str(len(ids)), *ids]
    return _mutating("release", keys, (keys.order,), op_id, epoch, body, _released)


# --- two-phase reservations ---------------------------------------------------------


def _reserved(r: Reply, scopes: tuple[str, ...] = ()) -> Reservation:
    _refusal(r)
    return Reservation(
        id=r["reservation"],
        deadline_ms=int(r["deadline_ms"]),
        free=int(r["free"]),
        epoch=int(r["epoch"]),
        turn=int(r["turn"]),
        scopes=scopes,
    )


def scopes_of(keys: SessionKeys, scopes: Sequence[str]) -> tuple[str, ...]:
    """The budget scopes of a call of this session: the tenant its id names first (added
    when not given), then the scopes within it; their keys are the script's own keys
    (hash, holds index per scope). An InvalidArgument for a session of no tenant."""
    tenant = tenant_of(keys.session_id)
    if tenant is None:
        raise InvalidArgument(
            f"session {keys.session_id!r} names no tenant ('@<tenant>/<id>'): it has no scopes"
        )
    names = tuple(scopes)
    if not names or names[0] != tenant:
        names = (tenant, *names)
    return names


def _scope_layout(keys: SessionKeys, names: Sequence[str]) -> list[str]:
    """The keys of these scopes, named in the session's partition (checked by the
    script against the session's hash tag)."""
    tag = keys.session.split(":s:", 1)[0]
    out: list[str] = []
    for name in names:
        check_scope(name)
        out += [f"{tag}:t:{name}", f"{tag}:th:{name}"]
    return out


def reserve(
    keys: SessionKeys,
    op_id: str,
    epoch: Epoch,
    consumer: Consumer | str,
    reservation_id: str,
    tokens: int,
    lease_ms: int,
    cost: CallCost | None = None,
) -> Call[Reservation]:
    body = [
        keys.session_id,
        _code(consumer),
        check_id(reservation_id, "reservation id"),
        _num(tokens),
        _num(lease_ms),
    ]
    own = [keys.deadlines]
    names: tuple[str, ...] = ()
    if cost is not None:
        names = scopes_of(keys, cost.scopes)
        body += [
            check_id(cost.model, "model"),
            _num(cost.input),
            _num(cost.output),
            _num(cost.cached_input),
            str(len(names)),
            *names,
        ]
        own += _scope_layout(keys, names)
    return _mutating(
        "reserve", keys, own, op_id, epoch, body, functools.partial(_reserved, scopes=names)
    )


def _settled(r: Reply) -> Settled:
    _refusal(r)
    return Settled(
        reservation=r["reservation"],
        item=r["item"],
        charged=int(r["charged"]),
        free=int(r["free"]),
        epoch=int(r["epoch"]),
        turn=int(r["turn"]),
        billed_money=int(r["billed_money"]) if "billed_money" in r else None,
        over=int(r.get("over", 0)),
        over_money=int(r.get("over_money", 0)),
    )


def settle(
    keys: SessionKeys,
    op_id: str,
    epoch: Epoch,
    reservation_id: str,
    actual: int,
    item_id: str | None = None,
    priority: int = 0,
    billed: Usage | None = None,
    scopes: Sequence[str] = (),
) -> Call[Settled]:
    rid = check_id(reservation_id, "reservation id")
    item = rid if item_id is None else check_id(item_id, "item id")
    body = [keys.session_id, rid, _num(actual), item, _num(priority)]
    own = [keys.deadlines, keys.order]
    if billed is not None:
        names = scopes_of(keys, scopes)
        body += [_num(billed.input), _num(billed.output), _num(billed.cached_input)]
        body += [str(len(names)), *names]
        own += _scope_layout(keys, names)
    elif scopes:
        raise InvalidArgument("settling a reservation held in scopes needs the billed usage")
    return _mutating("settle", keys, own, op_id, epoch, body, _settled)


def _voided(r: Reply) -> Voided:
    return Voided(
        reservation=r["reservation"],
        released=int(r["released"]),
        free=int(r["free"]),
        epoch=int(r["epoch"]),
        turn=int(r["turn"]),
    )


def void(
    keys: SessionKeys, op_id: str, epoch: Epoch, reservation_id: str, scopes: Sequence[str] = ()
) -> Call[Voided]:
    body = [keys.session_id, check_id(reservation_id, "reservation id")]
    own = [keys.deadlines]
    if scopes:
        names = scopes_of(keys, scopes)
        body += [str(len(names)), *names]
        own += _scope_layout(keys, names)
    return _mutating("void", keys, own, op_id, epoch, body, _voided)


def _child_opened(r: Reply) -> ChildOpened:
    _refusal(r)
    return ChildOpened(
        reservation=r["reservation"],
        child=r["child"],
        floor=int(r["floor"]),
        free=int(r["free"]),
        epoch=int(r["epoch"]),
        turn=int(r["turn"]),
    )


def open_child(
    keys: SessionKeys, op_id: str, epoch: Epoch, reservation_id: str, child_id: str, floor: int
) -> Call[ChildOpened]:
    body = [
        keys.session_id,
        check_id(reservation_id, "reservation id"),
        check_id(child_id, "child id"),
        _num(floor),
    ]
    return _mutating("open_child", keys, (), op_id, epoch, body, _child_opened)


def _child_drawn(r: Reply) -> ChildDrawn:
    _refusal(r)
    return ChildDrawn(
        reservation=r["reservation"],
        child=r["child"],
        used=int(r["used"]),
        floor=int(r["floor"]),
        free=int(r["free"]),
        epoch=int(r["epoch"]),
        turn=int(r["turn"]),
    )


def draw_child(
    keys: SessionKeys, op_id: str, epoch: Epoch, reservation_id: str, child_id: str, tokens: int
) -> Call[ChildDrawn]:
    body = [
        keys.session_id,
        check_id(reservation_id, "reservation id"),
        check_id(child_id, "child id"),
        _num(tokens),
    ]
    return _mutating("draw_child", keys, (), op_id, epoch, body, _child_drawn)


_QUANTITIES = {"i": "input", "o": "output", "c": "cached_input", "$": "money"}
# A scope's packed fields cf and w (lua/_common.lua, SCOPE_CF and SCOPE_W).
SCOPE_CF, SCOPE_W = "<8qB", "<7q"


def _bytes(v: Any) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode("latin-1")


def scope_usage(
    name: str, fields: Mapping[Any, Any], deadlines: Sequence[Any], now_ms: int
) -> ScopeUsage:
    """Read a scope's hash (HGETALL) and its holds index (ZRANGE WITHSCORES) as at
    ``now_ms``: holds past their deadline are left out, as the next reserve's sweep
    leaves them."""
    lapsed = {
        "q:" + (m.decode() if isinstance(m, bytes) else str(m))
        for m, deadline in deadlines
        if deadline < now_ms
    }
    raw = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in fields.items()}
    packed = {k: raw.pop(k) for k in ("cf", "w") if k in raw}
    f = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in raw.items()}
    kinds = ("input", "output", "cached_input", "tokens", "money")
    if "cf" in packed:  # (struct '<8qB', as _common.lua packs it: -1 for no ceiling)
        cf = struct.unpack(SCOPE_CF, _bytes(packed["cf"]))
        window, bucket = cf[0], cf[1]
        caps = dict(zip(kinds, cf[3:8], strict=True))
        counted_kinds = "".join(x for bit, x in ((1, "i"), (2, "o"), (4, "c")) if cf[8] & bit)
    elif "L" in f:  # a scope of layout 2 (set_scope again moves it to layout 3)
        window, bucket = int(f["L"]), int(f["G"])
        caps = {q: int(f.get("c_" + x, -1)) for x, q in zip("ioct$", kinds, strict=True)}
        counted_kinds = f.get("k", "")
    else:
        raise UnknownScope(f"scope {name} has no ceilings set (set_scope)")
    live = [int(f.get(x, -1 if x == "wb" else 0)) for x in ("wb", "wi", "wo", "wc", "w$")]
    if "w" in packed:
        live = list(struct.unpack(SCOPE_W, _bytes(packed["w"]))[:5])
    cur = now_ms // bucket
    first = cur - window // bucket + 1
    charged = dict.fromkeys(_QUANTITIES.values(), 0)
    held = dict.fromkeys(_QUANTITIES.values(), 0)
    buckets: dict[int, dict[str, int]] = {}
    for k, v in f.items():
        b, _, q = k.partition(":")
        if not b.isdigit():
            continue
        if q in _QUANTITIES and first <= int(b) <= cur:
            charged[_QUANTITIES[q]] += int(v)
        if q[:1] == "u" and q[1:] in _QUANTITIES:
            buckets.setdefault(int(b) * bucket, {})[_QUANTITIES[q[1:]]] = int(v)
        elif q in ("xt", "x$"):
            buckets.setdefault(int(b) * bucket, {})["over" if q == "xt" else "over_money"] = int(v)
    if first <= live[0] <= cur:
        for q, amount in zip(_QUANTITIES.values(), live[1:5], strict=True):
            charged[q] += amount
    holds = 0
    for k, v in f.items():
        if not k.startswith("q:"):
            continue
        p = [int(x) for x in v.split("|")]
        for q, amount in zip(("input", "output", "cached_input", "money"), p[1:5], strict=True):
            if k in lapsed and first <= p[0] <= cur:
                charged[q] -= amount
            elif first <= p[0] <= cur:
                held[q] += amount
        holds += k not in lapsed
    remaining: dict[str, int] = {}
    ceilings = {q: cap for q, cap in caps.items() if cap >= 0}
    for q, cap in ceilings.items():
        if q != "tokens":
            remaining[q] = max(cap - charged[q], 0)
    if "tokens" in ceilings:
        counted = [_QUANTITIES[x] for x in counted_kinds]
        remaining["tokens"] = max(ceilings["tokens"] - sum(charged[q] for q in counted), 0)
    return ScopeUsage(
        scope=name,
        now_ms=now_ms,
        window_ms=window,
        bucket_ms=bucket,
        charged=charged,
        held=held,
        remaining=remaining,
        buckets=dict(sorted(buckets.items())),
        open_holds=holds,
        refused=int(f.get("nr", 0)),
        over=int(f.get("ot", 0)),
        over_money=int(f.get("om", 0)),
        ceilings=ceilings,
    )


def set_scope(space: KeySpace, op_id: str, name: str, budget: ScopeBudget) -> Call[ScopeSet]:
    """Set a budget scope's window, ceilings and price table (the operator's call)."""
    sk = space.scope(name)
    tenant = check_scope(name)
    if budget.prices and tenant != name:  # the scripts read the tenant's table only
        raise InvalidArgument(
            f"scope {name!r} is within tenant {tenant!r}: calls are priced by the tenant's "
            "price table (set prices= on the tenant)"
        )
    if budget.cents is not None and not budget.prices and tenant == name:
        raise ConfigurationError("a money ceiling (cents) needs a price table")

    def parse(r: Reply) -> ScopeSet:
        return ScopeSet(scope=sk.name, prices=int(r["prices"]))

    for model in budget.prices:
        if model != "*":
            check_id(model, "model")
    return Call(
        "set_scope",
        (sk.hash,),
        (str(VERSION), check_id(op_id, "operation id"), *budget.wire()),
        parse,
    )


def _expired(r: Reply) -> Expired:
    rolled = int(r.get("rolled_back") or 0)
    return Expired(
        expired=int(r["expired"]),
        released=int(r["released"]),
        pending=_ids(r["pending"]),
        rolled_back=rolled or None,
    )


# The member of a partition's deadline index that stands for a session's turn lease
# ('<session>|~'): expire rolls the turn back once its lease has lapsed.
LEASE_MEMBER = "~"


def expire(keys: SessionKeys, op_id: str, reservation_ids: Sequence[str]) -> Call[Expired]:
    """Release these reservations where their deadline has passed; the id '~' stands for
    the session's turn lease (the turn is rolled back once the lease has lapsed)."""
    rids = [r if r == LEASE_MEMBER else check_id(r, "reservation id") for r in reservation_ids]
    body = [keys.session_id, str(len(rids)), *rids]
    return _mutating("expire", keys, (keys.deadlines,), op_id, "*", body, _expired)


def worker_check(deadlines: str, jobs: str, group: str, idle_ms: int) -> Call[PartitionCheck]:
    """A partition's earliest lease deadline and whether a job is pending ``idle_ms``
    (read-only, no op id): what the worker asks of each partition on a cluster."""

    def parse(r: Reply) -> PartitionCheck:
        due = int(r["due"])
        return PartitionCheck(due_ms=None if due < 0 else due, idle=r["idle"] == "1")

    return Call(
        script="worker_check",
        keys=(deadlines, jobs),
        args=(str(VERSION), check_id(group, "group"), _num(idle_ms)),
        parse=parse,
    )


def reset(
    keys: SessionKeys, op_id: str, epoch: Epoch, reason: str, wait_ms: int = 0
) -> Call[ResetDone]:
    """``wait_ms`` 0: applied now, an open turn ending with it; above 0: a live open turn's
    end is waited for that long (the reset is staged, ``ResetDone.staged``)."""

    def parse(r: Reply) -> ResetDone:
        if r.get("status") == "staged":
            return ResetDone(
                epoch=int(r["epoch"]), dropped=0, released=0, staged=True,
                turn=int(r["turn"]), due_ms=int(r["due"]),
            )  # fmt: skip
        return ResetDone(
            epoch=int(r["epoch"]), dropped=int(r["dropped"]), released=int(r["released"])
        )

    if type(wait_ms) is not int or not 0 <= wait_ms <= 86_400_000:
        raise InvalidArgument(f"reset wait must be 0..86400000 ms, got {wait_ms!r:.40}")
    body = [keys.session_id, check_id(reason, "reason"), _num(wait_ms)]
    return _mutating(
        "reset", keys, (keys.deadlines, keys.content, keys.compacted), op_id, epoch,
        body, parse,
    )  # fmt: skip


# --- turns and the rules (docs/rules.md) --------------------------------------------


# The members of a reply's enums by their wire string (an unknown one: the enum raises).
_REGIMES: dict[str, Regime] = {m.value: m for m in Regime}
_CLASSES: dict[str, Classification] = {m.value: m for m in Classification}
_FLAGS: dict[str, DriftFlag] = {m.value: m for m in DriftFlag}


def _turn_started(r: Reply) -> TurnStarted:
    _refusal(r)
    rolled = int(r.get("rolled_back") or 0)
    return TurnStarted(
        regime=_REGIMES.get(r["regime"]) or Regime(r["regime"]),
        turn=int(r["turn"]),
        residual=int(r["residual"]),
        need=int(r["need"]),
        utilization=int(r["utilization"]) / 1000,
        reclaimed=_pairs(r["reclaimed"]),
        rotated=int(r["rotated"]),
        released=int(r["released"]),
        compaction_due=r["compaction_due"] == "1",
        rollup_hint=r["rollup"] == "1",
        free=int(r["free"]),
        epoch=int(r["epoch"]),
        summaries=_ids(r.get("summaries", "")),
        dropped=_pairs(r.get("dropped", "")),
        lease_until_ms=int(r.get("lease") or 0),
        rolled_back=rolled or None,
        mark=r.get("mark") or None,
        landed=r.get("landed") or None,
        reset=_epoch_or_none(r),
    )


def _epoch_or_none(r: Reply) -> int | None:
    """reset=: the new epoch when a staged hard reset applied with the call, else None."""
    got = r.get("reset")
    return int(got) if got else None


LEASE_MAX_MS = 86_400_000


def _lease(lease_ms: object) -> str:
    if type(lease_ms) is not int or not 1 <= lease_ms <= LEASE_MAX_MS:
        raise InvalidArgument(f"a turn lease must be 1..{LEASE_MAX_MS} ms, got {lease_ms!r}")
    return str(lease_ms)


def begin_turn(
    keys: SessionKeys,
    op_id: str,
    epoch: int,
    working_set: int,
    output_reserve: int | None,
    owner: str,
    lease_ms: int,
    takeover: bool = False,
    await_compaction: bool = False,
    token: str | None = None,
) -> Call[TurnStarted]:
    """``await_compaction``: refuse the turn (``CompactionPending``, nothing changed) while
    a compaction is pending, unless one is staged (it lands with this call). The call names
    the summaries hash and the content store, which a staged compaction writes as it lands.
    ``token``: the owner token of the turn (by default a fresh one): every call into the
    turn must carry it, and a begin_turn of the same owner ends its open turn only with it."""
    body = [
        _num(working_set),
        "-" if output_reserve is None else _num(output_reserve),
        keys.session_id,
        check_id(owner, "turn owner"),
        _lease(lease_ms),
        "1" if takeover else "0",
    ]
    if await_compaction:
        body.append("1")
    extra = (keys.jobs, keys.deadlines, keys.compacted, keys.content, keys.order)
    if type(epoch) is not int:
        raise InvalidArgument(f"begin_turn needs an int epoch, got {epoch!r}")
    head = Stamp(f"{epoch}!{check_token(new_token() if token is None else token)}")
    return _mutating("begin_turn", keys, extra, op_id, head, body, _turn_started)


def abort_turn(
    keys: SessionKeys, op_id: str, epoch: int, turn: int, token: str | None = None
) -> Call[TurnAborted]:
    def parse(r: Reply) -> TurnAborted:
        rolled = int(r["rolled_back"])
        return TurnAborted(
            rolled_back=rolled or None,
            turn=int(r["turn"]),
            free=int(r["free"]),
            epoch=int(r["epoch"]),
            reset=_epoch_or_none(r),
        )

    return _mutating(
        "abort_turn",
        keys,
        (keys.deadlines, keys.content, keys.compacted),
        op_id,
        stamp(epoch, turn, token),
        [keys.session_id],
        parse,
    )


def renew_turn(
    keys: SessionKeys, op_id: str, epoch: int, turn: int, lease_ms: int, token: str | None = None
) -> Call[TurnRenewed]:
    def parse(r: Reply) -> TurnRenewed:
        return TurnRenewed(
            turn=int(r["turn"]), lease_until_ms=int(r["lease"]), epoch=int(r["epoch"])
        )

    return _mutating(
        "renew_turn",
        keys,
        (keys.deadlines,),
        op_id,
        stamp(epoch, turn, token),
        [keys.session_id, _lease(lease_ms)],
        parse,
    )


def _span(r: Reply) -> SpanRecorded:
    _refusal(r)
    return SpanRecorded(
        turn=int(r["turn"]),
        spans=int(r["spans"]),
        span_input=int(r["span_input"]),
        ratio=int(r["ratio"]) / 1000,
    )


def record_span(
    keys: SessionKeys,
    op_id: str,
    epoch: Epoch,
    turn: int,
    kind: str,
    input_tokens: int,
    output_tokens: int,
    token: str | None = None,
) -> Call[SpanRecorded]:
    body = [_num(turn), check_id(kind, "span kind"), _num(input_tokens), _num(output_tokens)]
    head = _turn_stamp(epoch, turn, token)
    return _mutating("record_span", keys, (), op_id, head, body, _span)


def _turn_stamp(epoch: Epoch, turn: object, token: str | None = None) -> Epoch:
    """The stamp of a call that names its turn (record_span, end_turn); a turn that is no
    int >= 1 is left out, for the script to refuse it."""
    if isinstance(epoch, str) or type(epoch) is not int or type(turn) is not int or turn < 1:
        return epoch
    return stamp(epoch, turn, token)


def _report(r: Reply) -> TurnReport:
    return TurnReport(
        turn=int(r["turn"]),
        ratio=int(r["ratio"]) / 1000,
        classification=_CLASSES.get(r["class"]) or Classification(r["class"]),
        utilization=int(r["utilization"]) / 1000,
        utilization_delta=int(r["utilization_delta"]) / 1000,
        spans=int(r["spans"]),
        span_input=int(r["span_input"]),
        compaction_due=r["compaction_due"] == "1",
        rollup_hint=r["rollup"] == "1",
        epoch=int(r["epoch"]),
        occupancy=int(r["occupancy"]),
        drift=int(r["drift"]),
        tolerance=None if int(r["tolerance"]) < 0 else int(r["tolerance"]),
        flag=_FLAGS.get(r["flag"]) or DriftFlag(r["flag"]),
        reset=_epoch_or_none(r),
    )


def drift_message(r: TurnReport, prompt: int) -> str:
    if r.flag == DriftFlag.OVER_WINDOW:
        return (
            f"turn {r.turn}: the real prompt of {prompt} tokens is larger than the window "
            f"(occupancy {r.occupancy}, drift {r.drift:+d})"
        )
    return (
        f"turn {r.turn}: the real prompt of {prompt} tokens differs from the ledger's "
        f"occupancy {r.occupancy} by {r.drift:+d} tokens, beyond the framing tolerance "
        f"{r.tolerance}: something is in the prompt that the ledger does not hold (or the "
        "reverse); reconcile the ledger to the prompt"
    )


def end_turn(
    keys: SessionKeys,
    op_id: str,
    epoch: Epoch,
    turn: int,
    final_prompt_tokens: int,
    p99_trend: int,
    drift_action: str = "warn",
    mark: str | None = None,
    token: str | None = None,
) -> Call[TurnReport]:
    body = [
        _num(turn),
        _num(final_prompt_tokens),
        _num(p99_trend),
        keys.session_id,
        "-" if mark is None else check_id(mark, "commit mark"),
    ]

    def parse(r: Reply) -> TurnReport:
        report = _report(r)
        if report.flagged:
            msg = drift_message(report, report.occupancy + report.drift)
            if drift_action == "raise":
                raise ContextDrift(report, msg)
            warnings.warn(ContextDriftWarning(report, msg), stacklevel=4)
        return report

    return _mutating(
        "end_turn",
        keys,
        (keys.jobs, keys.deadlines, keys.content, keys.compacted),
        op_id,
        _turn_stamp(epoch, turn, token),
        body,
        parse,
    )


def finish_turn(
    keys: SessionKeys,
    op_id: str,
    epoch: int,
    turn: int,
    final_prompt_tokens: int,
    tools: Sequence[tuple[str, int, bytes | str]],
    token: str,
    p99_trend: int = 0,
    drift_action: str = "warn",
    mark: str | None = None,
    keep_text: bool = False,
) -> Call[TurnFinished]:
    """The end of a two-call turn: its tool results (call id, tokens, content) admitted
    whole, then the turn ended with the real prompt (counting them whole), in one step.
    A result that does not go in whole refuses the call (``AdmissionRefused``, reason
    ``not_whole``): nothing changed, the turn still open."""
    if type(tools) not in (list, tuple) and (
        isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence)
    ):
        raise InvalidArgument(
            f"tools must be a list of (call id, tokens, content), got {tools!r:.80}"
        )
    body: list[str | bytes] = [
        _num(turn),
        _num(final_prompt_tokens),
        _num(p99_trend),
        keys.session_id,
        "-" if mark is None else check_id(mark, "commit mark"),
        "1" if keep_text else "0",
        _num(len(tools)),
    ]
    for tool in tools:
        if (
            type(tool) not in (list, tuple)
            and (not isinstance(tool, Sequence) or isinstance(tool, (str, bytes)))
        ) or len(tool) != 3:
            raise InvalidArgument(
                f"a tool result must be (call id, tokens, content), got {tool!r:.80}"
            )
        cid, tokens, content = tool
        body += [check_id(cid, "tool-call id"), _num(tokens), utf8(content, "a tool result")]

    def parse(r: Reply) -> TurnFinished:
        _refusal(r)
        report = _report(r)
        if report.flagged:
            msg = drift_message(report, report.occupancy + report.drift)
            if drift_action == "raise":
                raise ContextDrift(report, msg)
            warnings.warn(ContextDriftWarning(report, msg), stacklevel=4)
        tools_out = []
        for part in _ids(r["tools"]):
            charged, _, cid = part.partition(";")
            tools_out.append((cid, int(charged)))
        return TurnFinished(report=report, tools=tuple(tools_out), free=int(r["free"]))

    return _mutating(
        "finish_turn",
        keys,
        (keys.jobs, keys.deadlines, keys.content, keys.compacted, keys.order),
        op_id,
        _turn_stamp(epoch, turn, token),
        body,
        parse,
    )


def _reconciled(r: Reply) -> Reconciled:
    _refusal(r)
    return Reconciled(
        added=int(r["added"]),
        resized=int(r["resized"]),
        kept=int(r["kept"]),
        removed=_pairs(r["removed"]),
        delta=int(r["delta"]),
        free=int(r["free"]),
        epoch=int(r["epoch"]),
        turn=int(r["turn"]),
    )


def reconcile(
    keys: SessionKeys,
    op_id: str,
    epoch: Epoch,
    items: Mapping[Any, Sequence[Item]],
) -> Call[Reconciled]:
    """Set each named consumer's items to exactly the given ones (see reconcile.lua)."""
    if not isinstance(items, Mapping) or not items:
        raise InvalidArgument("reconcile needs a mapping of consumer to a list of Item")
    codes: list[str] = []
    body: list[str] = []
    total = 0
    for consumer, its in items.items():
        c = Consumer.parse(consumer)
        if c.code in codes:
            raise InvalidArgument(f"consumer {c.value} is named twice")
        codes.append(c.code)
        if not isinstance(its, (list, tuple)):
            raise InvalidArgument(f"items of {c.value} must be a list or tuple of Item")
        for it in its:
            if not isinstance(it, Item):
                raise InvalidArgument(f"items of {c.value} must be Item, got {type(it).__name__}")
            body += (c.code, check_id(it.id, "item id"), _num(it.tokens), _num(it.priority))
            total += 1
    if total > 1000:
        raise InvalidArgument(f"reconcile takes at most 1000 items, got {total}")
    args = ["".join(codes), str(total), *body]
    return _mutating("reconcile", keys, (), op_id, epoch, args, _reconciled)


def _compaction(r: Reply) -> Compaction:
    _refusal(r)
    outcome = CompactionOutcome(r["outcome"])
    return Compaction(
        compacted=outcome == CompactionOutcome.COMPACTED,
        outcome=outcome,
        occupancy=int(r["occupancy"]),
        high_water_mark=int(r["high_water"]),
        dropped=int(r["dropped"]),
        summary=int(r["summary"]),
        missing=_pairs(r["missing"]),
        failures=int(r["failures"]),
        escalated=r["escalated"] == "1",
        free=int(r["free"]),
        epoch=int(r["epoch"]),
        turn=int(r["turn"]),
        gain=int(r.get("gain", 0)),
    )


Replaced = str | tuple[Consumer | str, str] | tuple[Consumer | str, str, int]


def compact(
    keys: SessionKeys,
    op_id: str,
    epoch: Epoch,
    replaced: Sequence[Replaced],
    summary: Item | None,
    job: str = "-",
    summary_text: str | None = None,
    read: int | None = None,
) -> Call[Compaction]:
    """``replaced``: working-memory item ids, or (consumer, id) pairs for history held
    by other consumers (stale retrieval chunks, old tool results), or (consumer, id, seq)
    to replace only the version of the item admitted with that sequence number (the one
    the compactor read: a version admitted since stays). ``job``: the stream entry id of
    the compaction job being committed (a worker), deleted in the same step; when it is
    gone already the call changes nothing (outcome ``already``); while a turn is open the
    plan is staged (outcome ``staged``) and lands at the session's next begin_turn. '-' for
    an agent's own compaction. ``summary_text``: stored with the effect, for the turn the
    summary is delivered to and for the next compaction (the worker sends it). ``read``:
    the newest sequence number of the history the compactor read; the items admitted after
    it are not held against the post-condition (None: every item is). A summary replacing
    itself in the open turn is a recount (outcome ``recounted``): it takes the tokens given,
    no compaction judged."""
    if not isinstance(replaced, (list, tuple)):
        raise InvalidArgument("replaced must be a list or tuple of item ids or (consumer, id)")
    refs = []
    for r in replaced:
        if isinstance(r, tuple) and len(r) in (2, 3):
            ref = schema.content_field(Consumer.parse(r[0]).code, check_id(r[1], "item id"))
            if len(r) == 3:
                seq = r[2]
                if type(seq) is not int or seq < 1:
                    raise InvalidArgument(
                        f"a replaced item's sequence must be an int >= 1, got {seq!r}"
                    )
                ref += f"|{seq}"
            refs.append(ref)
        else:
            refs.append(f"w:{check_id(r, 'item id')}")
    if summary is not None and not isinstance(summary, Item):
        raise InvalidArgument("summary must be an Item or None")
    sid = check_id(summary.id, "summary item id") if summary else "-summary-"
    body: list[str | bytes] = [
        keys.session_id, sid, _num(summary.tokens) if summary else "0", str(len(refs)), *refs
    ]  # fmt: skip
    body.append(check_entry_id(job))
    if summary_text is not None and summary is None:
        raise InvalidArgument("a summary text needs a summary item")
    body.append(b"" if summary_text is None else utf8(summary_text, "the summary text"))
    if read is not None:
        if type(read) is not int or not 0 <= read <= 10**15:
            raise InvalidArgument(f"the history read must be an int in 0..1e15, got {read!r}")
        body.append(str(read))
    return _mutating(
        "compact", keys, (keys.jobs, keys.content, keys.compacted), op_id, epoch,
        body, _compaction,
    )  # fmt: skip


_ENTRY_ID_RE = re.compile(r"(0|[1-9]\d{0,19})-(0|[1-9]\d{0,19})")  # canonical decimals


def check_entry_id(value: object) -> str:
    """A stream entry id '<ms>-<seq>' (each an unsigned 64-bit number), or '-'."""
    m = _ENTRY_ID_RE.fullmatch(value) if isinstance(value, str) else None
    if value == "-" or (m and max(int(m[1]), int(m[2])) < 1 << 64):
        return str(value)
    raise InvalidArgument(f"job entry id must be '<ms>-<seq>' or '-', got {value!r}")


def _tool(r: Reply) -> ToolResult:
    _refusal(r)
    return ToolResult(
        outcome=ToolResultOutcome(r["outcome"]),
        item=r["item"],
        charged=int(r["charged"]),
        tokens=int(r["tokens"]),
        preview_tokens=int(r["preview"]),
        evicted=_pairs(r["evicted"]),
        free=int(r["free"]),
        epoch=int(r["epoch"]),
        turn=int(r["turn"]),
    )


def admit_tool(
    keys: SessionKeys,
    op_id: str,
    epoch: Epoch,
    call_id: str,
    tokens: int,
    content: bytes | str,
    keep_text: bool = False,
) -> Call[ToolResult]:
    """``keep_text``: the result, admitted or spilled, also gets its content in the content store
    (for a compactor), in the same step."""
    cid = check_id(call_id, "tool-call id")
    if not isinstance(content, (bytes, str)):
        raise InvalidArgument("content must be bytes or str")
    body: list[str | bytes] = [cid, _num(tokens), utf8(content, "the tool result")]
    body.append("1" if keep_text else "0")
    return _mutating(
        "admit_tool",
        keys,
        (keys.content, keys.spills, keys.spilled, keys.order),
        op_id,
        epoch,
        body,
        _tool,
    )


def read_spill(keys: SessionKeys, call_id: str) -> Call[bytes | None]:
    """The content of a spilled tool result while its spill TTL lasts. Its reply is the
    content itself, not ``k=v`` pairs: ``Ledger.read_spill`` sends it and takes the reply
    as it is (``Ledger.run`` would refuse it)."""
    cid = check_id(call_id, "tool-call id")
    return Call(
        script="read_spill",
        keys=(keys.session, keys.spills, keys.spilled),
        args=(str(VERSION), cid),
        parse=_not_pairs,
    )


def _not_pairs(r: Reply) -> bytes | None:
    raise InvalidArgument("read_spill answers the content itself: use Ledger.read_spill")


# --- close, snapshot, audit ---------------------------------------------------------


def delete(keys: SessionKeys, op_id: str, epoch: Epoch) -> Call[Deleted]:
    return _mutating(
        "delete",
        keys,
        (keys.deadlines, *keys.data, keys.order),
        op_id,
        epoch,
        [keys.session_id],
        lambda r: Deleted(deleted=r["deleted"] == "1"),
    )


_PER = {schema.HELD: "used", schema.RESERVED: "reserved", schema.ITEM_COUNT: "items"}


def _is_int(v: str) -> bool:
    try:
        int(v)
    except ValueError:
        return False
    return True


def _snapshot(r: Reply) -> Snapshot:
    owner = r.pop(schema.TURN_OWNER, "") or None
    mark = r.pop(schema.COMMIT_MARK, "") or None
    reason = r.pop(schema.SNAPSHOT_RESET_REASON, "")
    try:
        n = {k: int(v) for k, v in r.items()}
    except ValueError:
        field, value = next((k, v) for k, v in r.items() if not _is_int(v))
        raise DamagedSession(field, value) from None
    per = {name: {c: n[f.of(c.code)] for c in Consumer} for f, name in _PER.items()}
    return Snapshot(
        now_ms=n[schema.SNAPSHOT_NOW],
        epoch=n[schema.EPOCH],
        turn=n[schema.TURN],
        window=n[schema.WINDOW],
        system_prompt=n[schema.SYSTEM_PROMPT],
        tool_framing=n[schema.TOOL_FRAMING],
        output_reserve=n[schema.OUTPUT_RESERVE],
        working_memory_floor=n[schema.WORKING_FLOOR],
        min_memory=n[schema.MEMORY_FLOOR],
        high_water_mark=n[schema.HIGH_WATER],
        eviction_threshold=n[schema.EVICTION_THRESHOLD],
        free=n[schema.FREE],
        used=per["used"],
        reserved=per["reserved"],
        items=per["items"],
        open_reservations=n[schema.OPEN_RESERVATIONS],
        refusals=n[schema.COUNTER.of("refused")],
        expirations=n[schema.COUNTER.of("expired")],
        compaction_pending=n[schema.COMPACTION_PENDING] == 1,
        failed_compactions=n[schema.FAILED_COMPACTIONS],
        raw=n,
        last_prompt=n[schema.LAST_PROMPT],
        drift=n[schema.DRIFT],
        drift_flagged=n[schema.DRIFT_FLAGGED] == 1,
        framing_tolerance=None if n[schema.FRAMING_TOLERANCE] < 0 else n[schema.FRAMING_TOLERANCE],
        turn_owner=owner,
        lease_until_ms=n.get(schema.LEASE_UNTIL, 0),
        last_ended_turn=n.get(schema.LAST_ENDED_TURN, 0),
        compacting=n.get(schema.SNAPSHOT_COMPACTING, 0) == 1,
        mark=mark,
        reset_staged=StagedReset(reason=reason, due_ms=n[schema.SNAPSHOT_RESET_DUE])
        if reason
        else None,
    )


def snapshot(keys: SessionKeys) -> Call[Snapshot]:
    return Call(
        script="snapshot",
        keys=(keys.session, keys.compacted),
        args=(str(VERSION),),
        parse=_snapshot,
    )


def audit(keys: SessionKeys) -> Call[AuditReport]:
    def parse(r: Reply) -> AuditReport:
        problems = tuple(p for p in r.get("problems", "").split(";") if p)
        return AuditReport(
            session_id=keys.session_id,
            clean=r["status"] == "clean",
            problems=problems,
            overdue=_ids(r["overdue"]),
            now_ms=int(r["now"]),
        )

    return Call(script="audit", keys=(keys.session,), args=(str(VERSION),), parse=parse)


def committed_items(fields: Mapping[Any, Any]) -> list[HeldItem]:
    """The items of a session hash (from HGETALL) that its committed turns hold, oldest
    first: while a turn is open (field lo), the items that turn added (its number) are
    left out, as a rollback would remove them."""

    norm = {schema.text(k): v for k, v in fields.items()}
    items = held_items(fields)
    if schema.TURN_OWNER not in norm:
        return items
    open_turn = int(schema.text(norm.get(schema.TURN, 0)))
    return [it for it in items if it.turn != open_turn]


def held_items(fields: Mapping[Any, Any]) -> list[HeldItem]:
    """The items in a session hash (from HGETALL), oldest first."""
    out = []
    for k, v in fields.items():
        name = k.decode() if isinstance(k, bytes) else k
        if not name.startswith("i:"):
            continue
        _, code, item = name.split(":", 2)
        text = schema.text(v)
        tokens, turn, prio, seq = (int(x) for x in text.split("|"))
        out.append(
            HeldItem(
                consumer=Consumer.from_code(code),
                id=item,
                tokens=tokens,
                turn=turn,
                priority=prio,
                seq=seq,
            )
        )
    return sorted(out, key=lambda it: it.seq)
