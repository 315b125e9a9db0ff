"""Workflow tasks without the SDK's payload walks where every walk would change nothing.

temporalio (1.34, 1.35) walks every payload of each workflow activation before the workflow sees
it, and of each completion before the server does, three times each way: for a payload codec, for
external storage, and for a codec's encoding of storage references. A walk is a coroutine for each
message of the proto tree, run on the worker's event loop, the one thread every workflow task and
activity task goes through. Where the data converter has neither a payload codec nor external
storage (FleetMedic's, fleetmedic/converter.py), every walk returns the payloads it was given: the
SDK's own `DataConverter._decode_payload_has_effect` says as much, unused by its worker.

Measured with 50 alerts at once (py-spy --gil on the worker): the walks held a third of the event
loop's samples. In one world on the dev server, six rounds of 50 with them and six without,
alternated, the worker's own CPU per run over a round (the first tasks and what the runs went on
to do meanwhile) was 18.4 ms with the walks and 15.9 ms without, fewer in every pair (on the
production server the rounds varied more than that, either way). Alone on a quiet core, an
activation and its completion like a first task's cost ~140 µs walked and ~1 µs skipped.

A converter with a codec or external storage keeps every walk, as the SDK does them: a site's
encryption codec still sees every payload (tests/test_payload_walks.py).

What is given up where nothing is configured: the SDK's walk refuses a payload that another
client stored externally (TMPRL1105). Skipped, the payload reaches the payload converter, which
refuses its encoding instead: the task fails either way, with another message. FleetMedic stores
nothing externally.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

import temporalio.bridge.worker
from temporalio.converter import DataConverter

log = logging.getLogger(__name__)

# The SDK's functions that walk, with the parameters they take (temporalio 1.34 and 1.35). One that
# takes others is left as it is: an SDK that changed them may walk for a reason this does not know.
WALKS = {
    "decode_activation": ("activation", "data_converter", "decode_headers", "storage_concurrency_limit"),
    "encode_completion": ("completion", "data_converter", "encode_headers", "storage_concurrency_limit"),
}
_SKIPS = "_fleetmedic_skips_walks_that_change_nothing"


def walks_change_nothing(converter: DataConverter) -> bool:
    """No codec and no external storage: each walk would hand back the payloads it was given."""
    return converter.payload_codec is None and converter.external_storage is None


def skip_walks_that_change_nothing(sdk: ModuleType = temporalio.bridge.worker) -> bool:
    """From now on in this process, a workflow task whose converter has neither a codec nor
    external storage is not walked; every other one is, by the SDK's own functions. True once in
    place (a second call changes nothing); False, with a warning, where the SDK's functions are not
    the ones this knows."""
    found = {name: getattr(sdk, name, None) for name in WALKS}
    if all(getattr(walk, _SKIPS, False) for walk in found.values()):
        return True
    known = {name: walk for name, walk in found.items()
             if callable(walk) and tuple(inspect.signature(walk).parameters) == WALKS[name]}
    result = _walk_result()
    if len(known) < len(WALKS) or result is None:
        log.warning("worker: temporalio %s's payload walks are not the ones FleetMedic knows (%s); every "
                    "workflow task is walked, which costs CPU and nothing else",
                    getattr(temporalio, "__version__", "?"),
                    ", ".join(name for name in WALKS if name not in known) or "StorageOperationMetrics")
        return False
    for name, walk in known.items():
        setattr(sdk, name, _unless_it_changes_nothing(walk, result))
    return True


def _walk_result() -> Callable[[], Any] | None:
    """What the SDK's walks return (their external storage's metrics), or None where it has no such class."""
    try:
        extstore = importlib.import_module("temporalio.converter._extstore")
    except ImportError:
        return None
    made: Callable[[], Any] | None = getattr(extstore, "StorageOperationMetrics", None)
    return made


def _unless_it_changes_nothing(walk: Callable[..., Awaitable[Any]],
                               metrics: Callable[[], Any]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(walk)
    async def walk_unless_it_changes_nothing(message: Any, data_converter: DataConverter, *args: Any,
                                             **kwargs: Any) -> Any:
        if walks_change_nothing(data_converter):
            return metrics()  # what the SDK reports for a walk that stored or fetched nothing
        return await walk(message, data_converter, *args, **kwargs)

    setattr(walk_unless_it_changes_nothing, _SKIPS, True)
    return walk_unless_it_changes_nothing
