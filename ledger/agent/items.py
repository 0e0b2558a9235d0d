"""What an agent knows of its items: the app objects it maps to ledger items (ids,
token counts, consumers), the tenant and scopes it names, and the checks of a prompt."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any

from ledger import schema
from ledger.agent.counters import Calibrated, Tally, count, cut_to, is_estimate
from ledger.agent.effects import Obj
from ledger.agent.ids import default_id, default_text, ledger_id
from ledger.agent.turns import default_summary
from ledger.core import SessionCore
from ledger.errors import (
    ContextOverflow,
    InvalidArgument,
)
from ledger.keys import check_scope, tenant_of
from ledger.models import (
    Consumer,
    Item,
    Snapshot,
)
from ledger.protocol import ID_RE, Call


class AgentBase:
    """Maps app objects to ledger items for one session: the base of
    :class:`~ledger.agent.core.AgentCore`, which plans every call."""

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
        # the epoch this agent's handle had when a staged hard reset applied as its last
        # turn ended (docs/rules.md#a-reset-waits-for-the-turns-end): the next turn is the
        # turn after a reset (its reset_from_epoch), with no StaleEpoch round trip
        self.reset_at_end: int | None = None
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

    def adapter_tenant(self, tenant: str | None, scopes: Sequence[str], model: str | None) -> None:
        """An adapter's ``tenant=``, ``scopes=`` and ``model=``: with ``tenant=``, name it
        (keeping the agent's ``hold_ms``: an adapter sets none); without, ``scopes=`` or
        ``model=`` is refused, as ``Agent`` refuses them, rather than dropped."""
        if tenant is not None:
            self.name_tenant(tenant, scopes, model=model, hold_ms=self.hold_ms)
        elif scopes or model is not None:
            raise InvalidArgument(
                "scopes= and model= charge a tenant's ceilings: name tenant= with them"
            )

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

    def _named(self, obj: Obj) -> str:
        """An object as an error names it."""
        return f"{type(obj).__name__} {self.app_id(obj)!s:.60}"

    def item_id(self, obj: Obj) -> str:
        return ledger_id(self.app_id(obj))

    def read_text(self, obj: Obj) -> Any:
        """``text_of(obj)``; its failure an InvalidArgument."""
        try:
            return self.text_of(obj)
        except InvalidArgument:
            raise
        except Exception as exc:
            raise InvalidArgument(f"text_of raised {type(exc).__name__}: {exc}") from exc

    def tokens(self, obj: Obj) -> int:
        return self.counter.checked(self.read_text(obj), self._named, of=obj) + self.item_overhead

    def items(
        self, objs: Iterable[Obj], priority: int = 0, texts: list[str] | None = None
    ) -> list[tuple[Item, Obj]]:
        """Every object's Item, all checked before anything is sent; ``texts``, when given,
        gets each item's text. Every id and text is read first, then every text counted
        (the counter's calls back to back: a tokenizer's tables stay in the caches, and so
        does this loop); an error is raised in the objects' order, as one loop raises it."""
        out, seen = [], set()
        read: list[tuple[Obj, str, Any]] = []  # (object, item id, text)
        failed: Exception | None = None
        try:
            for obj in objs:
                iid = self.item_id(obj)
                if iid in seen:
                    continue  # the same object twice: one item
                seen.add(iid)
                read.append((obj, iid, self.read_text(obj)))
        except Exception as exc:  # (raised once the objects before it are counted)
            failed = exc
        checked, overhead, named = self.counter.checked, self.item_overhead, self._named
        for obj, iid, text in read:
            n = checked(text, named, of=obj) + overhead
            if n == 0:
                raise InvalidArgument(
                    f"{type(obj).__name__} {self.app_id(obj)!s:.60} counts 0 tokens"
                )
            out.append((Item(iid, n, priority), obj))
            if texts is not None:
                texts.append(text)
        if failed is not None:
            raise failed
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
        if type(prompt) is list or isinstance(prompt, Sequence):
            # a plain string among the parts is the budget's fixed text (the system prompt):
            # counted as the budget counted it, with the counter itself
            counter = self.counter
            with counter.measure():
                text_of = self.text_of
                texts = [text_of(o) for o in prompt]  # (every part's text, then the counts)
                return counter.parts(prompt, texts, "a prompt part") + self.item_overhead * len(
                    texts
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
