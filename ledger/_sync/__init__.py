"""The sync faces, generated from :mod:`ledger._async` by ``python tools/unasync.py``
(never edited by hand). Import them from their public modules: :mod:`ledger.client` and
:mod:`ledger.agent.sync` (or from ``ledger``), and :mod:`ledger.adapters.langgraph` and
:mod:`ledger.adapters.langchain` for the adapters."""
