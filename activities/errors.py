"""Turning client failures into Temporal errors that say whether a retry can help."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import httpx
from temporalio import activity
from temporalio.exceptions import ApplicationError

from fleetmedic.errors import NON_RETRYABLE, ErrorKind, kind_for_http_status

T = TypeVar("T")
# A read-modify-write that meets a 409 reads again this many times before Temporal's retry takes over.
CONFLICT_RETRIES = 5


def fail(kind: ErrorKind, message: str, *details: object) -> ApplicationError:
    """An ApplicationError of `kind`; retryable unless the kind never gets better by retrying."""
    return ApplicationError(message, *details, type=str(kind), non_retryable=kind in NON_RETRYABLE)


def from_http_status(status: int, message: str) -> ApplicationError:
    return fail(kind_for_http_status(status), f"HTTP {status}: {message}")


@contextmanager
def http_errors(what: str) -> Iterator[None]:
    """An HTTP call to a service of ours (node agent, provider, slurmrestd): a timeout or a refused
    connection is retryable and says which."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise fail(ErrorKind.TIMEOUT, f"{what} timed out: {exc}") from None
    except httpx.HTTPError as exc:
        raise fail(ErrorKind.UNAVAILABLE, f"{what} unreachable: {exc}") from None


def raise_for_status(response: httpx.Response, what: str) -> None:
    if response.status_code >= 400:
        raise from_http_status(response.status_code, f"{what}: {response.text[:200]}")


def reread_on_conflict(what: str, attempt: Callable[[], T]) -> T:
    """A read-modify-write: run `attempt` (which reads, changes and writes with the resourceVersion)
    again on a 409 — someone changed the object between our read and our write."""
    for number in range(CONFLICT_RETRIES):
        try:
            return attempt()
        except ApplicationError as exc:
            if exc.type != ErrorKind.CONFLICT or number == CONFLICT_RETRIES - 1:
                raise
            activity.logger.info("%s changed under us (409): again on the fresh object", what)
    raise AssertionError("unreachable")
