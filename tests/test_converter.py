"""The data converter: pydantic contracts as JSON, and one set of TypeAdapters for the process
however many runs the worker keeps (the SDK makes a payload converter per workflow instance)."""

from __future__ import annotations

import gc

from pydantic import TypeAdapter
from temporalio.contrib.pydantic import PydanticPayloadConverter

from fleetmedic.converter import data_converter
from fleetmedic.models import NodeInfo, NodeRunbookInput
from fleetmedic.policy import Policy

VALUES = (Policy(), NodeRunbookInput(cluster="c", node="n1", gpu=0, xid=79), NodeInfo(name="n1", ready=True))


def adapters() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, TypeAdapter))


def read_as_runs(make: type, runs: int) -> list[object]:
    """What `runs` workflow instances keep: each its own converter, each having read the values."""
    kept = []
    for _ in range(runs):
        converter = make()
        for value in VALUES:
            assert converter.from_payload(converter.to_payload(value), type(value)) == value
        kept.append(converter)
    return kept


def test_runs_share_one_set_of_type_adapters() -> None:
    before = adapters()
    kept = read_as_runs(data_converter.payload_converter_class, 50)
    assert adapters() - before <= len(VALUES)
    assert len(kept) == 50


def test_the_sdks_own_converter_keeps_a_set_a_run() -> None:
    # Why the converter exists: if this one day fails, the SDK shares its cache and ours can go.
    before = adapters()
    kept = read_as_runs(PydanticPayloadConverter, 20)
    assert adapters() - before >= 20 * len(VALUES)
    assert len(kept) == 20
