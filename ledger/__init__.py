"""A distributed token-budget ledger for fleets of LLM agents, backed by Redis."""

from ledger.aio import AsyncLedger, AsyncSession
from ledger.client import Ledger, Session
from ledger.errors import (
    AdmissionRefused,
    BackendUnavailable,
    ConfigurationError,
    InvalidArgument,
    LedgerError,
    OperationIdReused,
    PermissionDenied,
    ReservationExpired,
    SessionConflict,
    StaleEpoch,
    UnknownReservation,
    UnknownSession,
)
from ledger.keys import KeySpace
from ledger.models import (
    Admitted,
    AuditReport,
    Consumer,
    Item,
    Released,
    Reservation,
    SessionBudget,
    Settled,
    Snapshot,
    Voided,
)
from ledger.settings import LedgerSettings

__all__ = [
    "AdmissionRefused",
    "Admitted",
    "AsyncLedger",
    "AsyncSession",
    "AuditReport",
    "BackendUnavailable",
    "ConfigurationError",
    "Consumer",
    "InvalidArgument",
    "Item",
    "KeySpace",
    "Ledger",
    "LedgerError",
    "LedgerSettings",
    "OperationIdReused",
    "PermissionDenied",
    "Released",
    "Reservation",
    "ReservationExpired",
    "Session",
    "SessionBudget",
    "SessionConflict",
    "Settled",
    "Snapshot",
    "StaleEpoch",
    "UnknownReservation",
    "UnknownSession",
    "Voided",
]
__version__ = "0.1.0"
