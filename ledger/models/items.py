"""Items and reservations: what a session holds and the results of the calls that change
it (admit, release, reserve, settle, void, expire, the children of a reservation, reset,
delete)."""

from __future__ import annotations

from dataclasses import dataclass

from ledger.models.enums import Consumer

# What ``ledger.models`` (and so ``ledger``) exports of this module: its classes.
__all__ = [
    "Item",
    "BegunBy",
    "HeldItem",
    "Opened",
    "Admitted",
    "Released",
    "Reservation",
    "Settled",
    "CallCost",
    "Usage",
    "ChildOpened",
    "ChildDrawn",
    "Voided",
    "Expired",
    "ResetDone",
    "Deleted",
]


@dataclass(frozen=True, slots=True)
class Item:
    """One named allocation: a chunk id, a tool-call id, a working-memory turn."""

    id: str
    tokens: int
    priority: int = 0


@dataclass(frozen=True, slots=True)
class BegunBy:
    """A turn named by the op id of the ``begin_turn`` call that opens it: the ``turn`` of
    calls sent in one batch with that call, after it, before the turn's number is known
    (``ledger.run_many([begin, admit(..., turn=BegunBy(begin_op))])``). Such a call is of
    the turn when that ``begin_turn`` opened it, else ``TurnLost`` (nothing changed)."""

    op_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldItem:
    """An item as the ledger holds it."""

    consumer: Consumer
    id: str
    tokens: int
    turn: int
    priority: int
    seq: int


@dataclass(frozen=True, slots=True)
class Opened:
    created: bool
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """Outcome of an admission: what was charged, and what was not."""

    charged: int
    admitted: int
    duplicates: int
    skipped: tuple[str, ...]
    free: int
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Released:
    released: int
    count: int
    missing: tuple[str, ...]
    free: int
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    id: str
    deadline_ms: int
    free: int
    epoch: int
    turn: int
    scopes: tuple[str, ...] = ()
    """The budget scopes the reservation holds a model call's worst case in (none: the
    session's window only); settle and void name them again."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settled:
    reservation: str
    item: str
    charged: int
    free: int
    epoch: int
    turn: int
    billed_money: int | None = None
    """With scopes: the call's billed usage priced by the tenant's table, in micro-cents."""
    over: int = 0
    """Tokens billed past what the reservation held: charged all the same (and counted in
    each scope's ``ot``), never dropped."""
    over_money: int = 0
    """Micro-cents billed past what the reservation held."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CallCost:
    """A model call's worst case, held in budget scopes with the reservation: the
    prompt the ledger admitted (``input`` uncached, ``cached_input`` read from the
    provider's cache) and its output reserve (``output``), priced as ``model``.
    ``scopes``: the session's tenant first (by default the tenant its id names), then
    scopes within it ('<tenant>/<name>')."""

    model: str
    input: int
    output: int
    cached_input: int = 0
    scopes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """What the provider billed for a call, settled into the scopes of its
    reservation."""

    input: int
    output: int
    cached_input: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildOpened:
    """``open_child``: a child drawing from the reservation, its floor held for it;
    ``free``: what the pool has left past every floor and every draw past a floor."""

    reservation: str
    child: str
    floor: int
    free: int
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildDrawn:
    """``draw_child``: the child's tokens drawn so far; ``free``: what it may still draw."""

    reservation: str
    child: str
    used: int
    floor: int
    free: int
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Voided:
    reservation: str
    released: int
    free: int
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Expired:
    """``expire``: reservations released past their deadline, and the turn rolled back
    when its lease had lapsed."""

    expired: int
    released: int
    pending: tuple[str, ...]
    rolled_back: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetDone:
    """A hard reset (``reset``): applied (the new ``epoch``, what it dropped and released),
    or ``staged`` for the open ``turn``'s end (docs/rules.md#a-reset-waits-for-the-turns-end):
    ``epoch`` is then the session's still, and from ``due_ms`` (Redis's clock) on a reset
    call applies it whatever is open."""

    epoch: int
    dropped: int
    released: int
    staged: bool = False
    turn: int | None = None  # staged: the open turn it waits for
    due_ms: int | None = None  # staged: when a reset call applies it anyway


@dataclass(frozen=True, slots=True)
class Deleted:
    deleted: bool
