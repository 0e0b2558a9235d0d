"""The asyncio faces, written by hand: each module here is the source of its sync twin
in :mod:`ledger._sync` (``python tools/unasync.py``). Import them from their public
modules: :mod:`ledger.aio` and :mod:`ledger.agent.aio` (or from ``ledger``), and
:mod:`ledger.adapters.langgraph` and :mod:`ledger.adapters.langchain` for the adapters."""
