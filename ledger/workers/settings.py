"""The worker's options (``WorkerSettings``): ``LEDGER_WORKER_*`` environment variables
or the flags of ``ledger worker``."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WorkerSettings(BaseSettings):
    """Worker options, from ``LEDGER_WORKER_*`` environment variables or flags."""

    model_config = SettingsConfigDict(env_prefix="LEDGER_WORKER_", frozen=True, extra="forbid")

    group: str = "ledger-workers"
    consumer: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    poll_interval: float = Field(
        default=0.1,
        gt=0,
        description="seconds to sleep when idle on the embedded backend (its reads do not block)",
    )
    block: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="longest wait of one blocking read of new jobs (XREADGROUP ... BLOCK) "
        "before it is sent again. On one server one read covers every partition and also "
        "ends for the timers (lease sweep, takeover, health) and below the socket timeout; "
        "on a cluster each partition has its own reader (a client whose socket timeout is "
        "the ledger's plus this): an idle cost of partitions / block reads per second",
    )
    claim_idle_ms: int = Field(default=5_000, ge=10, description="take over jobs idle this long")
    cluster_checks: float = Field(
        default=3.0,
        gt=0,
        description="on a cluster, partition checks (worker_check.lua: one EVALSHA that "
        "runs two reads) per second at most, spread evenly: each partition is checked "
        "every max(claim_idle_ms, partitions / cluster_checks); unused on one server",
    )
    max_deliveries: int = Field(default=5, ge=1, description="then dead-letter the job")
    dead_letter_max: int = Field(
        default=10_000,
        ge=1,
        description="dead letters kept per partition (the oldest go first, XADD MAXLEN ~)",
    )
    batch: int = Field(default=16, ge=1, le=1000)
    sweep_interval: float = Field(
        default=1.0,
        gt=0,
        description="seconds between lease sweeps on one server; on a cluster a partition "
        "is swept when the earliest deadline its check read is due, and again no sooner "
        "than this when a sweep leaves it overdue",
    )
    compactor: str | None = Field(
        default=None,
        description="import path 'module:attr' of the compactor for worker-owned sessions, "
        "or 'none' (this worker serves no compaction: a fleet of agent-owned sessions). No "
        "default: the worker refuses to start without one named explicitly",
    )
    max_in_flight: int = Field(
        default=16, ge=1, le=1024, description="compactions running at once in this worker"
    )
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="0: no HTTP endpoint; else /metrics, /healthz and /readyz on this port",
    )
    metrics_host: str = Field(
        default="0.0.0.0",
        description="address the HTTP endpoint listens on (with metrics_port): 0.0.0.0 "
        "every interface (a container's probes and Prometheus reach it), 127.0.0.1 this "
        "host only",
    )
    drain_seconds: float = Field(
        default=25.0,
        ge=0,
        le=30,
        description="at SIGTERM/SIGINT: no new job is taken, and the jobs running get this "
        "long to end; a job still running then stays pending (un-acknowledged) for "
        "another worker to take over. At most 30 s, so that a stop fits the usual grace "
        "period (Kubernetes' 30 s) before a SIGKILL",
    )
    health_stale_seconds: float = Field(
        default=90.0,
        gt=0,
        description="/healthz fails once the job loop has not turned for this long (it "
        "turns at least every claim_idle_ms / 4 and health_interval)",
    )
    backoff_initial: float = Field(
        default=0.1, gt=0, description="seconds to wait after a pass that met a Redis error"
    )
    backoff_max: float = Field(
        default=5.0, gt=0, description="longest wait while Redis errors go on (doubling)"
    )
    health_interval: float = Field(
        default=60.0, gt=0, description="seconds between checks of the Redis settings"
    )
    observe_interval: float = Field(
        default=15.0,
        gt=0,
        description="seconds between two metrics passes (with metrics_port): lag and "
        "dead-letter gauges per partition, and, on the one worker holding the observer "
        "lease, the fleet's indicators. The pass runs in its own thread, never in the job loop",
    )
    scope_metrics_max: int = Field(
        default=100,
        ge=0,
        le=10_000,
        description="budget scopes exported by name (ledger_scope_*{scope}) by the observer "
        "lease's holder: tenants first, then the scopes within them, each set by name; the "
        "refusals of the others are summed under scope='other'. 0: no scope metrics",
    )
    scope_scan_interval: float = Field(
        default=60.0,
        gt=0,
        description="seconds between two searches for budget scopes (one SCAN with a MATCH "
        "on the scope hashes' key prefix, on the observer lease's holder); the scopes found "
        "are read at every metrics pass",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="the lowest level of the worker's JSON log lines"
    )
    reset_wait: float = Field(
        default=30.0,
        ge=0,
        le=86_400,
        description="seconds a hard reset waits for the session's open turn to end "
        "(docs/rules.md#a-reset-waits-for-the-turns-end): staged meanwhile and applied by "
        "the call that ends the turn; the job is left pending, uncounted, and a later claim "
        "applies it once this long has passed since it was staged, the turn cut off then "
        "(its calls: TurnLost). 0: applied at once, as before protocol 4. The default is "
        "the agent's default turn lease",
    )
    turn_wait: float = Field(
        default=30.0,
        gt=0,
        description="seconds a compaction ready to commit waits for the session's open turn "
        "to end (it never changes the prompt under a running turn); then the job is left "
        "pending, uncounted, for a later claim",
    )
