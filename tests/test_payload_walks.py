"""The SDK's payload walks are skipped only where they would change nothing (workers/payload_walks.py):
a worker with FleetMedic's converter runs its workflow tasks without them, and a site's payload
codec still sees every payload of every workflow task, both ways."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import types
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
import temporalio.bridge.worker
from temporalio import activity, workflow
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.bridge._visitor import PayloadVisitor
from temporalio.client import Client
from temporalio.converter import PayloadCodec
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from fleetmedic.converter import data_converter
from workers.payload_walks import WALKS, skip_walks_that_change_nothing


@activity.defn(name="test.shout")
async def shout(text: str) -> str:
    return text.upper()


@workflow.defn(name="test-payload-walks")
class Walked:
    """A payload each way of every kind a runbook has: its input, an activity's and a local
    activity's input and result, a signal, its result."""

    def __init__(self) -> None:
        self.said: str | None = None

    @workflow.signal
    def say(self, text: str) -> None:
        self.said = text

    @workflow.run
    async def run(self, text: str) -> str:
        loud = await workflow.execute_activity(shout, text, start_to_close_timeout=timedelta(seconds=10))
        louder = await workflow.execute_local_activity(shout, f"{loud}, again",
                                                       start_to_close_timeout=timedelta(seconds=10))
        await workflow.wait_condition(lambda: self.said is not None)
        return f"{louder} / {self.said}"


async def run_walked(client: Client) -> tuple[str, str]:
    """The run's result, and its workflow ID."""
    queue = f"walks-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[Walked], activities=[shout],
                      workflow_runner=UnsandboxedWorkflowRunner()):
        handle = await client.start_workflow(Walked.run, "gpu-1 is hot", id=queue, task_queue=queue)
        await handle.signal(Walked.say, "drained")
        # A task whose payloads were not decoded fails, and is retried until this gives up.
        result: str = await asyncio.wait_for(handle.result(), timeout=30)
        return result, queue


async def test_a_worker_without_a_codec_runs_its_workflow_tasks_without_walking_them(
        temporal_env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    walked: list[str] = []
    visit = PayloadVisitor.visit

    async def counted(self: PayloadVisitor, fs: Any, root: Any) -> None:
        walked.append(type(root).__name__)
        await visit(self, fs, root)

    monkeypatch.setattr(PayloadVisitor, "visit", counted)
    assert skip_walks_that_change_nothing()
    assert temporal_env.client.data_converter.payload_codec is None  # FleetMedic's converter
    assert (await run_walked(temporal_env.client))[0] == "GPU-1 IS HOT, AGAIN / drained"
    assert walked == []


class Marking(PayloadCodec):
    """A site's codec (encryption, compression), as the SDK's docs shape one: each payload wrapped
    whole in another of its own encoding."""

    ENCODING = b"binary/fleetmedic-test"

    def __init__(self) -> None:
        self.encoded = self.decoded = 0

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        self.encoded += len(payloads)
        return [Payload(metadata={"encoding": self.ENCODING}, data=p.SerializeToString()) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        self.decoded += len(payloads)
        decoded = []
        for payload in payloads:
            assert payload.metadata["encoding"] == self.ENCODING, payload.metadata
            decoded.append(Payload.FromString(payload.data))
        return decoded


async def test_a_sites_codec_still_sees_every_payload_of_every_workflow_task(
        temporal_env: WorkflowEnvironment) -> None:
    assert skip_walks_that_change_nothing()
    codec = Marking()
    client = await Client.connect(temporal_env.client.service_client.config.target_host,
                                  namespace=temporal_env.client.namespace,
                                  data_converter=dataclasses.replace(data_converter, payload_codec=codec))
    result, workflow_id = await run_walked(client)
    assert result == "GPU-1 IS HOT, AGAIN / drained"
    assert codec.encoded and codec.decoded
    # What the server keeps, read without the codec: the payloads the workflow's completions wrote
    # (the activity's input, the run's result) went through the codec as the client's did.
    history = await temporal_env.client.get_workflow_handle(workflow_id).fetch_history()
    written: dict[str, list[bytes]] = {}
    for event in history.events:
        kind = EventType.Name(event.event_type)
        payloads = {
            "EVENT_TYPE_WORKFLOW_EXECUTION_STARTED": event.workflow_execution_started_event_attributes.input,
            "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED": event.activity_task_scheduled_event_attributes.input,
            "EVENT_TYPE_ACTIVITY_TASK_COMPLETED": event.activity_task_completed_event_attributes.result,
            "EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED": event.workflow_execution_signaled_event_attributes.input,
            "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED": event.workflow_execution_completed_event_attributes.result,
        }.get(kind)
        if payloads is not None:
            written.setdefault(kind, []).extend(p.metadata["encoding"] for p in payloads.payloads)
    assert len(written) == 5, written
    assert all(encodings == [Marking.ENCODING] for encodings in written.values()), written


def test_an_sdk_whose_walks_changed_keeps_them(caplog: pytest.LogCaptureFixture) -> None:
    async def decode_activation(activation: Any, data_converter: Any, decode_headers: bool) -> None:
        pass

    async def encode_completion(completion: Any, data_converter: Any, encode_headers: bool,
                                storage_concurrency_limit: int) -> None:
        pass

    sdk = types.ModuleType("an_sdk_to_come")
    sdk.decode_activation, sdk.encode_completion = decode_activation, encode_completion  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="workers.payload_walks"):
        assert not skip_walks_that_change_nothing(sdk)
    assert (sdk.decode_activation, sdk.encode_completion) == (decode_activation, encode_completion)  # type: ignore[attr-defined]
    assert "payload walks are not the ones FleetMedic knows (decode_activation)" in caplog.text


def test_skipping_is_put_in_place_once() -> None:
    assert skip_walks_that_change_nothing()
    first = [getattr(temporalio.bridge.worker, name) for name in WALKS]
    assert skip_walks_that_change_nothing()
    assert [getattr(temporalio.bridge.worker, name) for name in WALKS] == first
