"""One line in the worker's log for each failed activity attempt whose cause FleetMedic named.

The SDK logs every failed attempt as "Completing activity as failed" with the exception's whole
traceback. An activity that meets a system it cannot reach raises an ApplicationError of one of
fleetmedic/errors.py's kinds, whose message already says which system and what it answered
("kube-apiserver at 10.0.0.1:6443 unreachable: get node gpu-7: …"), and its step retries it within
its bound: each try was ~45 lines of the SDK's and our frames around that one line (5 tries of one
run's protective step, the API server unreachable: 236 lines). Every run that meets the outage
writes its own, and a bug's traceback is lost among them; bench/worker_scale counted 682 in one run
on the production server, each a guard too busy to take a request that the next try delivered.

So such a failure is logged as one line, at the SDK's level (WARNING), with the SDK's own activity
fields and the error's kind and message. Any other exception (a bug, a client library's error that
nothing classified) keeps its traceback. The run's own status and history keep every failure either
way; this changes only what the log shows.
"""

from __future__ import annotations

import logging

from temporalio.exceptions import ApplicationError

from fleetmedic.errors import NON_RETRYABLE, ErrorKind

# The SDK's logger for activity attempts (temporalio.activity.logger writes through it).
ACTIVITY_LOGGER = "temporalio.activity"
NAMED = frozenset(kind.value for kind in ErrorKind)


class NamedFailureLines(logging.Filter):
    """Folds a classified failure's traceback into its line: the SDK's message, then the kind and
    the error's own message."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, ApplicationError) and error.type in NAMED:
            final = " (not retryable)" if error.type in NON_RETRYABLE or error.non_retryable else ""
            record.msg = f"{record.getMessage()}: {error.type}: {error.message}{final}"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


def one_line_for_named_failures() -> None:
    """Installs the filter on the SDK's activity logger, once per process."""
    logger = logging.getLogger(ACTIVITY_LOGGER)
    if not any(isinstance(f, NamedFailureLines) for f in logger.filters):
        logger.addFilter(NamedFailureLines())
