"""A distributed token-budget ledger for fleets of LLM agents, backed by Redis."""

from ledger import models
from ledger.agent import Agent, AsyncAgent, EstimatingCounter, TiktokenCounter
from ledger.aio import AsyncLedger, AsyncSession
from ledger.client import Ledger, Session
from ledger.core import new_op_id
from ledger.errors import (
    AdmissionRefused,
    BackendUnavailable,
    BillingDriftWarning,
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
    UnknownSession,
    WorkingMemoryStarvation,
)
from ledger.extras import MissingExtra
from ledger.keys import KeySpace
from ledger.models import *  # noqa: F403 (models.__all__)
from ledger.settings import LedgerSettings

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
    "UnknownSession",
    "new_op_id",
]
__all__ += models.__all__
__version__ = "0.1.0"
