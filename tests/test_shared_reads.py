"""Shared reads (activities/shared_reads.py) on their own: what the Slurm and Kubernetes reads
rely on when a storm's runs ask at once (tests/test_slurm_activities.py uses them on a real
slurmctld)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from activities.shared_reads import AsyncSharedReads, SharedReads


class Source:
    """A read that blocks until the test lets it go, and records what each read asked for."""

    def __init__(self, fail_first: bool = False) -> None:
        self.asked: list[set[str]] = []
        self.started = threading.Event()
        self.go = threading.Event()
        self.fail_first = fail_first

    def read(self, keys: Collection[str]) -> Mapping[str, str]:
        self.asked.append(set(keys))
        self.started.set()
        assert self.go.wait(10)
        if self.fail_first and len(self.asked) == 1:
            raise RuntimeError("slurmctld unreachable")
        return {k: f"value of {k}" for k in keys if k != "missing"}


def queue_behind_first(shared: SharedReads[str, str], source: Source, keys: list[str],
                       pool: ThreadPoolExecutor) -> tuple[Future[Any], list[Future[Any]]]:
    first = pool.submit(shared.get, "first")
    assert source.started.wait(10)
    later = [pool.submit(shared.get, key) for key in keys]
    deadline = time.monotonic() + 10
    while shared.queued() < len(keys) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert shared.queued() == len(keys)
    source.go.set()
    return first, later


def test_a_failed_read_fails_its_own_callers_and_the_next_one_reads_again() -> None:
    source = Source(fail_first=True)
    shared: SharedReads[str, str] = SharedReads(source.read)
    with ThreadPoolExecutor(8) as pool:
        first, later = queue_behind_first(shared, source, ["a", "b", "missing", "a"], pool)
        with pytest.raises(RuntimeError, match="unreachable"):
            first.result()
        assert [f.result() for f in later] == ["value of a", "value of b", None, "value of a"]
    assert source.asked == [{"first"}, {"a", "b", "missing"}]


def test_a_read_answers_at_most_max_keys_and_the_rest_wait_for_the_next() -> None:
    source = Source()
    shared: SharedReads[str, str] = SharedReads(source.read, max_keys=2)
    with ThreadPoolExecutor(8) as pool:
        _, later = queue_behind_first(shared, source, ["a", "b", "a", "c", "d"], pool)
        assert [f.result() for f in later] == ["value of a", "value of b", "value of a", "value of c", "value of d"]
    assert source.asked == [{"first"}, {"a", "b"}, {"c", "d"}]


def test_a_caller_alone_reads_at_once() -> None:
    source = Source()
    source.go.set()
    shared: SharedReads[str, str] = SharedReads(source.read)
    assert [shared.get("a"), shared.get("a")] == ["value of a", "value of a"]
    assert source.asked == [{"a"}, {"a"}]  # nothing kept: each caller's answer is read after it asked


async def test_coroutines_share_reads_that_started_after_they_asked_and_one_leaving_stops_no_one() -> None:
    """The event loop's flavour (the lemon counts): callers that ask while a read runs share the
    next one, never the one in flight; a read's error reaches its callers only, and the next read
    runs; a caller cancelled while waiting (its activity timed out) leaves the others their answer."""
    batches: list[frozenset[str]] = []
    gate = asyncio.Event()

    async def read(keys: frozenset[str]) -> Mapping[str, int]:
        batches.append(keys)
        if len(batches) == 1:
            await gate.wait()
        if "bad" in keys:
            raise RuntimeError("visibility at frontend:7233: unavailable")
        return {k: len(k) for k in keys if k != "missing"}

    shared: AsyncSharedReads[str, int] = AsyncSharedReads(read)
    first = asyncio.ensure_future(shared.get("a"))
    await asyncio.sleep(0)
    later = [asyncio.ensure_future(shared.get(k)) for k in ("bb", "ccc", "missing", "bb")]
    leaving = asyncio.ensure_future(shared.get("dddd"))
    await asyncio.sleep(0)
    leaving.cancel()
    gate.set()
    assert await first == 1
    assert await asyncio.gather(*later) == [2, 3, None, 2]
    assert batches == [frozenset({"a"}), frozenset({"bb", "ccc", "missing", "dddd"})]
    bad, after = await asyncio.gather(shared.get("bad"), shared.get("e"), return_exceptions=True)
    assert isinstance(bad, RuntimeError) and after == 1  # "bad" read alone at once; "e" joined the next
    assert batches[2:] == [frozenset({"bad"}), frozenset({"e"})] and shared.reads == 4
