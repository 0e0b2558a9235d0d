"""Framework adapters, each behind an optional extra (importing ``ledger`` imports none):

* :mod:`ledger.adapters.langgraph`: ``pip install 'redis-token-ledger[langgraph]'``
  (``LedgerGraph``, and ``AsyncLedgerGraph`` for asyncio)
* :mod:`ledger.adapters.langchain`: ``pip install 'redis-token-ledger[langchain]'``
  (``LedgerMiddleware``, and ``AsyncLedgerMiddleware`` for asyncio)
* :mod:`ledger.adapters.openai_agents`: ``pip install 'redis-token-ledger[openai-agents]'``
* :mod:`ledger.adapters.otel` (spans into ``record_span``, after the fact):
  ``pip install 'redis-token-ledger[otel]'``
"""
