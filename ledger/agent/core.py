"""The agent layer's logic, written once with no I/O.

Each operation is a generator: it yields the ledger :class:`~ledger.protocol.Call` it
needs (or a :class:`Batch` of calls, a :class:`Sleep`), is sent the call's result (or
thrown its error; a batch is sent each call's result or error in its place), and
returns the operation's result. The asyncio face's ``drive`` (``ledger/_async/agent.py``)
runs it with ``await AsyncLedger.run`` and ``asyncio.sleep``, the sync face's (generated
from it, ``ledger/_sync/agent.py``) with ``Ledger.run`` and ``time.sleep``: the same
code decides for both.

App objects (retrieved chunks, messages, tool results) keep their own ids; the
ledger's item id is derived from the app id by :func:`ledger_id`, the same on every
worker, so no shared reverse map is needed: each worker maps ledger ids back to the
objects it knows (those it admitted, or was shown with :meth:`AgentCore.track`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import re
import uuid
import warnings
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ledger import schema
from ledger.agent.counters import KINDS, PLAUSIBLE, Calibrated, Tally, count, cut_to, is_estimate
from ledger.core import SessionCore, new_op_id
from ledger.errors import (
    AdmissionRefused,
    BillingDriftWarning,
    CompactionPending,
    ContextDrift,
    ContextDriftWarning,
    ContextOverflow,
    InvalidArgument,
    LedgerError,
    StaleEpoch,
    TurnInProgress,
)
from ledger.keys import check_scope, tenant_of
from ledger.models import (
    Admitted,
    BegunBy,
    CallCost,
    CompactionOutcome,
    Consumer,
    Item,
    Reconciled,
    Settled,
    Snapshot,
    ToolResultOutcome,
    TurnAborted,
    TurnFinished,
    TurnRenewed,
    TurnReport,
    TurnStarted,
    Usage,
    Voided,
)
from ledger.protocol import ID_RE, Call

T = TypeVar("T")
Obj = Any
Op = Generator["Call[Any] | Batch | Sleep | Held | Store | Fetch | Note", Any, T]
Effect = Any  # Held | Store | Fetch | Note: the reads and writes outside the ledger's scripts

# Fields of the session's summaries hash that are no summary ('~' is no id's character):
# JSON {"v": 1, "factors": {kind: factor}, "reports": [[turn, {kind: base count}, billed]]}:
# the factors learned per kind of content, and the last plausible reports they come from
CALIBRATION = "~calibration"
REPORTS_KEPT = 12  # the reports the factors are solved from (the newest)
# a kind's factor is learned once it made this share of a report's prompt, and 64 tokens
# of it (below that, the report tells too little of it: a small error elsewhere would move
# it far)
KIND_SHARE = 0.1
BILLED = "~billed"  # '<turn>|<counted>|<billed>|<flagged 0/1>': the last turn's last report

DIGEST_PREFIX = "h."
_DIGEST_RE = re.compile(r"h\.[0-9a-f]{32}")
_PLAIN_MAX = 64


def ledger_id(app_id: object) -> str:
    """The ledger item id of an app id (a URL, a UUID, a long name, an int...): the app
    id itself when it is a short plain id, else ``h.`` and a 128-bit BLAKE2b digest of
    it. Every worker derives the same id from the same app id."""
    if isinstance(app_id, bool) or not isinstance(app_id, (str, int, uuid.UUID)):
        raise InvalidArgument(f"an app id must be a str, int or UUID, got {app_id!r}")
    text = str(app_id)
    if not text:
        raise InvalidArgument("an app id must not be empty")
    plain = len(text) <= _PLAIN_MAX and ID_RE.fullmatch(text)
    if plain and (not text.startswith(DIGEST_PREFIX) or _DIGEST_RE.fullmatch(text)):
        return text  # a plain id, or a digest already (ledger_id is idempotent)
    return (
        DIGEST_PREFIX
        + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    )


def _text_part(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: the text parts
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, Mapping) and isinstance(p.get("text"), str):
                parts.append(p["text"])
        return "\n".join(parts)
    return json.dumps(content, sort_keys=True, default=str)


def default_id(obj: Obj) -> object:
    """An app object's own id: ``id``, ``tool_call_id`` or ``call_id`` (attribute or
    key), or a Document's ``metadata["id"]``. None when it has none."""
    for name in ("tool_call_id", "call_id", "id"):
        v = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
        if v not in (None, ""):
            return v
    meta = getattr(obj, "metadata", None)
    if isinstance(meta, Mapping) and meta.get("id") not in (None, ""):
        return meta["id"]
    return None


def default_text(obj: Obj) -> str:
    """The text a model sees of an app object: a string itself, or its
    ``page_content`` / ``content`` / ``text`` / ``output`` (attribute or key), plus
    the tool calls a message carries."""
    if isinstance(obj, str):
        return obj
    plain = type(obj) is dict and "page_content" not in obj and not obj.get("tool_calls")
    if plain and isinstance(obj.get("content"), str):
        return str(obj["content"])  # a plain message or chunk dict, the common case (fast)
    for name in ("page_content", "content", "text", "output"):
        v = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
        if v is not None:
            text = _text_part(v)
            calls = (
                obj.get("tool_calls")
                if isinstance(obj, Mapping)
                else getattr(obj, "tool_calls", None)
            )
            if calls:
                text += json.dumps(calls, sort_keys=True, default=str)
            return text
    raise InvalidArgument(
        f"cannot tell the text of a {type(obj).__name__}: give it content / page_content / "
        "text, or pass text_of= to the agent"
    )


@dataclass(frozen=True, slots=True)
class Sleep:
    """An effect: wait this long (the drivers sleep, sync or async)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Batch:
    """An effect: these calls in one round trip (``run_many``), in order; the operation
    is sent each call's result, or its error, in its place."""

    calls: tuple[Call[Any], ...]


@dataclass(frozen=True, slots=True)
class Held:
    """An effect: which of these items the session holds (a read of the session hash)."""

    fields: tuple[str, ...]  # 'i:<consumer code>:<item id>'


@dataclass(frozen=True, slots=True)
class Store:
    """An effect: write item texts to the session's content store (the hash the
    worker's compactor reads), refreshing its TTL to the session's idle TTL."""

    texts: tuple[tuple[str, str], ...]  # ('<consumer code>:<item id>', text)


@dataclass(frozen=True, slots=True)
class Fetch:
    """An effect: these fields of the session's summaries hash (a summary's JSON record,
    the calibration; each a text or None)."""

    ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Note:
    """An effect: write these fields of the session's summaries hash (the calibration,
    the last billing report), which every process reads."""

    fields: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class BillingCheck:
    """One model call's prompt as the ledger counted it against what the provider billed
    for it (its reported input tokens)."""

    turn: int
    counted: int
    billed: int
    tolerance: int  # the difference allowed: billing_tolerance of the counted prompt
    flagged: bool  # |billed - counted| > tolerance
    plausible: bool  # a ratio an estimate can be off by (0.5..2 of each kind's prior)
    learned: Mapping[str, float] | None  # the factors this report taught, by kind

    @property
    def difference(self) -> int:
        return self.billed - self.counted


def default_summary(summary_id: str, text: str) -> Obj:
    """The app object a worker's summary becomes: a system message dict."""
    return {"id": summary_id, "role": "system", "content": text}


@dataclass(frozen=True, slots=True, kw_only=True)
class Admission(Generic[T]):
    """Which app objects made it into the prompt."""

    kept: tuple[T, ...]  # admitted now or already held: put these in the prompt
    refused: tuple[T, ...]  # not admitted: leave them out
    reason: str | None  # why the first refused one was refused (a refusal reason), or None
    charged: int
    free: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolOutcome(Generic[T]):
    """A tool result admitted whole, or spilled: ``text`` is what goes in the prompt
    (the whole result, or a preview cut to the preview budget with the handle)."""

    result: T
    text: str
    spilled: bool
    handle: str | None  # read the whole result back with Agent.read_spill(handle)
    tokens: int  # the whole result's tokens
    charged: int  # tokens the prompt holds for it
    evicted: tuple[Obj, ...]  # memory items that gave way: drop them from the prompt
    unresolved: tuple[tuple[Consumer, str], ...]  # evicted items this worker cannot name
    # refused (not even its preview fits): ``text`` is a short note saying so, which the
    # ledger holds in the result's place (a tool call answered, never a result cut)
    refused: bool = False
    reason: str | None = None
    # sent with the turn's end (``tool_result(..., defer=True)``): ``text`` is the whole
    # result; if it did not go in whole then, ``turn.tools`` holds what it became
    deferred: bool = False


@dataclass(frozen=True, slots=True)
class Deferred:
    """A tool result to admit whole with the turn's end (``finish_turn``)."""

    index: int  # its place in ``TurnState.tools``
    result: Obj
    item: str
    tokens: int
    text: str
    keep: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Compacted:
    compacted: bool
    outcome: CompactionOutcome
    dropped: tuple[Obj, ...]  # app objects the summary replaced: drop them
    summary: Obj | None
    occupancy: int


@dataclass(frozen=True, slots=True)
class CallHold:
    """A model call's worst case, held before the call (docs/ceilings.md#in-an-adapter):
    ``tokens`` (its output reserve) in the session's window, as working memory, and
    ``cost`` (the prompt counted and the output reserve) in ``scopes``, the tenant first,
    in the same script. Settled with the billed usage after the call, voided on failure."""

    id: str
    tokens: int
    cost: CallCost
    scopes: tuple[str, ...]


@dataclass
class TurnState:
    """What one turn did; the faces' Turn objects expose it."""

    started: TurnStarted
    dropped: list[Obj] = field(default_factory=list)  # reclaimed at begin_turn: drop them
    unresolved: list[tuple[Consumer, str]] = field(default_factory=list)
    admissions: list[Admission[Any]] = field(default_factory=list)
    tools: list[ToolOutcome[Any]] = field(default_factory=list)
    prompt_tokens: int | None = None
    report: TurnReport | None = None
    # the worker's summaries delivered to this turn: put them in the prompt (``dropped``
    # holds the objects they replaced)
    summaries: list[Obj] = field(default_factory=list)
    # delivered summaries this agent counts otherwise than their compactor did: (id, its
    # count), each corrected in the ledger as the turn begins
    recounts: list[tuple[str, int]] = field(default_factory=list)
    # every (consumer, ledger id) this turn must drop from the app's state: reclaimed at
    # begin_turn and replaced by the delivered summaries (what ``dropped`` resolves)
    drop_refs: list[tuple[Consumer, str]] = field(default_factory=list)
    # each delivered summary's id -> the (consumer, id) pairs it replaced, in order
    replaced_by: dict[str, list[tuple[Consumer, str]]] = field(default_factory=dict)
    aborted: TurnAborted | None = None  # the turn was rolled back (turn.abort, an error)
    waited_compaction: float = 0.0  # seconds begin waited for a pending compaction
    billing: list[BillingCheck] = field(default_factory=list)  # this turn's reports
    # the calibration factor changed since this process last counted: the app's held
    # objects count otherwise now (an adapter reconciles the ledger to them)
    recalibrated: bool = False
    # the adapter's recount after a recalibration was refused (it did not fit): the ledger
    # keeps the old counts, the drift shows at end_turn; the turn goes on
    unreconciled: AdmissionRefused | None = None
    # the tokens of the tool schemas the last prompt sent, as the adapter counted them
    framing: int = 0
    # with a tenant named: each model call's settle (``over``: billed past its hold,
    # charged all the same)
    settled: list[Settled] = field(default_factory=list)
    # tool results sent with the turn's end (two-call turn, docs/agent.md)
    deferred: list[Deferred] = field(default_factory=list)
    # the epoch this agent's handle had when a hard reset (docs/rules.md) found it: the
    # turn began at the session's new epoch, the ledger holding no item; None: no reset
    # (docs/agent.md#after-a-hard-reset)
    reset_from_epoch: int | None = None

    @property
    def turn(self) -> int:
        return self.started.turn

    @property
    def rolled_back(self) -> int | None:
        """The dead turn that was undone to start this one (a crash, a takeover)."""
        return self.started.rolled_back

    @property
    def reset(self) -> bool:
        """The session was hard-reset since this agent's last turn: the ledger held none of
        the prompt's objects as the turn began (each admission of it charges again; an
        adapter reconciles the ledger to its state)."""
        return self.reset_from_epoch is not None


class AgentCore:
    """Maps app objects to ledger items for one session, and plans every call."""

    def __init__(
        self,
        session: SessionCore,
        counter: Callable[[str], int],
        *,
        id_of: Callable[[Obj], object] | None = None,
        text_of: Callable[[Obj], str] | None = None,
        item_overhead: int = 0,
        poll_interval: float = 0.05,
        store_content: bool | None = None,
        summary_of: Callable[[str, str], Obj] | None = None,
        await_compaction: float = 2.0,
        compaction_pickup: float = 1.0,
        lease_ms: int | None = None,
        renew: bool = True,
        billing_tolerance: float = 0.02,
        calibrate: bool | None = None,
        tenant: str | None = None,
        scopes: Sequence[str] = (),
        model: str | None = None,
        hold_ms: int = 600_000,
    ) -> None:
        if not callable(counter):
            raise InvalidArgument(f"counter must be callable text -> int, got {counter!r}")
        if type(item_overhead) is not int or item_overhead < 0:
            raise InvalidArgument(
                f"item_overhead must be a non-negative int, got {item_overhead!r}"
            )
        lease_ms = session.lease_ms if lease_ms is None else lease_ms
        if type(lease_ms) is not int or not 1 <= lease_ms <= 86_400_000:
            raise InvalidArgument(f"lease_ms must be an int in 1..86400000, got {lease_ms!r}")
        for name, value in (
            ("await_compaction", await_compaction),
            ("compaction_pickup", compaction_pickup),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InvalidArgument(f"{name} must be seconds >= 0, got {value!r}")
        if not 0 <= billing_tolerance < 1:
            raise InvalidArgument(f"billing_tolerance must be in [0, 1), got {billing_tolerance!r}")
        self.session = session
        self.billing_tolerance = billing_tolerance
        self.calibrate = is_estimate(counter) if calibrate is None else calibrate
        # every count goes through the session's calibration: the counter's own when it is
        # exact, by kind of content when it estimates (docs/agent.md#what-the-model-billed)
        self.counter = Calibrated(counter, kinds=self.calibrate)
        self.counter.tolerance = billing_tolerance
        self.reports: list[list[Any]] = []  # the session's kept reports (its calibration)
        self.id_of = id_of or default_id
        self.text_of = text_of or default_text
        self.item_overhead = item_overhead
        self.poll_interval = poll_interval
        self.known: dict[tuple[Consumer, str], Obj] = {}
        self.compaction_pending = False
        # Whether the worker compacts this session: then admitted texts are stored for
        # its compactor and its summaries applied at begin. None: asked of the session.
        self.store_content = store_content
        self._worker: bool | None = None  # the worker compacts this session (asked once)
        self.summary_of = summary_of or default_summary
        self.await_compaction = await_compaction
        # Whether a turn's start adopts the new epoch of a hard reset by itself (docs/agent.md,
        # after a hard reset); False: StaleEpoch is raised to a caller that rebuilds its own
        # context before it begins again (the demo's simulated agents do).
        self.adopt_resets = True
        # a pending compaction no worker has picked up this long after it was requested
        # is not waited for (no worker may be running)
        self.compaction_pickup = compaction_pickup
        # a turn's lease (default: the session's, the setting turn_lease_ms); the faces
        # renew it every third of it while the turn runs
        self.lease_ms: int = lease_ms
        self.live_turns: set[int] = set()  # the turns this agent serves now (its faces keep it)
        self.renew_leases = renew
        self.tenant: str | None = None
        # the answers this turn's settles made items (working memory, by ledger id): their
        # admission, next, is known to charge nothing and sends no call
        self.answered: set[str] = set()
        self.scopes: tuple[str, ...] = ()
        self.model: str | None = None
        self.hold_ms = 600_000
        if tenant is not None:
            self.name_tenant(tenant, scopes, model=model, hold_ms=hold_ms)
        elif scopes or model is not None:
            raise InvalidArgument("scopes= and model= charge a tenant's ceilings: name tenant=")

    def name_tenant(
        self,
        tenant: str,
        scopes: Sequence[str] = (),
        *,
        model: str | None = None,
        hold_ms: int = 600_000,
    ) -> None:
        """Charge every model call of this agent's turns to ``tenant``'s ceilings (and to
        ``scopes`` within it, '<tenant>/<name>'): the adapters hold each call's worst case
        before it, settle it with the billed usage after it, void it on failure
        (docs/ceilings.md#in-an-adapter). ``model`` prices the calls when the framework
        does not name its model; ``hold_ms`` is each hold's deadline on Redis's clock
        (longer than a model call takes: a settle past it is refused)."""
        named = tenant_of(self.session.id)
        if not isinstance(tenant, str) or named != tenant:
            raise InvalidArgument(
                f"tenant {tenant!r} needs a session of that tenant: session "
                f"{self.session.id!r} is to be named '@{tenant}/<id>'"
            )
        if isinstance(scopes, str):
            raise InvalidArgument(f"scopes is a sequence of scope names, got {scopes!r}")
        for name in scopes:
            if check_scope(name) != tenant or name == tenant:
                raise InvalidArgument(f"scope {name!r} is not within tenant {tenant!r}")
        if len(scopes) > 2:
            raise InvalidArgument(f"at most 2 scopes within the tenant, got {len(scopes)}")
        if model is not None and (not isinstance(model, str) or not ID_RE.fullmatch(model)):
            raise InvalidArgument(f"model must be a name of [A-Za-z0-9._:/@+=#-], got {model!r}")
        if type(hold_ms) is not int or not 1 <= hold_ms <= 86_400_000:
            raise InvalidArgument(f"hold_ms must be an int in 1..86400000, got {hold_ms!r}")
        self.tenant, self.scopes, self.model, self.hold_ms = tenant, tuple(scopes), model, hold_ms

    # --- pure helpers ---------------------------------------------------------------

    def app_id(self, obj: Obj) -> object:
        try:
            v = self.id_of(obj)
        except Exception as exc:
            raise InvalidArgument(
                f"id_of raised {type(exc).__name__} on {obj!r:.80}: {exc}"
            ) from exc
        if v is None or v == "":
            sdk = isinstance(obj, Mapping) and ("role" in obj or "type" in obj)
            raise InvalidArgument(
                f"a {type(obj).__name__} without a usable id ({obj!r:.80}): give it an id, "
                "or pass id_of= to the agent"
                + (
                    " (an Agents SDK input item? set the ledger to SDK items with "
                    "gov.reconcile(items) of LedgerAgents, which gives each an id)"
                    if sdk
                    else ""
                )
            )
        return v

    def item_id(self, obj: Obj) -> str:
        return ledger_id(self.app_id(obj))

    def tokens(self, obj: Obj) -> int:
        try:
            text = self.text_of(obj)
        except InvalidArgument:
            raise
        except Exception as exc:
            raise InvalidArgument(f"text_of raised {type(exc).__name__}: {exc}") from exc
        return (
            count(self.counter, text, f"{type(obj).__name__} {self.app_id(obj)!s:.60}")
            + self.item_overhead
        )

    def items(self, objs: Iterable[Obj], priority: int = 0) -> list[tuple[Item, Obj]]:
        """Every object's Item, all checked before anything is sent."""
        out, seen = [], set()
        for obj in objs:
            iid = self.item_id(obj)
            if iid in seen:
                continue  # the same object twice: one item
            seen.add(iid)
            n = self.tokens(obj)
            if n == 0:
                raise InvalidArgument(
                    f"{type(obj).__name__} {self.app_id(obj)!s:.60} counts 0 tokens"
                )
            out.append((Item(iid, n, priority), obj))
        return out

    def track(self, consumer: Consumer | str, objs: Iterable[Obj]) -> None:
        """Remember app objects the prompt holds (e.g. the state another worker left), so
        this worker can hand them back when the ledger reclaims or evicts them."""
        c = Consumer.parse(consumer)
        for obj in objs:
            self.known[(c, self.item_id(obj))] = obj

    def resolve(
        self, pairs: Iterable[tuple[Consumer, str]]
    ) -> tuple[list[Obj], list[tuple[Consumer, str]]]:
        """App objects for ledger (consumer, id) pairs, and the pairs this worker cannot name."""
        objs, unknown = [], []
        for pair in pairs:
            if pair[0] is Consumer.WORKING_MEMORY:
                self.answered.discard(pair[1])  # (gone: an admission of it charges again)
            obj = self.known.pop(pair, None)
            if obj is None:
                unknown.append(pair)
            else:
                objs.append(obj)
        return objs, unknown

    def consumer_of(self, obj: Obj) -> Consumer:
        """The consumer holding an app object: the one it was admitted or tracked under
        (the same id may be held by two consumers, e.g. a tool call and its result)."""
        iid = self.item_id(obj)
        found = [c for c in Consumer if (c, iid) in self.known]
        same = [c for c in found if self.known[(c, iid)] is obj]
        if same or found:
            return (same or found)[0]
        raise InvalidArgument(
            f"{type(obj).__name__} {self.app_id(obj)!s:.60} is not held by this agent"
        )

    def preview(self, app_id: object, text: str, tokens: int, budget: int, handle: str) -> str:
        """The spill preview: a header naming the handle, then the result's start, cut so
        that the whole counts at most ``budget`` tokens."""
        head = (
            f"[tool result {app_id!s:.80} spilled: {tokens} tokens; read it with handle {handle}]\n"
        )
        room = budget - self.item_overhead - count(self.counter, head, "the spill header")
        if room < 0:
            head = f"[spilled: {handle}]\n"
            room = budget - self.item_overhead - count(self.counter, head, "the spill header")
            if room < 0:
                return cut_to(self.counter, head, budget - self.item_overhead, "the spill header")
        shown = head + cut_to(self.counter, text, room, "the spill preview")
        # counted whole, the preview may be of another kind than its parts (a prose header
        # on rows): cut further until the whole is within the budget, as the prompt counts it
        over = count(self.counter, shown, "the spill preview") + self.item_overhead - budget
        while over > 0 and len(shown) > len(head):
            room -= over
            shown = head + cut_to(self.counter, text, room, "the spill preview")
            over = count(self.counter, shown, "the spill preview") + self.item_overhead - budget
        return shown

    def guard(self, prompt: int, limit: int | None, window: int | None, tally: Tally) -> None:
        """Before a model call: a prompt counted over ``limit`` (the window minus the output
        reserve), or whose stated upper bound (``Calibrated.upper``: an estimate's unlearned
        kinds at their bound, its learned ones at their count plus the billing tolerance;
        what the counter did not count as counted) is over the ``window``, is refused
        (``ContextOverflow``): no prompt over the window reaches the model."""
        if limit is not None and prompt > limit:
            raise ContextOverflow(prompt, limit)
        upper = tally.upper + max(prompt - tally.counted, 0)
        if window is not None and upper > window:
            raise ContextOverflow(upper, window)

    def prompt_tokens(self, prompt: int | str | Sequence[Obj]) -> int:
        """The real prompt's tokens: a count, a text, or the app objects it is made of."""
        if type(prompt) is int:
            if prompt < 0:
                raise InvalidArgument(f"prompt tokens must not be negative, got {prompt}")
            return prompt
        if isinstance(prompt, str):
            with self.counter.measure():
                return count(self.counter, prompt, "the prompt")
        if isinstance(prompt, Sequence):
            # a plain string among the parts is the budget's fixed text (the system prompt):
            # counted as the budget counted it, with the counter itself
            with self.counter.measure():
                return sum(
                    count(
                        self.counter.fixed if isinstance(o, str) else self.counter,
                        self.text_of(o),
                        "a prompt part",
                    )
                    + self.item_overhead
                    for o in prompt
                )
        raise InvalidArgument(
            f"prompt must be tokens, text or a list of objects, got {prompt!r:.80}"
        )

    # --- operations (generators: yield calls, return results) ---------------------------

    def _worker_owned(self) -> Generator[Call[Any], Any, bool]:
        """Whether the background worker compacts this session (asked of it once)."""
        if self._worker is None:
            snap: Snapshot = yield self.session.snapshot_call()
            self._worker = not snap.raw.get(schema.AGENT_COMPACTS)
        return self._worker

    def _storing(self) -> Generator[Call[Any], Any, bool]:
        """Whether admitted texts go to the content store: as asked, else when the
        worker compacts (its compactor reads them)."""
        if self.store_content is not None:
            return self.store_content
        return (yield from self._worker_owned())

    def begin(
        self,
        working_set: int,
        output_reserve: int | None,
        *,
        wait: float = 0.0,
        takeover: bool = False,
        admit: Mapping[Consumer | str, Sequence[Obj]] | None = None,
    ) -> Op[TurnState]:
        """Take the session's turn (its lease) and start it. Another process's live turn
        is waited for up to ``wait`` seconds (polling), then ``TurnInProgress``; with
        ``takeover`` it is rolled back and this turn starts at once. An agent serves one
        turn at a time: a second one while its first runs is refused the same way.

        ``admit`` (consumer -> app objects, in order): the turn's first admissions, sent
        in the round trip that begins it (each call names the turn by its begin's op id,
        so it lands in this turn or, when the begin is refused, nowhere); their
        :class:`Admission` results are the state's first ``admissions``."""
        if self.live_turns:
            held = min(self.live_turns)
            raise TurnInProgress(
                f"turn {held} is held by {self.session.owner} (lease {self.lease_ms} ms left): "
                "this agent serves it now; one agent (one session handle) serves one turn at "
                "a time: give each concurrent request its own"
            )
        self.answered.clear()
        if self.session.turn is not None:
            # a turn of this handle that its process left open (its abort failed): rolled
            # back now, so that beginning again never commits what it half did
            with contextlib.suppress(LedgerError):
                yield self.session.abort_turn_call(self.session.turn)
        worker = yield from self._worker_owned()
        # The credit ordering, seen from the caller: a worker's compaction commits only
        # between turns, so a pending one is waited for (bounded) before the turn whose
        # retrieval it would make room for. begin_turn itself says whether one is pending
        # (asked of the ledger, as another process may have served the turn that made it
        # due): a turn with nothing pending costs no extra call.
        awaiting = worker and self.await_compaction > 0
        plans: list[tuple[Consumer, list[tuple[Item, Obj]], list[str] | None]] = []
        for consumer, objs in (admit or {}).items():
            planned = self.items(objs)
            if planned:
                c = Consumer.parse(consumer)
                plans.append((c, planned, (yield from self._texts(planned))))
        got: list[Any] = []
        waited_for = waited = 0.0
        reset_from: int | None = None
        while True:
            op_id = new_op_id()
            call = self.session.begin_turn_call(
                working_set,
                output_reserve,
                takeover=takeover,
                lease_ms=self.lease_ms,
                await_compaction=awaiting,
                op_id=op_id,
            )
            try:
                if plans:
                    got = yield Batch(
                        (call, *(self._admission(*plan, BegunBy(op_id)) for plan in plans))
                    )
                    if isinstance(got[0], BaseException):
                        raise got[0]
                    started: TurnStarted = got[0]
                else:
                    started = yield call
                break
            except CompactionPending as pending:
                self.compaction_pending = True
                # Not waited for past the bound, nor while no worker has picked it up
                # compaction_pickup after it was requested (none may be running): timed
                # from the request (Redis's clock), not from this wait, so a worker that
                # is late under load is waited for, while with no worker only the first
                # turn after the request waits and the next ones begin at once.
                asked = pending.requested_ms_ago
                age = waited_for if asked is None else asked / 1000
                if waited_for >= self.await_compaction or (
                    not pending.computing and age >= self.compaction_pickup
                ):
                    awaiting = False
                    continue
                yield Sleep(self.poll_interval)
                waited_for += self.poll_interval
            except StaleEpoch:
                # A hard reset (docs/rules.md) advanced the session's epoch since this
                # handle last saw it: its items are gone, its open turn ended. Nothing of
                # this turn was written before begin_turn (the admissions sent with it name
                # the begin by its op id: refused with it), so it is safe to adopt the
                # session's epoch and begin again, once; a second StaleEpoch is raised.
                if reset_from is not None or not self.adopt_resets:
                    raise
                old = self.session.epoch
                snap: Snapshot = yield self.session.snapshot_call()
                if snap.epoch <= old:
                    raise
                reset_from = old
                self.session.epoch = snap.epoch
                if snap.turn_owner != self.session.owner or snap.turn != self.session.turn:
                    self.session.turn = None
                self._forget()
            except TurnInProgress as busy:
                if waited >= wait:
                    raise TurnInProgress(
                        f"{busy} (waited {waited:g} s: begin the turn with wait=<seconds> to "
                        "wait for it longer, or takeover=True to roll it back and start now)"
                    ) from busy
                left = max(busy.lease_left_ms or 0, 0) / 1000
                step = min(
                    max(self.poll_interval, 0.001), wait - waited, left or self.poll_interval
                )
                yield Sleep(step)
                waited += step
        self.compaction_pending = started.compaction_due
        self.live_turns.add(started.turn)
        state = TurnState(started, waited_compaction=waited_for, reset_from_epoch=reset_from)
        state.drop_refs = [*started.reclaimed, *started.dropped]
        if started.summaries or self.calibrate:
            yield from self._deliver(state)
        for sid, tokens in state.recounts:
            # The summary counted as this agent counts it (its counter, its framing), in
            # one call of this turn: its prompt and the ledger then agree (drift 0), on
            # whatever counter the worker's compactor used. (A recount that does not fit
            # changes nothing: the turn's drift then shows it.)
            yield self.session.compact_call(
                [(Consumer.WORKING_MEMORY, sid)],
                Item(sid, tokens, 1000),
                turn=started.turn,
            )
        state.dropped, state.unresolved = self.resolve(state.drop_refs)
        for (c, planned, _), result in zip(plans, got[1:], strict=True):
            if isinstance(result, AdmissionRefused):
                state.admissions.append((yield from self._on_refusal(c, planned, result)))
            elif isinstance(result, BaseException):
                raise result
            else:
                state.admissions.append(self._admitted(c, planned, result))
        return state

    def _forget(self) -> None:
        """After a hard reset: what this agent believed the ledger holds is dropped (the
        objects it admitted, the answers a settle made items, a pending compaction): the
        turn's admissions charge again for what the prompt really holds."""
        self.known.clear()
        self.answered.clear()
        self.compaction_pending = False

    def _deliver(self, state: TurnState) -> Generator[Fetch, Any, None]:
        """The summaries delivered to this turn, as app objects (``summary_of``), with the
        items each replaced, from the records the worker stored beside the session; and
        the session's calibration, when this agent calibrates."""
        ids = state.started.summaries
        extra = (CALIBRATION,) if self.calibrate else ()
        got: list[str | None] = yield Fetch((*ids, *extra))
        if self.calibrate:
            factors, self.reports = _calibration(got[-1])
            if factors != self.counter.factors:
                self.counter.factors, state.recalibrated = factors, True
            if ids:  # the worker counted its summaries with its own counter: recount
                state.recalibrated = True
        for sid, raw in zip(ids, got[: len(ids)], strict=True):
            if raw is None:
                continue  # a summary whose record expired or was never written: its drops stand
            try:
                rec = schema.SummaryRecord.from_json(raw)
                text = rec.text
                replaced = [(Consumer.from_code(code), iid) for code, iid in rec.replaced_items()]
            except (ValueError, KeyError):
                continue  # not a record this version wrote
            summary = self.summary_of(sid, text)
            self.known[(Consumer.WORKING_MEMORY, sid)] = summary
            state.summaries.append(summary)
            state.replaced_by[sid] = replaced
            if rec.tokens and (mine := self.tokens(summary)) != rec.tokens:
                state.recounts.append((sid, mine))  # the compactor counted it otherwise

    def billed(
        self, state: TurnState, billed: int, counted: int, tally: Tally | None = None
    ) -> Op[BillingCheck]:
        """What the provider billed for a prompt (its reported input tokens) against the
        ledger's count of that prompt: flagged beyond ``billing_tolerance`` (a
        BillingDriftWarning). ``tally``: what the count was made of (the base's counts by
        kind, ``Calibrated.measure``); by default the last prompt measured, when its total
        is ``counted``.

        When this agent calibrates (its counter estimates), a plausible report (between
        0.5 and 2 times each kind's prior estimate of the prompt) is kept in Redis with
        the last ones, and a flagged one teaches the kinds it tells enough of a factor
        solved from the kept reports against the base's counts (never against a calibrated
        count: reports do not compound), for every process from the next turn on. A report
        outside that range, whatever its size, is flagged and not learned: one wrong or
        hostile report cannot move the fleet's counts past a kind's bound."""
        for name, v in (("billed", billed), ("counted", counted)):
            if type(v) is not int or v < 0:
                raise InvalidArgument(f"{name} tokens must be a non-negative int, got {v!r}")
        if tally is None:
            last = self.counter.last
            tally = last if last is not None and last.counted <= counted else Tally()
        tolerance = math.ceil(self.billing_tolerance * counted)
        flagged = abs(billed - counted) > tolerance
        # the tokens the counter did not count (item_overhead, framing) are billed alike
        fixed = counted - tally.counted
        text = billed - fixed
        raw = {k: n for k, n in tally.raw.items() if n > 0}
        prior = sum(n * self.counter.priors[k] for k, n in raw.items())
        plausible = prior >= 64 and PLAUSIBLE[0] * prior <= text <= PLAUSIBLE[1] * prior
        learned = None
        if self.calibrate and plausible:
            self.reports = [*self.reports, [state.turn, raw, text]][-REPORTS_KEPT:]
            factors = dict(self.counter.factors)
            solved = _solve(self.reports, factors, self.counter.priors)
            new = {k: f for k, f in solved.items() if factors.get(k) != f}
            # taught when the count is off, or when the kept reports move this prompt's
            # count by 2 tokens or more (a factor from a small report is refined by the
            # larger ones after it, before its error grows with the prompt)
            shift = sum(abs(f - factors.get(k, f)) * raw.get(k, 0) for k, f in new.items())
            if new and (flagged or shift >= 2 or not factors.keys() >= new.keys()):
                learned = new
                factors.update(new)
            record = {"v": 1, "factors": factors, "reports": self.reports}
            yield Note(((CALIBRATION, json.dumps(record, sort_keys=True)),))
        check = BillingCheck(
            turn=state.turn,
            counted=counted,
            billed=billed,
            tolerance=tolerance,
            flagged=flagged,
            plausible=plausible,
            learned=learned,
        )
        state.billing.append(check)
        if flagged:
            warnings.warn(BillingDriftWarning(check, billing_message(check)), stacklevel=4)
        return check

    def apply(self, state: TurnState, objs: Sequence[Obj]) -> list[Obj]:
        """The app's objects as this turn must hold them: those the ledger reclaimed or a
        delivered summary replaced left out (matched by ledger id: any worker's state),
        each delivered summary in the place of the first object it replaced (at the end
        when none is there). Objects without an id (a system prompt string) stay. Safe to
        call more than once: a summary already there is not added again."""
        gone = {iid for _, iid in state.drop_refs}
        out: list[Obj] = []
        first: dict[str, int] = {}
        place = {iid: sid for sid, refs in state.replaced_by.items() for _, iid in refs}
        present: set[str] = set()
        for o in objs:
            try:
                iid = self.item_id(o)
            except InvalidArgument:
                out.append(o)
                continue
            present.add(iid)
            if iid in gone:
                sid = place.get(iid)
                if sid is not None and sid not in first:
                    first[sid] = len(out)
                continue
            out.append(o)
        tail: list[Obj] = []
        inserts: list[tuple[int, Obj]] = []
        for summary in state.summaries:
            sid = self.item_id(summary)
            if sid in present:
                continue
            if sid in first:
                inserts.append((first[sid], summary))
            else:
                tail.append(summary)
        for at, summary in sorted(inserts, key=lambda x: x[0], reverse=True):
            out.insert(at, summary)
        return out + tail

    def _texts(
        self, planned: Sequence[tuple[Item, Obj]]
    ) -> Generator[Call[Any], Any, list[str] | None]:
        """The texts to send with an admission (its script stores those of the items it
        admits, in the same step), or None when texts are not stored."""
        if not (yield from self._storing()):
            return None
        return [self.text_of(o) for _, o in planned]

    def admit(
        self,
        consumer: Consumer | str,
        objs: Sequence[Obj],
        priority: int = 0,
        turn: int | None = None,
    ) -> Op[Admission[Any]]:
        c = Consumer.parse(consumer)
        planned = self.items(objs, priority)
        answered: tuple[Obj, ...] = ()
        if c is Consumer.WORKING_MEMORY and self.answered:
            # an answer a settle made its item already: held, nothing to send for it
            held = {it.id for it, _ in planned if it.id in self.answered}
            answered = tuple(o for it, o in planned if it.id in held)
            for it, o in planned:
                if it.id in held:
                    self.known[(c, it.id)] = o
            self.answered -= held
            planned = [(it, o) for it, o in planned if it.id not in held]
        if not planned:
            return Admission(kept=answered, refused=(), reason=None, charged=0, free=-1)
        texts = yield from self._texts(planned)
        try:
            got = yield self._admission(c, planned, texts, turn)
        except AdmissionRefused as exc:
            done = yield from self._on_refusal(c, planned, exc)
        else:
            done = self._admitted(c, planned, got)
        if answered:
            done = dataclasses.replace(done, kept=(*answered, *done.kept))
        return done

    def _admission(
        self,
        c: Consumer,
        planned: list[tuple[Item, Obj]],
        texts: list[str] | None,
        turn: int | BegunBy | None,
    ) -> Call[Admitted]:
        """The call admitting planned objects: the longest prefix that fits."""
        items = [it for it, _ in planned]
        return self.session.admit_call(c, items, partial=True, texts=texts, turn=turn)

    def _on_refusal(
        self, c: Consumer, planned: list[tuple[Item, Obj]], exc: AdmissionRefused
    ) -> Generator[Held, Any, Admission[Any]]:
        if c in (Consumer.RETRIEVAL, Consumer.RECALL) and exc.reason == "compaction_pending":
            self.compaction_pending = True
        return (yield from self._refused(c, planned, exc))

    def _admitted(
        self, c: Consumer, planned: list[tuple[Item, Obj]], got: Admitted
    ) -> Admission[Any]:
        """Which planned objects made it in, from an admission's result."""
        memory = c in (Consumer.RETRIEVAL, Consumer.RECALL)
        skipped = set(got.skipped)
        kept = tuple(o for it, o in planned if it.id not in skipped)
        refused = tuple(o for it, o in planned if it.id in skipped)
        for it, o in planned:
            if it.id not in skipped:
                self.known[(c, it.id)] = o
        reason = None
        if refused:
            reason = (
                "compaction_pending"
                if memory and self.compaction_pending
                else "token_budget_exhausted"
            )
        return Admission(
            kept=kept, refused=refused, reason=reason, charged=got.charged, free=got.free
        )

    def _refused(
        self, c: Consumer, planned: list[tuple[Item, Obj]], exc: AdmissionRefused
    ) -> Generator[Held, Any, Admission[Any]]:
        """A refused admission: no new item fitted. Those already held stay in the prompt."""
        held: list[bool] = yield Held(tuple(schema.item_field(c.code, it.id) for it, _ in planned))
        kept = tuple(o for (_, o), h in zip(planned, held, strict=True) if h)
        refused = tuple(o for (_, o), h in zip(planned, held, strict=True) if not h)
        return Admission(kept=kept, refused=refused, reason=exc.reason, charged=0, free=exc.free)

    def tool_result(
        self, result: Obj, text: str | None = None, turn: int | None = None
    ) -> Op[ToolOutcome[Any]]:
        app_id = self.app_id(result)
        iid = ledger_id(app_id)
        body = self.text_of(result) if text is None else text
        if not isinstance(body, str):
            raise InvalidArgument(f"a tool result's text must be str, got {type(body).__name__}")
        tokens = count(self.counter, body, f"tool result {app_id!s:.60}") + self.item_overhead
        if tokens == 0:
            raise InvalidArgument(f"tool result {app_id!s:.60} counts 0 tokens")
        keep = yield from self._storing()
        try:
            got = yield self.session.admit_tool_result_call(
                iid, tokens, body, keep_text=keep, turn=turn
            )
        except AdmissionRefused as exc:
            # No room for it, nor for its preview: the prompt gets a note saying so (the
            # tool call must be answered), which the ledger holds in its place.
            note = (
                f"[tool result {app_id!s:.80} refused by the ledger ({exc.reason}): {tokens} "
                "tokens and no room for them; ask for less]"
            )
            n = count(self.counter, note, "a refusal note") + self.item_overhead
            noted = yield self.session.admit_tool_result_call(
                iid, n, note, keep_text=keep, turn=turn
            )
            evicted, unknown = self.resolve(noted.evicted)
            self.known[(Consumer.SCRATCHPAD, iid)] = result
            return ToolOutcome(
                result=result,
                text=note,
                spilled=False,
                handle=None,
                tokens=tokens,
                charged=noted.charged,
                evicted=tuple(evicted),
                unresolved=tuple(unknown),
                refused=True,
                reason=exc.reason,
            )
        evicted, unknown = self.resolve(got.evicted)
        self.known[(Consumer.SCRATCHPAD, iid)] = result
        if (
            got.outcome == ToolResultOutcome.SPILLED or got.preview_tokens > 0
        ):  # spilled, now or before
            shown = self.preview(app_id, body, tokens, got.preview_tokens, iid)
            return ToolOutcome(
                result=result,
                text=shown,
                spilled=True,
                handle=iid,
                tokens=tokens,
                charged=got.charged,
                evicted=tuple(evicted),
                unresolved=tuple(unknown),
            )
        return ToolOutcome(
            result=result,
            text=body,
            spilled=False,
            handle=None,
            tokens=tokens,
            charged=got.charged,
            evicted=tuple(evicted),
            unresolved=tuple(unknown),
        )

    def defer_tool(
        self, state: TurnState, result: Obj, text: str | None = None
    ) -> Op[ToolOutcome[Any]]:
        """A tool result sent with the turn's end (no round trip now): counted here, put
        in the prompt whole, admitted whole by ``finish_turn`` with the turn's end."""
        app_id = self.app_id(result)
        iid = ledger_id(app_id)
        body = self.text_of(result) if text is None else text
        if not isinstance(body, str):
            raise InvalidArgument(f"a tool result's text must be str, got {type(body).__name__}")
        if any(d.item == iid for d in state.deferred):
            raise InvalidArgument(f"tool result {app_id!s:.60} is deferred twice in this turn")
        tokens = count(self.counter, body, f"tool result {app_id!s:.60}") + self.item_overhead
        if tokens == 0:
            raise InvalidArgument(f"tool result {app_id!s:.60} counts 0 tokens")
        keep = yield from self._storing()
        state.deferred.append(Deferred(len(state.tools), result, iid, tokens, body, keep))
        return ToolOutcome(result=result, text=body, spilled=False, handle=None, tokens=tokens,
                           charged=tokens, evicted=(), unresolved=(), deferred=True)  # fmt: skip

    def release(self, objs: Sequence[Obj], turn: int | None = None) -> Op[list[Obj]]:
        by: dict[Consumer, list[str]] = {}
        for o in objs:
            by.setdefault(self.consumer_of(o), []).append(self.item_id(o))
        out: list[Obj] = []
        for c, ids in by.items():
            yield self.session.release_call(c, ids, turn=turn)
            objs_c, _ = self.resolve([(c, i) for i in ids])
            out += objs_c
        return out

    def compact(
        self, replaced: Sequence[Obj], summary: Obj | None, turn: int | None = None
    ) -> Op[Compacted]:
        refs = list(dict.fromkeys((self.consumer_of(o), self.item_id(o)) for o in replaced))
        item = self.items([summary], priority=1000)[0][0] if summary is not None else None
        done = yield self.session.compact_call(refs, item, turn=turn)
        dropped: list[Obj] = []
        if done.dropped or done.compacted:
            dropped, _ = self.resolve(refs)
            if item is not None and done.summary:
                self.known[(Consumer.WORKING_MEMORY, item.id)] = summary
        self.compaction_pending = not done.compacted
        return Compacted(
            compacted=done.compacted,
            outcome=done.outcome,
            dropped=tuple(dropped),
            summary=summary,
            occupancy=done.occupancy,
        )

    def end(
        self, turn: int, prompt_tokens: int, mark: str | None = None, state: TurnState | None = None
    ) -> Op[TurnReport]:
        if state is not None and state.billing:  # the turn's last report, for every process
            c = state.billing[-1]
            yield Note(((BILLED, f"{turn}|{c.counted}|{c.billed}|{int(c.flagged)}"),))
        try:
            if state is not None and state.deferred:
                report = yield from self._finish(state, turn, prompt_tokens, mark)
            else:
                report = yield self.session.end_turn_call(turn, prompt_tokens, mark=mark)
        except ContextDrift as exc:
            hint = framing_hint(exc.report, state)
            if hint:
                raise ContextDrift(exc.report, f"{exc}; {hint}") from exc
            raise
        self.compaction_pending = report.compaction_due
        hint = framing_hint(report, state)
        if hint:
            warnings.warn(ContextDriftWarning(report, hint), stacklevel=4)
        return report

    def _finish(
        self, state: TurnState, turn: int, prompt_tokens: int, mark: str | None
    ) -> Generator[Any, Any, TurnReport]:
        """The turn's end with its deferred tool results, in one call; when one does not
        go in whole, each is admitted as ``tool_result`` admits it (spilled, or refused
        with a note) and the prompt counted with what it became, then ``end_turn``."""
        deferred, state.deferred = state.deferred, []
        tools = [(d.item, d.tokens, d.text) for d in deferred]
        keep = any(d.keep for d in deferred)
        try:
            done: TurnFinished = yield self.session.finish_turn_call(
                turn, prompt_tokens, tools, keep_text=keep, mark=mark
            )
        except AdmissionRefused as exc:
            if exc.reason != "not_whole":
                raise
        else:
            for d in deferred:
                self.known[(Consumer.SCRATCHPAD, d.item)] = d.result
            return done.report
        for d in deferred:
            out = yield from self.tool_result(d.result, d.text, turn)
            state.tools[d.index] = out
            if out.text != d.text:
                shown = count(self.counter, out.text, "a tool result's place") + self.item_overhead
                prompt_tokens += shown - d.tokens
        state.prompt_tokens = prompt_tokens
        report: TurnReport = yield self.session.end_turn_call(turn, prompt_tokens, mark=mark)
        return report

    def abort(self, turn: int) -> Op[TurnAborted]:
        """Roll the turn back: the ledger is as the turn found it (the objects this process
        keeps of it are a cache: ``turn.apply`` on the committed state is the truth)."""
        done: TurnAborted = yield self.session.abort_turn_call(turn)
        return done

    def renew(self, turn: int) -> Op[TurnRenewed]:
        renewed: TurnRenewed = yield self.session.renew_turn_call(turn, self.lease_ms)
        return renewed

    # --- a tenant's ceilings around each model call (docs/ceilings.md#in-an-adapter) ----

    def hold(self, prompt: int, output: int, model: str | None, turn: int) -> Op[CallHold]:
        """Before a model call: hold its worst case, ``prompt`` (the tokens the adapter
        counted and the ledger admitted) plus ``output`` (the turn's output reserve), in the
        session's window and in the tenant's scopes, in one script. A ceiling that would be
        passed refuses it (``CeilingReached``), nothing held anywhere: the model is not
        called. ``model``: the framework's model name (else the agent's ``model``)."""
        if self.tenant is None:
            raise InvalidArgument("no tenant named: name_tenant(...) or Agent(tenant=...)")
        name = self.model if model is None or not ID_RE.fullmatch(model) else model
        cost = CallCost(
            model=name or "default",
            input=max(int(prompt), 0),
            output=max(int(output), 0),
            scopes=(self.tenant, *self.scopes),
        )
        rid = f"call.{turn}.{uuid.uuid4().hex[:12]}"
        tokens = max(cost.output, 1)
        got = yield self.session.reserve_call(
            Consumer.WORKING_MEMORY, rid, tokens, lease_ms=self.hold_ms, cost=cost, turn=turn
        )
        return CallHold(rid, tokens, cost, got.scopes)

    def settle_hold(
        self, state: TurnState, hold: CallHold, answer: Obj | None, billed: Usage | None
    ) -> Op[Settled]:
        """After the call: the hold becomes what the provider billed (``billed``; None: no
        usage reported, the worst case held is charged) in the tenant's scopes, and the
        answer's item (working memory, its count) in the session's window, in one script;
        billed past the hold is charged all the same and reported (``Settled.over``, kept
        on ``state.settled``). The answer's later admission finds it held (no charge)."""
        usage = billed or Usage(
            input=hold.cost.input, output=hold.cost.output, cached_input=hold.cost.cached_input
        )
        c = Consumer.WORKING_MEMORY
        iid, size = (hold.id, 1) if answer is None else (self.item_id(answer), self.tokens(answer))
        try:
            done: Settled = yield self.session.settle_call(
                hold.id, max(size, 1), iid, billed=usage, scopes=hold.scopes, turn=state.turn
            )
        except AdmissionRefused:
            # the answer counts more than its hold and the window has no room for the rest:
            # its item keeps the hold's size (the drift shows it at end_turn); the billed
            # usage is charged all the same
            done = yield self.session.settle_call(
                hold.id, hold.tokens, iid, billed=usage, scopes=hold.scopes, turn=state.turn
            )
        if answer is None:  # nothing to name the tokens after: given back
            yield self.session.release_call(c, [iid], turn=state.turn)
        else:
            self.known[(c, iid)] = answer
            self.answered.add(iid)
            if (yield from self._storing()):  # the compactor reads the answer's text
                yield Store(((f"{c.code}:{iid}", self.text_of(answer)),))
        state.settled.append(done)
        return done

    def void_hold(self, hold: CallHold, turn: int) -> Op[Voided]:
        """The call failed: its hold given back, in the session and in every scope."""
        done: Voided = yield self.session.void_call(hold.id, scopes=hold.scopes, turn=turn)
        return done

    def reconcile(self, held: Mapping[Consumer | str, Sequence[Obj]]) -> Op[Reconciled]:
        """Set the ledger to the app objects the prompt really holds, per consumer named."""
        plan: dict[Consumer, list[tuple[Item, Obj]]] = {}
        for consumer, objs in held.items():
            plan[Consumer.parse(consumer)] = self.items(objs)
        done: Reconciled = yield self.session.reconcile_call(
            {c: [it for it, _ in pairs] for c, pairs in plan.items()}
        )
        if (yield from self._storing()):  # (their texts too, once the ledger holds them: a
            # compaction after it reads them)
            yield Store(
                tuple(
                    (schema.content_field(c.code, it.id), self.text_of(o))
                    for c, pairs in plan.items()
                    for it, o in pairs
                )
            )
        for c, pairs in plan.items():
            for key in [k for k in self.known if k[0] == c]:
                del self.known[key]
            for it, o in pairs:
                self.known[(c, it.id)] = o
        return done


def _calibration(raw: str | None) -> tuple[dict[str, float], list[list[Any]]]:
    """The session's calibration record: the learned factors by kind and the kept reports
    (none of either without a record, or with one this version did not write)."""
    try:
        rec = json.loads(raw) if raw else {}
        factors = {
            str(k): float(v)
            for k, v in rec.get("factors", {}).items()
            if k in KINDS and float(v) > 0
        }
        reports = [list(r) for r in rec.get("reports", []) if len(r) == 3]
    except (ValueError, TypeError, AttributeError):
        return {}, []
    return factors, reports


def _solve(
    reports: Sequence[Sequence[Any]], current: Mapping[str, float], priors: Mapping[str, float]
) -> dict[str, float]:
    """The factor of each kind the reports tell enough of (``KIND_SHARE`` of some
    report's prompt, and 64 tokens): least squares over the reports, each
    ``sum(factor[kind] x base count[kind]) = billed`` (a larger report, whose bill rounds
    less, weighs more), held near the current factors (or the priors) where the reports
    cannot tell kinds apart. A solved factor outside its kind's plausible range is not
    learned."""
    kinds = sorted({k for _, raw, _ in reports for k in raw})
    told = {
        k
        for _, raw, billed in reports
        for k in raw
        if billed > 0
        and raw[k] * priors[k] >= max(64, KIND_SHARE * sum(n * priors[j] for j, n in raw.items()))
    }
    if not kinds or not told:
        return {}
    n = len(kinds)
    a = [[0.0] * n for _ in range(n)]
    y = [0.0] * n
    for _, raw, billed in reports:
        if billed <= 0:
            continue
        x = [float(raw.get(k, 0)) for k in kinds]
        for i in range(n):
            y[i] += x[i] * billed
            for j in range(n):
                a[i][j] += x[i] * x[j]
    for i, k in enumerate(kinds):  # a light pull toward what is known of each kind
        g = current.get(k, priors[k])
        w = 1e-3 * max(a[i][i], 1e-12) + (0.0 if k in told else 1e3 * max(a[i][i], 1e-12))
        a[i][i] += w
        y[i] += w * g
    f = _gauss(a, y)
    out = {}
    for k, v in zip(kinds, f, strict=True):
        if k in told and PLAUSIBLE[0] * priors[k] <= v <= PLAUSIBLE[1] * priors[k]:
            out[k] = round(v, 4)
    return out


def _gauss(a: list[list[float]], y: list[float]) -> list[float]:
    """Solve a x = y (a small symmetric positive definite system) by elimination."""
    n = len(y)
    m = [[*row, v] for row, v in zip(a, y, strict=True)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-300:
            return [0.0] * n
        for r in range(n):
            if r != c:
                q = m[r][c] / m[c][c]
                m[r] = [u - q * v for u, v in zip(m[r], m[c], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def framing_hint(report: object, state: TurnState | None) -> str | None:
    """When a flagged drift is the tool schemas' tokens the prompt sent (within the
    tolerance): what is missing is the budget's ``tool_framing``, named with its value."""
    drift = getattr(report, "drift", 0)
    tolerance = getattr(report, "tolerance", None) or 0
    framing = 0 if state is None else state.framing
    if getattr(report, "flag", None) != "drift" or framing <= 0:
        return None
    if abs(drift - framing) > tolerance:
        return None
    return (
        f"the drift is the {framing} tokens of the tool schemas the prompt sent: the "
        f"session's budget has no tool_framing for them (SessionBudget(tool_framing={framing}))"
    )


def billing_message(c: BillingCheck) -> str:
    learned = ", ".join(f"{k} x{f:g}" for k, f in sorted((c.learned or {}).items()))
    why = (
        f"the counter is off; the factors learned from it ({learned}) are applied from the "
        "next turn"
        if c.learned
        else "the counter is off (an estimate? Agent(calibrate=True) learns its factors)"
        if c.plausible
        else "the report is outside what an estimate can be off by (0.5-2x of each kind's "
        "prior): it covers what the count did not (a system message, tool schemas, images?), "
        "far less, or is wrong: nothing learned from it; count the prompt the provider bills"
    )
    return (
        f"turn {c.turn}: the provider billed {c.billed} input tokens for a prompt the ledger "
        f"counted at {c.counted} ({c.difference:+d}, tolerance {c.tolerance}): {why}"
    )
