"""The history run's compactor: the simulated one, each plan it makes recorded.

The worker of a history run names ``tests.support.history.compactor:recording``: every plan
with a summary is written to the file ``HISTORY_COMPACTIONS`` names (an ``inv`` line
in the clients' format, op ``compact``, op id the summary's id, its outcome unknown: a
plan may be committed, staged then landed, found stale, or lost with its worker). The
checker needs them for one legal interleaving no call's reply shows: a summary given
back by a rollback and replaced by a later compaction before a turn took it again leaves
the delivery queue (docs/compaction.md), so that no later begin names it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from itertools import count

from ledger.workers.compactors import CompactionPlan, CompactionRequest, simulated

_n = count(1)
_me = f"worker-{uuid.uuid4().hex[:8]}"  # (a pid may come again: one name a process)


def recording(request: CompactionRequest) -> CompactionPlan:
    plan = simulated(request)
    path = os.environ.get("HISTORY_COMPACTIONS")
    if plan.summary is not None and path:
        line = {
            "k": "inv", "p": _me, "n": next(_n), "op": "compact",
            "sid": request.session_id, "id": plan.summary.id,
            "a": {"summary": plan.summary.id, "turn": request.turn, "epoch": request.epoch,
                  "replaced": [[c.code, i] for c, i in plan.replaced]},
            "t": time.time(),
        }  # fmt: skip
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())
        finally:
            os.close(fd)
    return plan
