"""Reads that callers asking at the same time share, without any of them reading stale data.

When 50 nodes fail together, 50 protective steps each ask slurmctld for their node and for the
job list (100 requests that slurmctld serves one at a time, ~10 ms each on a quiet controller and
seconds on a busy one), and the Kubernetes API for the opted-out pods. Here each caller's key joins the
next read; one read runs at a time and answers every caller that joined it. A caller's answer
always comes from a read that *started after it asked*, so it is as fresh as the caller's own
read would have been (a write it saw finish is in it); a quiet caller waits for nobody (its read
starts at once); and a storm costs about two reads per burst instead of one per caller.

Bounded: a read answers at most `max_keys` keys (the rest join the next one), and each caller waits
for at most the read in flight and its own, both under the reader's own timeout.

Idempotent writes share the same way (Slurm's node updates: `SlurmCli.update_nodes`): the "read"
does every write of its batch and answers each caller with its own error, if any.

`AsyncSharedReads` is the same for coroutines on the worker's event loop (Temporal's visibility,
which the worker's client reads without a thread).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class _Batch(Generic[K, V]):
    def __init__(self) -> None:
        self.keys: set[K] = set()
        self.callers = 0
        self.done = False
        self.answers: Mapping[K, V] = {}
        self.error: BaseException | None = None


class SharedReads(Generic[K, V]):
    """`read(keys) -> {key: value}` shared by concurrent callers of `get(key)`; a key the read does
    not answer gets None (it does not exist)."""

    def __init__(self, read: Callable[[Collection[K]], Mapping[K, V]], *, max_keys: int = 500) -> None:
        self.read = read
        self.max_keys = max_keys
        self.cond = threading.Condition()
        self.in_flight = False
        self.waiting: deque[_Batch[K, V]] = deque()  # batches not read yet, in the order they formed

    def get(self, key: K) -> V | None:
        with self.cond:
            batch = self._join(key)
            while not batch.done:
                if not self.in_flight and self.waiting[0] is batch:
                    self.waiting.popleft()
                    self.in_flight = True  # this caller reads for everyone in its batch
                    break
                self.cond.wait()
            else:
                return self._answer(batch, key)
        try:
            batch.answers = self.read(frozenset(batch.keys))
        except BaseException as exc:  # every caller of the batch gets the read's own error (and retries it)
            batch.error = exc
        finally:
            with self.cond:
                batch.done, self.in_flight = True, False
                self.cond.notify_all()
        return self._answer(batch, key)

    def _join(self, key: K) -> _Batch[K, V]:
        last = self.waiting[-1] if self.waiting else None
        if last is None or (len(last.keys) >= self.max_keys and key not in last.keys):
            last = _Batch()
            self.waiting.append(last)
        last.keys.add(key)
        last.callers += 1
        return last

    def queued(self) -> int:
        """Callers waiting for a read that has not started yet."""
        with self.cond:
            return sum(batch.callers for batch in self.waiting)

    @staticmethod
    def _answer(batch: _Batch[K, V], key: K) -> V | None:
        if batch.error is not None:
            raise batch.error
        return batch.answers.get(key)


class _AsyncBatch(Generic[K, V]):
    def __init__(self) -> None:
        self.keys: set[K] = set()
        self.answers: asyncio.Future[Mapping[K, V]] = asyncio.get_running_loop().create_future()
        # Every caller may have gone (its activity timed out): the read's error is then nobody's.
        self.answers.add_done_callback(lambda done: done.cancelled() or done.exception())


class AsyncSharedReads(Generic[K, V]):
    """`SharedReads` for coroutines: `await get(key)` joins the next read of `read(keys)`. A caller
    that stops waiting (cancelled) leaves the read to the others; one read runs at a time."""

    def __init__(self, read: Callable[[frozenset[K]], Awaitable[Mapping[K, V]]], *, max_keys: int = 500) -> None:
        self.read = read
        self.max_keys = max_keys
        self.waiting: deque[_AsyncBatch[K, V]] = deque()
        self.reading: asyncio.Task[None] | None = None
        self.reads = 0  # reads started (the tests count them)

    async def get(self, key: K) -> V | None:
        last = self.waiting[-1] if self.waiting else None
        if last is None or (len(last.keys) >= self.max_keys and key not in last.keys):
            last = _AsyncBatch()
            self.waiting.append(last)
        last.keys.add(key)
        self._next()
        return (await asyncio.shield(last.answers)).get(key)

    def _next(self) -> None:
        if self.reading is None and self.waiting:
            self.reading = asyncio.get_running_loop().create_task(self._read(self.waiting.popleft()))

    async def _read(self, batch: _AsyncBatch[K, V]) -> None:
        self.reads += 1
        try:
            batch.answers.set_result(await self.read(frozenset(batch.keys)))
        except asyncio.CancelledError:  # the worker is stopping: its callers are cancelled too
            batch.answers.cancel()
            raise
        except Exception as exc:  # every caller of the batch gets the read's own error (and retries it)
            batch.answers.set_exception(exc)
        finally:
            self.reading = None
            self._next()
