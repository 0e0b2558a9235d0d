"""A summarizer compactor for fleet tests' `ledger worker` processes
(``--compactor tests.support.fleet_compactor:SUMMARIZER``): the real LLMSummarizer over a stub
LangChain chat model, counting with the agent layer's tokenizer (no item overhead);
``SLOW_SUMMARIZER`` takes a second a summary."""

from __future__ import annotations

import os
import time
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from ledger.adapters.summarizer import LLMSummarizer
from ledger.agent import TiktokenCounter


class StubSummarizer(BaseChatModel):
    """A summary naming how much it read (no network)."""

    @property
    def _llm_type(self) -> str:
        return "stub-summarizer"

    def _generate(
        self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> ChatResult:
        body = str(messages[-1].content)
        text = f"Summary of {body.count('[')} earlier items, {len(body)} characters read."
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text))])


SUMMARIZER = LLMSummarizer(StubSummarizer(), TiktokenCounter())


class SlowStubSummarizer(StubSummarizer):
    """The same summary after ``LEDGER_TEST_SUMMARY_S`` seconds (1 by default): an LLM
    call that outlasts many turns of an agent that never pauses."""

    def _generate(
        self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> ChatResult:
        time.sleep(float(os.environ.get("LEDGER_TEST_SUMMARY_S", "1.0")))
        return super()._generate(messages, stop, run_manager, **kw)


SLOW_SUMMARIZER = LLMSummarizer(SlowStubSummarizer(), TiktokenCounter())
