"""The Temporal data converter of every FleetMedic client, worker and replayer: pydantic models
as JSON, with one cache of pydantic TypeAdapters for the whole process.

The SDK makes a payload converter for each workflow instance it runs (and each serialization
context), and temporalio.contrib.pydantic's converter keeps its TypeAdapters (a schema validator
and serializer each) in a cache of its own. So every cached run built and kept its own adapters
for its input, the node reads, the step results (about eight a run, 10-25 KB of the ~230 KB a
waiting run costs the worker; 5,000 runs in flight peaked at 1.15 GB). Adapters are immutable and
safe to share across threads, and what they parse or write does not depend on who holds them:
workflows replay the same.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import TypeAdapter
from temporalio.contrib.pydantic import PydanticJSONPlainPayloadConverter, PydanticPayloadConverter
from temporalio.converter import DataConverter

# The type hints payloads are read as are few (the contracts in models.py and policy.py), so the
# SDK's own bound of 1,024 is never reached in practice; it stays a bound.
shared_type_adapter: functools._lru_cache_wrapper[TypeAdapter[Any]] = functools.lru_cache(maxsize=1024)(TypeAdapter)


class SharedPydanticPayloadConverter(PydanticPayloadConverter):
    """temporalio.contrib.pydantic's converter, its JSON part reading through the process's cache."""

    def __init__(self) -> None:
        super().__init__()
        for converter in self.converters.values():
            if isinstance(converter, PydanticJSONPlainPayloadConverter):
                converter._type_adapter = shared_type_adapter


data_converter = DataConverter(payload_converter_class=SharedPydanticPayloadConverter)
