"""The data converter: pydantic contracts as JSON, and one set of TypeAdapters for the process
however many runs the worker keeps (the SDK makes a payload converter per workflow instance)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter
from temporalio.contrib.pydantic import PydanticPayloadConverter

from fleetmedic import activity_refs as refs
from fleetmedic.converter import data_converter
from fleetmedic.models import NodeInfo, NodeRunbookInput, RunContext
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


def read_as_a_run(value: object, result_type: Any) -> object:
    """`value` as a run reads it back, with a converter of its own, as the SDK gives each run."""
    return data_converter.payload_converter_class().from_payload(
        data_converter.payload_converter.to_payload(value), result_type)


def test_runs_share_the_configuration_they_read_at_their_start() -> None:
    """Every run's first task reads the worker's configuration as a local activity's result, the
    policy in it 6 KB of JSON: read once per distinct payload, not validated again by every run
    (a profile of 50 alerts at once found config.run's result validated a run)."""
    context = RunContext(slurm_enabled=True, agent_configured=False, provider="manual")
    configurations: tuple[tuple[refs.Activity[Any, Any], Callable[[Policy], object]], ...] = (
        (refs.CONFIG_RUN, lambda policy: refs.RunConfig(policy=policy, context=context)),
        (refs.CONFIG_POLICY, lambda policy: policy))
    for ref, configuration in configurations:
        value = configuration(Policy())
        first, again = read_as_a_run(value, ref.result), read_as_a_run(value, ref.result)
        assert first == value and first is again, ref.name
        changed = read_as_a_run(configuration(Policy(lemon={"count": 7})), ref.result)
        assert changed is not first and changed != first, ref.name  # a changed policy is read anew
