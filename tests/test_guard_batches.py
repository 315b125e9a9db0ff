"""A worker's lease requests and releases go to its guard in batches: what arrives while a signal is
on its way goes in the next one, a failure reaches each caller on one line, and a caller that gives
up does not take the others with it."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.breaker import MEMO_KEY, GuardView
from activities.errors import fail
from activities.guard import GuardActivities
from activities.guard_batches import Batch
from fleetmedic.errors import ErrorKind
from fleetmedic.models import LeaseRequest


class Guard:
    """A stand-in for the signal: records each list it is sent, and holds each until let go."""

    def __init__(self) -> None:
        self.sent: list[list[int]] = []
        self.go = asyncio.Event()
        self.refuse: str | None = None

    async def send(self, items: list[int]) -> None:
        self.sent.append(items)
        await self.go.wait()
        if self.refuse:
            raise fail(ErrorKind.UNAVAILABLE, self.refuse)


async def on_its_way(batch: Batch[int], guard: Guard, item: int) -> asyncio.Task[None]:
    """A caller that added `item`, once the signal carrying it is on its way."""
    caller = asyncio.create_task(batch.add(item, 10, "not taken"))
    while not guard.sent:
        await asyncio.sleep(0)
    return caller


async def test_what_arrives_while_a_signal_is_on_its_way_goes_in_the_next_one() -> None:
    guard = Guard()
    batch: Batch[int] = Batch(guard.send)
    first = await on_its_way(batch, guard, 1)
    later = [asyncio.create_task(batch.add(i, 10, "not taken")) for i in (2, 3, 4)]
    await asyncio.sleep(0)
    assert guard.sent == [[1]]  # alone, the first went at once: no timer
    guard.go.set()
    await asyncio.gather(first, *later)
    assert guard.sent == [[1], [2, 3, 4]]
    assert batch.signals == 2


async def test_a_batch_carries_at_most_its_bound() -> None:
    guard = Guard()
    guard.go.set()
    batch: Batch[int] = Batch(guard.send, most=2)
    await asyncio.gather(*(batch.add(i, 10, "not taken") for i in range(5)))
    assert guard.sent == [[0, 1], [2, 3], [4]]


async def test_a_refused_signal_fails_each_of_its_callers_on_one_line_and_the_next_batch_still_goes() -> None:
    guard = Guard()
    batch: Batch[int] = Batch(guard.send)
    guard.refuse = "the fleet guard of c1 did not take the requests (RESOURCE_EXHAUSTED: Workflow is busy.)"
    refused = [asyncio.create_task(batch.add(i, 10, "not taken")) for i in (1, 2)]
    await asyncio.sleep(0)
    guard.go.set()
    errors = await asyncio.gather(*refused, return_exceptions=True)
    for error in errors:
        assert isinstance(error, ApplicationError)
        assert error.message == guard.refuse and not error.non_retryable  # retried by the step's policy
    assert errors[0] is not errors[1]
    guard.refuse = None
    await batch.add(3, 10, "not taken")
    assert guard.sent[-1] == [3]


async def test_a_caller_that_gives_up_fails_alone_and_its_item_still_goes() -> None:
    guard = Guard()
    batch: Batch[int] = Batch(guard.send)
    patient = await on_its_way(batch, guard, 1)
    with pytest.raises(ApplicationError, match=r"the fleet guard of c1 did not take the request \(no answer "
                                               r"within 0 s\)$"):
        await batch.add(2, 0.05, "the fleet guard of c1 did not take the request")
    guard.go.set()
    await patient  # the signal the other waited for was not cancelled
    assert guard.sent == [[1], [2]]  # the item of the caller that gave up went all the same (idempotent)


class Views:
    """The worker's view of a guard, as read from a memo (activities/breaker.py GuardViews)."""

    def __init__(self, memo: dict[str, object]) -> None:
        self.view = GuardView.from_memo(memo)

    def start(self) -> None:
        pass

    def get(self, cluster: str) -> GuardView:
        return self.view

    def forget(self, cluster: str) -> None:
        self.view = GuardView()


class Client:
    """Where a batch goes: a plain signal to the guard's open run (recorded), or none open."""

    def __init__(self, signals: list[tuple[str, object]], open_run: bool = True) -> None:
        self.signals, self.open_run = signals, open_run

    def get_workflow_handle(self, workflow_id: str) -> Client:
        return self

    async def signal(self, signal: str, arg: object, rpc_timeout: object = None) -> None:
        if not self.open_run:
            raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
        self.signals.append((signal, arg))


def guard_for(memo: dict[str, object], signals: list[tuple[str, object]], monkeypatch: pytest.MonkeyPatch,
              open_run: bool = True) -> GuardActivities:
    async def signal_guard(self: GuardActivities, cluster: str, signal: str, arg: object, **options: object) -> None:
        signals.append((signal, arg))  # signal-with-start: what a lone request or release is

    monkeypatch.setattr(GuardActivities, "signal_guard", signal_guard)
    return GuardActivities(Client(signals, open_run), "fleetmedic-guard", Views(memo))  # type: ignore[arg-type]


BATCHES = {MEMO_KEY: {"paused": None, "signals": ["requests", "releases"]}}


@pytest.mark.parametrize(("memo", "sent"), [
    ({}, ["request", "release"]),  # a guard 0.1.0 started: no memo at all
    ({MEMO_KEY: {"paused": None, "breaker": None}}, ["request", "release"]),  # one that does not say
    (BATCHES, ["requests", "releases"]),
])
async def test_batches_go_only_to_a_guard_that_says_it_takes_them(memo: dict[str, object], sent: list[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The rollout rule (docs/upgrading.md): a guard run that older code may still run has no handler
    for a batch, and would never answer the runbooks in it."""
    signals: list[tuple[str, object]] = []
    guard = guard_for(memo, signals, monkeypatch)
    request = LeaseRequest(workflow_id="xid-recovery/c1/gpu-1", node="gpu-1")
    await guard.request_lease("c1", request)
    await guard.release_lease("c1", request.workflow_id)
    assert [name for name, _ in signals] == sent
    batched = sent[0] == "requests"
    assert signals[0][1] == ([request] if batched else request)
    assert signals[1][1] == ([request.workflow_id] if batched else request.workflow_id)


async def test_a_batch_never_starts_a_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """No open run (an operator terminated the guard): the attempt fails on one line, and the next
    asks alone, with the signal that starts a guard, which every release takes."""
    signals: list[tuple[str, object]] = []
    guard = guard_for(BATCHES, signals, monkeypatch, open_run=False)
    request = LeaseRequest(workflow_id="xid-recovery/c1/gpu-1", node="gpu-1")
    with pytest.raises(ApplicationError, match="the fleet guard of c1 is not running: asked again alone") as failed:
        await guard.request_lease("c1", request)
    assert not failed.value.non_retryable and signals == []
    await guard.request_lease("c1", request)  # the step's retry
    assert signals == [("request", request)]
