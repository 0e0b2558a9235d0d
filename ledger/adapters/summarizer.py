"""An LLM summarizer as the worker's compactor.

:class:`LLMSummarizer` is an ``async`` compactor: it replaces a session's history (all
working-memory items but the newest ``keep_last``, and retrieval chunks and tool
results from earlier turns) by one summary the model writes from their text, counted
with the counter the agent uses (plus its ``item_overhead``), so that the summary the
agent puts in its prompt costs exactly what the ledger holds for it. Only items whose
text is in the request (stored by the agent layer in the content store) are replaced:
the summarizer never drops what it cannot read.

The model is either a LangChain chat model (anything with ``ainvoke(messages)``
answering a message with ``content``) or :class:`OpenAICompatibleChat`, a minimal
client of an OpenAI-compatible ``/chat/completions`` endpoint. ``openai_from_env``
names one to the worker by environment::

    LEDGER_WORKER_COMPACTOR=ledger.adapters.summarizer:openai_from_env
    LEDGER_SUMMARIZER_BASE_URL=https://api.openai.com/v1  LEDGER_SUMMARIZER_MODEL=gpt-4o-mini
    LEDGER_SUMMARIZER_API_KEY=...   (optional)  LEDGER_SUMMARIZER_ITEM_OVERHEAD=0
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

from ledger import schema
from ledger.errors import ConfigurationError
from ledger.extras import need
from ledger.models import Consumer, HeldItem, Item
from ledger.workers.compactors import CompactionPlan, CompactionRequest

PROMPT = (
    "Summarize the conversation history below for an assistant that will continue it. "
    "Keep facts, decisions, open questions, names and numbers; drop chit-chat. Answer "
    "with the summary only."
)


def history(request: CompactionRequest, keep_last: int) -> list[HeldItem]:
    """The items a compaction replaces: working memory but the newest ``keep_last``,
    and retrieval chunks and tool results from earlier turns, oldest first; only those
    whose text the request carries. Items of one id in two consumers (a tool call in
    working memory and its result in the scratchpad) go together or stay together: a
    call without its result, or the reverse, is what chat APIs refuse or prune."""
    wm = [i for i in request.items if i.consumer is Consumer.WORKING_MEMORY]
    old = wm[: max(0, len(wm) - keep_last)] + [
        i
        for i in request.items
        if i.consumer in (Consumer.RETRIEVAL, Consumer.SCRATCHPAD) and i.turn < request.turn
    ]
    old = [i for i in old if request.text_of(i) is not None]
    chosen = {(i.consumer, i.id) for i in old}
    pairs: dict[str, set[Consumer]] = {}
    for i in request.items:
        pairs.setdefault(i.id, set()).add(i.consumer)
    # an item whose twin stays, stays
    return [
        i
        for i in old
        if all((c, i.id) in chosen for c in pairs.get(i.id, ()) if c is not i.consumer)
    ]


class LLMSummarizer:
    """``await summarizer(request) -> CompactionPlan``: the model's summary of the history."""

    def __init__(
        self,
        model: Any,
        counter: Callable[[str], int],
        *,
        item_overhead: int = 0,
        keep_last: int = 2,
        prompt: str = PROMPT,
    ) -> None:
        if not hasattr(model, "ainvoke"):
            raise ConfigurationError(
                f"the summarizer's model needs ainvoke(messages) (a LangChain chat model or "
                f"OpenAICompatibleChat), got {type(model).__name__}"
            )
        self.model = model
        self.counter = counter
        self.item_overhead = item_overhead
        self.keep_last = keep_last
        self.prompt = prompt

    async def __call__(self, request: CompactionRequest) -> CompactionPlan:
        old = history(request, self.keep_last)
        if not old:
            return CompactionPlan((), None)
        body = "\n\n".join(f"[{i.consumer.value} {i.id}]\n{request.text_of(i)}" for i in old)
        answer = await self.model.ainvoke(
            [{"role": "system", "content": self.prompt}, {"role": "user", "content": body}]
        )
        text = getattr(answer, "content", answer)
        if not isinstance(text, str) or not text.strip():
            raise RuntimeError(f"the summarizer's model answered no text: {answer!r:.200}")
        tokens = int(self.counter(text)) + self.item_overhead
        digest = hashlib.blake2b(
            "|".join(
                [
                    request.session_id,
                    str(request.turn),
                    *(schema.content_field(i.consumer.code, i.id) for i in old),
                ]
            ).encode(),
            digest_size=6,
        ).hexdigest()
        return CompactionPlan(
            tuple((i.consumer, i.id) for i in old),
            Item(f"summary-t{request.turn}-{digest}", max(1, tokens), 1000),
            summary_text=text,
        )


class _Reply:
    def __init__(self, content: str) -> None:
        self.content = content


class OpenAICompatibleChat:
    """``await chat.ainvoke(messages)``: one ``POST {base_url}/chat/completions``."""

    def __init__(
        self, base_url: str, model: str, api_key: str | None = None, timeout: float = 60.0
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout

    async def ainvoke(self, messages: list[dict[str, str]]) -> _Reply:
        httpx = need("httpx", "summarizer", "the OpenAI-compatible summarizer")

        async with httpx.AsyncClient(timeout=self.timeout) as client:
            r = await client.post(
                self.url, json={"model": self.model, "messages": messages}, headers=self.headers
            )
            r.raise_for_status()
            return _Reply(str(r.json()["choices"][0]["message"]["content"]))


class _FromEnv:
    """A summarizer made from ``LEDGER_SUMMARIZER_*`` on first use."""

    def __init__(self) -> None:
        self._made: LLMSummarizer | None = None

    def make(self) -> LLMSummarizer:
        if self._made is None:
            base, model = (
                os.environ.get("LEDGER_SUMMARIZER_BASE_URL"),
                os.environ.get("LEDGER_SUMMARIZER_MODEL"),
            )
            if not base or not model:
                raise ConfigurationError(
                    "openai_from_env needs LEDGER_SUMMARIZER_BASE_URL and LEDGER_SUMMARIZER_MODEL"
                )
            from ledger.agent.counters import TiktokenCounter

            self._made = LLMSummarizer(
                OpenAICompatibleChat(base, model, os.environ.get("LEDGER_SUMMARIZER_API_KEY")),
                TiktokenCounter(),
                item_overhead=int(os.environ.get("LEDGER_SUMMARIZER_ITEM_OVERHEAD", "0")),
            )
        return self._made

    def check(self) -> None:
        """What the worker runs at start: the ``summarizer`` extra and the variables are
        there (a ConfigurationError says which is missing), so that no job is read by a
        worker that would fail every one."""
        need("httpx", "summarizer", "the OpenAI-compatible summarizer")
        self.make()

    async def __call__(self, request: CompactionRequest) -> CompactionPlan:
        return await self.make()(request)


openai_from_env = _FromEnv()
