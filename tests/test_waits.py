"""The waits' blocking calls share a few threads (activities/waits.py BlockingCalls): an activity
whose call waits there, queued or running, stays alive, with the details it last gave."""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

from activities.waits import BlockingCalls, heartbeat

RELEASE = threading.Event()
CALLS = BlockingCalls(threads=1, name="test-waits")
HEARTBEAT_TIMEOUT = timedelta(seconds=3)


@activity.defn(name="test.wait_on_shared_threads")
async def wait_on_shared_threads() -> str:
    heartbeat({"evicted": 2, "waiting": 1})
    return await CALLS(lambda: "done" if RELEASE.wait(60) else "never released")


@workflow.defn(name="test-wait-on-shared-threads", sandboxed=False)
class WaitOnSharedThreads:
    @workflow.run
    async def run(self) -> str:
        return await workflow.execute_activity(  # type: ignore[no-any-return]
            "test.wait_on_shared_threads", start_to_close_timeout=timedelta(seconds=90),
            heartbeat_timeout=HEARTBEAT_TIMEOUT, retry_policy=RetryPolicy(maximum_attempts=1), result_type=str)


async def test_a_call_held_on_the_shared_threads_keeps_its_activity_alive_with_its_details(
        client: Client, task_queue: str) -> None:
    RELEASE.clear()
    async with Worker(client, task_queue=task_queue, workflows=[WaitOnSharedThreads],
                      activities=[wait_on_shared_threads]):
        handle = await client.start_workflow("test-wait-on-shared-threads", id=f"waits-{uuid.uuid4().hex[:8]}",
                                             task_queue=task_queue)
        # Held past two heartbeat timeouts: without a heartbeat meanwhile, the server times it out.
        await asyncio.sleep(2.5 * HEARTBEAT_TIMEOUT.total_seconds())
        pending = (await handle.describe()).raw_description.pending_activities
        assert [p.attempt for p in pending] == [1]
        assert await client.data_converter.decode(pending[0].heartbeat_details.payloads) == [
            {"evicted": 2, "waiting": 1}]
        RELEASE.set()
        assert await handle.result() == "done"
    timed_out = [e async for e in handle.fetch_history_events()
                 if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT]
    assert timed_out == []
