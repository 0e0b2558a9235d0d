"""Settings read from the environment (prefix ``LEDGER_``) or passed in code."""

from __future__ import annotations

import math
from typing import Any, Literal, Self

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ledger.errors import ConfigurationError


class LedgerSettings(BaseSettings):
    """Connection, key layout and retry policy.

    ``LEDGER_REDIS_URL`` picks the backend: ``redis://``, ``rediss://``, ``unix://``,
    ``redis+cluster://host:port`` (``rediss+cluster://`` with TLS) for Redis Cluster, or
    ``embedded://`` (fakeredis in this process, no server). There is no default: a
    ledger with no URL refuses to connect (:func:`require_url`), because an implicit
    in-process backend gives every process its own ledger, the over-allocation the
    ledger exists to prevent. Ask for ``embedded://`` by name for the demo and tests.
    """

    model_config = SettingsConfigDict(env_prefix="LEDGER_", frozen=True, extra="forbid")

    redis_url: str | None = None
    prefix: str = Field(default="ledger", pattern=r"^[A-Za-z0-9._:-]{1,64}$")
    partitions: int = Field(default=64, ge=1, le=16384)
    socket_timeout: float = Field(default=5.0, gt=0, description="seconds per command")
    connect_timeout: float = Field(default=2.0, gt=0)
    retry_attempts: int = Field(
        default=5, ge=1, le=100, description="tries per call, first included"
    )
    retry_max_seconds: float = Field(
        default=10.0, gt=0, description="stop retrying after this long"
    )
    retry_initial_backoff: float = Field(default=0.02, gt=0)
    retry_max_backoff: float = Field(default=1.0, gt=0)
    op_retention_seconds: int = Field(
        default=120,
        ge=1,
        le=86_400,
        description=(
            "seconds an outcome is kept for retries: at least retry_max_seconds + "
            "socket_timeout + retry_max_backoff (the span in which the ledger may re-send a "
            "call), and longer than any window in which you re-send an op id yourself"
        ),
    )
    turn_lease_ms: int = Field(
        default=30_000,
        ge=1,
        le=86_400_000,
        description=(
            "milliseconds a turn's lease lasts without a renewal (docs/agent.md#turn-leases): "
            "once it lapses, another process may take the turn and the worker rolls it back"
        ),
    )
    replica_acks: int = Field(
        default=0,
        ge=0,
        le=64,
        description=(
            "replicas that must hold each write before the call returns (WAIT on the "
            "connection that made it, docs/reliability.md#replication): 0 returns once the "
            "primary applied it, and a failover may then lose the writes of the last moments"
        ),
    )
    replica_ack_timeout_ms: int = Field(
        default=1_000,
        ge=1,
        le=60_000,
        description="milliseconds a write waits for its replicas before NotReplicated",
    )
    drift_action: Literal["warn", "raise"] = Field(
        default="warn",
        description="a flagged drift at end_turn: ContextDriftWarning, or raise ContextDrift",
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigurationError(f"invalid ledger settings: {exc}") from exc

    @model_validator(mode="after")
    def _retention_covers_retries(self) -> Self:
        # An op id re-sent after its outcome was dropped is a new call, charged again:
        # every re-send the ledger makes must reach Redis while the outcome is kept.
        # The first try may take a whole timeout; retries start until retry_max_seconds
        # after it, each after up to retry_max_backoff of sleep.
        need = math.ceil(self.retry_max_seconds + self.socket_timeout + self.retry_max_backoff)
        if self.retry_attempts > 1 and self.op_retention_seconds < need:
            raise ValueError(
                f"op_retention_seconds {self.op_retention_seconds} is shorter than the retry "
                f"window (retry_max_seconds {self.retry_max_seconds} + socket_timeout "
                f"{self.socket_timeout} + retry_max_backoff {self.retry_max_backoff}): a retry "
                "could arrive after its first outcome was dropped and be charged again; use "
                f"op_retention_seconds >= {need}"
            )
        return self


NO_URL = (
    "no Redis URL: set LEDGER_REDIS_URL (or pass --url / a url) to the Redis every "
    "process of the fleet shares, or 'embedded://' explicitly for an in-process ledger "
    "(one per process: for the demo and tests only)"
)


def require_url(settings: LedgerSettings) -> str:
    """The settings' Redis URL; :class:`ConfigurationError` when none is set."""
    if not settings.redis_url:
        raise ConfigurationError(NO_URL)
    return settings.redis_url
