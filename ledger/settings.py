"""Settings read from the environment (prefix ``LEDGER_``) or passed in code."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class LedgerSettings(BaseSettings):
    """Connection, key layout and retry policy.

    ``LEDGER_REDIS_URL`` picks the backend: ``embedded://`` (fakeredis in this
    process, no server), ``redis://``, ``rediss://``, ``unix://``, or
    ``redis+cluster://host:port`` (``rediss+cluster://`` with TLS) for Redis Cluster.
    """

    model_config = SettingsConfigDict(env_prefix="LEDGER_", frozen=True, extra="forbid")

    redis_url: str = "embedded://"
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
        description="seconds an outcome is kept for retries (> retry_max_seconds)",
    )
    drift_action: Literal["warn", "raise"] = Field(
        default="warn",
        description="a flagged drift at end_turn: ContextDriftWarning, or raise ContextDrift",
    )
