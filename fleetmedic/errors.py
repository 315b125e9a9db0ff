"""Error kinds activities raise, so workflows and retry policies can tell them apart.

Activities raise `temporalio.exceptions.ApplicationError` with one of these types; the
non-retryable ones are listed in every retry policy, the rest retry within their bound.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import ValidationError


class ErrorKind(StrEnum):
    NOT_FOUND = "NotFound"  # the object is gone: retrying will not bring it back
    FORBIDDEN = "Forbidden"  # RBAC or auth: a human must fix it
    INVALID = "Invalid"  # a bad request we made: a bug or bad input
    NOT_OWNED = "NotOwned"  # a Slurm reason or annotation somebody else owns
    CONFLICT = "Conflict"  # lost an optimistic-concurrency race: retry on the fresh object
    UNAVAILABLE = "Unavailable"  # 5xx, connection refused, controller down: retry
    TIMEOUT = "Timeout"  # the call took longer than its timeout: retry
    BLOCKED = "Blocked"  # e.g. a PodDisruptionBudget still refuses after the deadline


NON_RETRYABLE: tuple[str, ...] = (
    ErrorKind.NOT_FOUND, ErrorKind.FORBIDDEN, ErrorKind.INVALID, ErrorKind.NOT_OWNED,
)


def validation_errors(exc: ValidationError) -> list[tuple[str, str]]:
    """Each problem pydantic found: where (the dotted field path, "" for the whole input) and why.
    Every refusal of outside input (a policy file, an alert, the environment, a start input) is one
    line built from these."""
    return [(".".join(str(part) for part in error["loc"]), str(error["msg"])) for error in exc.errors()]


def kind_for_http_status(status: int) -> ErrorKind:
    if status == 404 or status == 410:
        return ErrorKind.NOT_FOUND
    if status in (401, 403):
        return ErrorKind.FORBIDDEN
    if status == 409:
        return ErrorKind.CONFLICT
    if status == 429:
        return ErrorKind.BLOCKED
    if status in (408, 504):
        return ErrorKind.TIMEOUT
    if 400 <= status < 500:
        return ErrorKind.INVALID
    return ErrorKind.UNAVAILABLE
