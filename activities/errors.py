"""Turning client failures into Temporal errors that say whether a retry can help."""

from __future__ import annotations

from temporalio.exceptions import ApplicationError

from fleetmedic.errors import NON_RETRYABLE, ErrorKind, kind_for_http_status


def fail(kind: ErrorKind, message: str, *details: object) -> ApplicationError:
    """An ApplicationError of `kind`; retryable unless the kind never gets better by retrying."""
    return ApplicationError(message, *details, type=str(kind), non_retryable=kind in NON_RETRYABLE)


def from_http_status(status: int, message: str) -> ApplicationError:
    return fail(kind_for_http_status(status), f"HTTP {status}: {message}")
