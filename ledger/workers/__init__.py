"""Background work for the ledger: the worker loop and its settings (``runner.py``:
``ledger.workers.runner.Worker``, run by ``ledger worker``), the compactors it calls
(``compactors.py``), its metrics and health endpoint (``http.py``), and how it tells a
condition of Redis from a job's own failure and waits it out (``trouble.py``)."""
