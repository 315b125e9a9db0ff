"""Shared reads (activities/shared_reads.py) on their own: what the Slurm and Kubernetes reads
rely on when a storm's runs ask at once (tests/test_slurm_activities.py uses them on a real
slurmctld)."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from activities.shared_reads import SharedReads


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
