"""Background work for the ledger: ``ledger worker``, one ``Worker`` per process
(``from ledger import Worker, WorkerSettings``: imported on first use, so ``import
ledger`` stays the client alone).

The modules, each named for what it does:

- ``runner.py``: the ``Worker`` and its loop (timers, backoff, health); every name the
  rest of the package, the tests and the docs import from the worker is importable from
  here (``Worker``, ``WorkerSettings``, ``Metrics``, ``JsonFormatter``, ``mask_url``, ...).
- ``settings.py``: ``WorkerSettings``, the ``LEDGER_WORKER_*`` options.
- ``streams.py``: the job streams and their consumer group, the reads of new jobs (a
  reader thread per partition on a cluster), the jobs idle too long elsewhere claimed
  (``Takeover``, XAUTOCLAIM); the one module that sends stream commands (XREADGROUP,
  XAUTOCLAIM, XCLAIM, XACK, XDEL, XADD, ...).
- ``delivery.py``: the job threads beside the loop (at most ``max_in_flight`` jobs in
  hand), each job run, acknowledged, left pending or dead-lettered (a compaction's
  death counted as a failed compaction), and the drain at a stop.
- ``calls.py``: ``LedgerCalls``, the ledger calls the parts make, each named (a job's
  scripts, what a compaction reads and marks, the lease sweep, the observer lease).
- ``jobs.py``: the job kinds, compaction and hard reset, and the compactor's call.
- ``compactors.py``: the compactors a worker may load (``--compactor module:attr``).
- ``leases.py``: the lease sweep and, on a cluster, the partition checks.
- ``metrics.py``: the Prometheus metrics and the metrics pass (observer lease).
- ``http.py``: ``/metrics``, ``/healthz`` and ``/readyz``, and the container's probe
  (``python -m ledger.workers.http``).
- ``logs.py``: the JSON log lines and the Redis trouble the worker survives, counted.
- ``trouble.py``: what kind of Redis trouble an error is, and the backoff (no I/O).

The ``Worker`` owns one object of each part (``worker.streams``, ``worker.takeover``,
``worker.delivery``, ``worker.jobs``, ``worker.leases``, ``worker.observer``,
``worker.troubles``), each built with what it uses (``worker.calls``, the settings, the
metrics, the parts it calls) passed to its constructor: no part holds the worker, and no
module but ``runner.py`` imports ``runner``.
"""
