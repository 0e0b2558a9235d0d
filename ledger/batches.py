"""A batch of calls (``run_many``): its bound, which scripts to load first, which
calls to send again, and its results read in order."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

from ledger import protocol
from ledger.errors import BackendUnavailable, LedgerError, PermissionDenied, is_transient, translate
from ledger.protocol import Call

# At most this many calls in one run_many: Redis serves no one else while a batch runs.
MAX_BATCH = 1000


def collect(
    calls: Sequence[Call[Any]], raws: Sequence[object], return_exceptions: bool
) -> list[Any]:
    """The results of a batch, in order, from its raw replies (a reply, or the driver's
    error for that call), each read like a single call's. A refusal or error takes its
    call's place when return_exceptions; otherwise the first one is raised, once every
    reply is read (the other calls took effect). A permission refusal or an outage is
    raised whatever return_exceptions: it concerns the deployment, not one call."""
    out: list[Any] = []
    first: LedgerError | None = None
    decode = protocol.decode
    for call, raw in zip(calls, raws, strict=True):
        if type(raw) is bytes:  # a reply (the common case): read as below, with less to ask
            try:
                out.append(call.parse(decode(raw)))
            except (PermissionDenied, BackendUnavailable):
                raise
            except LedgerError as exc:
                first = first or exc
                out.append(exc)
            continue
        try:
            if isinstance(raw, LedgerError):
                raise raw
            if isinstance(raw, BaseException):
                raise translate(raw) from raw
            out.append(call.parse(protocol.decode(raw)))
        except (PermissionDenied, BackendUnavailable):
            raise
        except LedgerError as exc:
            first = first or exc
            out.append(exc)
    if first is not None and not return_exceptions:
        raise first
    return out


def _fenced_on_first(calls: Sequence[Call[Any]]) -> bool:
    """Whether every call after the first names its turn by the first's op id
    (``<epoch>@~<op id>``, :class:`~ledger.models.BegunBy`): then none of them can take
    effect before the first has (the script refuses it, changing nothing)."""
    if not calls[0].args:
        return False
    fence = f"@~{calls[0].args[0]!s}"
    # ('<version>:<epoch>@~<op id>!<owner token>': the token is no op id's character)
    return all(
        len(c.args) > 1 and str(c.args[1]).partition("!")[0].endswith(fence) for c in calls[1:]
    )


def batch_loads(batch: Sequence[Call[Any]]) -> list[str]:
    """The scripts to load inside a batch's transaction, before its calls: those of
    every session that the batch reaches with more than one script. Inside one EXEC
    the script cache cannot change, so all of a script's calls run or none does; a
    session reached by one script keeps its order when only the calls that met NOSCRIPT
    are sent again, and sessions are independent of each other. A session reached by
    several scripts could see a later call run before an earlier one: its scripts are
    loaded first (each SCRIPT LOAD sends the script's text, a few KB), unless its later
    calls are fenced on its first (a begin_turn and its turn's first calls): they cannot
    take effect before it, and are sent again after it (see :func:`batch_replies`)."""
    by_session: dict[str, list[Call[Any]]] = defaultdict(list)
    for c in batch:
        by_session[c.keys[0]].append(c)
    names = {
        c.script
        for calls in by_session.values()
        if len({c.script for c in calls}) > 1 and not _fenced_on_first(calls)
        for c in calls
    }
    return sorted(names)


def batch_replies(
    replies: Sequence[object],
    loaded: int,
    todo: Sequence[int],
    raws: list[object],
    batch: Sequence[Call[Any]],
) -> list[int]:
    """Store the calls' replies (after the `loaded` SCRIPT LOAD replies) in raws, and
    return the indices to send again once their scripts are loaded: those that met
    NOSCRIPT, and every later call of a session one of them reached (calls fenced on it,
    refused while it had not run). A transient error is raised: the whole batch is sent
    again, which its op ids make safe."""
    got = replies[loaded:] if loaded else replies
    if len(got) == len(todo) and all(type(r) is bytes for r in got):  # (no error among them)
        for i, reply in zip(todo, got, strict=True):
            raws[i] = reply
        return []
    missing: list[int] = []
    for i, reply in zip(todo, replies[loaded:], strict=True):
        if isinstance(reply, NoScriptError):
            missing.append(i)
        elif isinstance(reply, BaseException) and is_transient(reply):
            raise reply
        raws[i] = reply
    first = {batch[i].keys[0]: i for i in reversed(missing)}
    return [i for i in todo if i in missing or first.get(batch[i].keys[0], len(batch)) < i]
