"""A distributed token-budget ledger for fleets of LLM agents, backed by Redis."""

from typing import TYPE_CHECKING, Any

from ledger import models
from ledger._version import __version__ as __version__
from ledger.agent import Agent, AsyncAgent, EstimatingCounter, TiktokenCounter
from ledger.aio import AsyncLedger, AsyncSession
from ledger.client import Ledger, Session
from ledger.core import LocalAllowance, new_op_id
from ledger.errors import (
    AdmissionRefused,
    BackendUnavailable,
    BillingDriftWarning,
    CeilingReached,
    CompactionPending,
    ConfigurationError,
    ContextDrift,
    ContextDriftWarning,
    ContextOverflow,
    DamagedSession,
    FanoutRefused,
    InvalidArgument,
    LedgerClosed,
    LedgerError,
    NotReplicated,
    OperationIdReused,
    PermissionDenied,
    RefusalReason,
    ReservationExpired,
    SessionConflict,
    StaleEpoch,
    TurnConflict,
    TurnInProgress,
    TurnLost,
    UnknownReservation,
    UnknownScope,
    UnknownSession,
    VersionMismatch,
    WorkingMemoryStarvation,
)
from ledger.extras import MissingExtra
from ledger.keys import KeySpace
from ledger.models import *  # noqa: F403 (models.__all__)
from ledger.settings import LedgerSettings

if TYPE_CHECKING:
    from ledger.workers.runner import Worker as Worker
    from ledger.workers.runner import WorkerSettings as WorkerSettings

__all__ = [
    "Agent",
    "AsyncAgent",
    "EstimatingCounter",
    "TiktokenCounter",
    "AdmissionRefused",
    "BillingDriftWarning",
    "RefusalReason",
    "AsyncLedger",
    "AsyncSession",
    "FanoutRefused",
    "WorkingMemoryStarvation",
    "BackendUnavailable",
    "NotReplicated",
    "ConfigurationError",
    "ContextDrift",
    "ContextDriftWarning",
    "ContextOverflow",
    "DamagedSession",
    "InvalidArgument",
    "KeySpace",
    "Ledger",
    "LedgerClosed",
    "LedgerError",
    "LedgerSettings",
    "MissingExtra",
    "OperationIdReused",
    "PermissionDenied",
    "ReservationExpired",
    "Session",
    "SessionConflict",
    "StaleEpoch",
    "TurnConflict",
    "TurnInProgress",
    "TurnLost",
    "CompactionPending",
    "UnknownReservation",
    "UnknownScope",
    "CeilingReached",
    "UnknownSession",
    "VersionMismatch",
    "new_op_id",
    "LocalAllowance",
]
__all__ += models.__all__  # type: ignore[attr-defined]  # run time only, see models


def __getattr__(name: str) -> Any:
    """``ledger.Worker`` and ``ledger.WorkerSettings``, the background worker, imported on
    first use: ``import ledger`` stays the client alone (the worker's metrics need the
    ``[worker]`` extra)."""
    if name in ("Worker", "WorkerSettings"):
        from ledger.workers import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'ledger' has no attribute {name!r}")
