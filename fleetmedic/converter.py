"""The Temporal data converter of every FleetMedic client, worker and replayer: pydantic models
as JSON, with one cache of pydantic TypeAdapters for the whole process.

The SDK makes a payload converter for each workflow instance it runs (and each serialization
context), and temporalio.contrib.pydantic's converter keeps its TypeAdapters (a schema validator
and serializer each) in a cache of its own. So every cached run built and kept its own adapters
for its input, the node reads, the step results (about eight a run, 10-25 KB of the ~230 KB a
waiting run costs the worker; 5,000 runs in flight peaked at 1.15 GB). Adapters are immutable and
safe to share across threads, and what they parse or write does not depend on who holds them:
workflows replay the same.

The policy is read by every run at its start (a local activity's result, 6 KB of JSON for the
default): validating it cost each run 0.7 ms of the worker's CPU, and writing it out again to share
it 0.1 ms, for a document that changes only when an operator changes it. Equal payloads are read
once and the frozen model shared: the policy alone (the fleet guard's `config.policy`) and with
the worker's context (a node run's `config.run`, since 0.2.0).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from pydantic import TypeAdapter
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import PydanticJSONPlainPayloadConverter, PydanticPayloadConverter
from temporalio.converter import DataConverter

from fleetmedic.activity_refs import RunConfig
from fleetmedic.policy import Policy

# The type hints payloads are read as are few (the contracts in models.py and policy.py), so the
# SDK's own bound of 1,024 is never reached in practice; it stays a bound.
shared_type_adapter: functools._lru_cache_wrapper[TypeAdapter[Any]] = functools.lru_cache(maxsize=1024)(TypeAdapter)


# Frozen documents that many runs read equal: read once per distinct payload (the newest few kept).
# A configuration read left out of this list validates the whole policy again in every run's first
# task, and shared() writes it out again (RunConfig was, from the read's fold into config.run until
# a profile found it: 0.2 ms a run on a quiet core, more in a storm).
READ_ONCE: tuple[type, ...] = (Policy, RunConfig)
READ_ONCE_KEEP = 8
_read_once: dict[tuple[type, bytes], Any] = {}


class SharedPydanticJSONConverter(PydanticJSONPlainPayloadConverter):
    """temporalio.contrib.pydantic's JSON converter reading through the process's adapters, and
    the frozen documents in READ_ONCE once per distinct payload."""

    def __init__(self) -> None:
        super().__init__()
        self._type_adapter = shared_type_adapter

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        if type_hint not in READ_ONCE:
            return super().from_payload(payload, type_hint)
        key = (type_hint, payload.data)
        found = _read_once.get(key)
        if found is None:
            found = super().from_payload(payload, type_hint)
            if len(_read_once) >= READ_ONCE_KEEP:  # runs call this from the workflow threads at once:
                _read_once.clear()                 # single, atomic dict operations only
            _read_once[key] = found
        return found


class SharedPydanticPayloadConverter(PydanticPayloadConverter):
    """temporalio.contrib.pydantic's converter, its JSON part `SharedPydanticJSONConverter`; one
    instance per process. The SDK builds a DataConverter for each serialization context — each
    workflow activation and activity task — and with it a payload converter from this class: building
    one (its converters, an LRU cache) was 1% of the worker's CPU in a storm, for an object that
    holds no state of its own (none of its converters depends on the context)."""

    _one: ClassVar[SharedPydanticPayloadConverter | None] = None

    def __new__(cls) -> SharedPydanticPayloadConverter:
        if cls._one is None:
            one = super().__new__(cls)
            PydanticPayloadConverter.__init__(one)
            one._set_converters(*(SharedPydanticJSONConverter() if isinstance(c, PydanticJSONPlainPayloadConverter)
                                  else c for c in one.converters.values()))
            # Shared only while no converter takes a context: one that did would get its own
            # instances from `with_context`, which sets them on a fresh `cls()`, this very object.
            if one._any_converter_takes_context:
                raise TypeError("a payload converter takes a serialization context: it cannot be shared")
            cls._one = one
        return cls._one

    def __init__(self) -> None:
        pass  # built once, in __new__


data_converter = DataConverter(payload_converter_class=SharedPydanticPayloadConverter)
