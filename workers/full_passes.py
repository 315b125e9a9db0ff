"""The worker's full garbage-collector passes run between workflow activations, never inside one.

CPython's full (oldest-generation) pass walks every object the process tracks and stops the whole
worker meanwhile. With thousands of runs kept in memory that is seconds: the SDK gives a workflow
activation 2 s before it fails the task as a potential deadlock (TMPRL1101), and an activation that
met a pass of that length was failed, given out again by the server and replayed
(bench/worker_scale.py on the production server, 5,000 runs in flight: 4 such tasks in 25
minutes, stacks ending in pydantic's encoding, a queue's get, a WeakSet callback: wherever the
pass stopped it).

So the worker makes the full passes itself, where none can fall inside an activation:
- automatic full passes are off (the oldest generation's threshold out of reach); the young ones,
  whose length follows what was allocated lately and not the heap, run as before;
- every activation goes through an `ActivationGate`'s executor, which counts those in flight;
- a thread looks every second whether a pass is due and, when one is, waits for a moment with none
  in flight, closes the gate (an activation submitted meanwhile waits to be submitted, before the
  SDK starts its 2 s), collects, and opens it again.

A pass is due when CPython's own rule (gcmodule.c, 3.11) would have made one: the objects that
survived young passes into the oldest generation since the last full pass are more than a quarter
of those that survived it, after more than 10 young passes. The gate keeps that account itself,
from the collector's callbacks. A worker that never has a gap (some activation in flight for 30 s
on end) collects anyway, as the interpreter would have: memory stays bounded, and that pass is
counted as forced.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# CPython collects the oldest generation when what young passes promoted into it since the last full
# pass exceeds a quarter of what survived that pass (long_lived_pending / long_lived_total), and more
# than its threshold (10) of young passes ran since.
SHARE = 0.25
YOUNG_PASSES = 10
# How often the thread looks whether a pass is due.
LOOK_EVERY = 1.0
# How long a due pass waits for a moment with no activation in flight before it runs anyway.
GAP_WAIT = 30.0
# The oldest generation's threshold while the gate holds: out of reach, so CPython never starts a
# full pass on its own (the count is of young-generation passes since the last full one).
NEVER = 2**31 - 1


@dataclass
class PassCounts:
    """What the gate did, for the log, the metrics and the tests."""
    in_gap: int = 0
    forced: int = 0  # no gap within GAP_WAIT: collected with activations in flight


class ActivationGate:
    """Counts the workflow activations in flight across a worker's executors and runs the full
    passes when none is."""

    def __init__(self, *, look_every: float = LOOK_EVERY, gap_wait: float = GAP_WAIT,
                 on_pass: Callable[[float, bool], None] = lambda seconds, forced: None) -> None:
        self.look_every, self.gap_wait = look_every, gap_wait
        self.on_pass = on_pass
        self.counts = PassCounts()
        self._lock = threading.Condition()
        self._in_flight = 0
        self.activations = 0  # every one submitted since the gate was made
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._collector: int | None = None  # the thread id that runs the passes
        self._thresholds: tuple[int, int, int] | None = None
        self._executors: list[ThreadPoolExecutor] = []
        # CPython's own account of the oldest generation, kept from its callbacks (see `_account`).
        self._long_lived_total = 0
        self._long_lived_pending = 0
        self._young = 0

    def executor(self, max_workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
        """A workflow task executor (the SDK's `workflow_task_executor`) whose activations count.
        The SDK does not shut down an executor it was given: `close` does."""
        made = _GatedExecutor(self, max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._executors.append(made)
        return made

    def close(self) -> None:
        """Once the workers have stopped: no more passes, and the executors' threads end."""
        self.stop()
        for made in self._executors:
            made.shutdown(wait=False)

    # The executors' side.

    def enter(self) -> None:
        with self._lock:
            # A finalizer that runs inside the pass, on the collector's thread, must not wait for it.
            while self._closed and threading.get_ident() != self._collector:
                self._lock.wait()
            self._in_flight += 1
            self.activations += 1

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._lock.notify_all()

    # The collector's side.

    def start(self) -> None:
        """Take the full passes over from the interpreter. Call once the process has started (after
        workers/heap.py's freeze) and before the workers poll."""
        young0, young1, oldest = gc.get_threshold()
        self._thresholds = (young0, young1, oldest)
        # As the interpreter counts them after the pass before workers/heap.py's freeze: the frozen too.
        self._long_lived_total = len(gc.get_objects(generation=2)) + gc.get_freeze_count()
        self._long_lived_pending = 0
        gc.callbacks.append(self._account)
        gc.set_threshold(young0, young1, NEVER)
        self._thread = threading.Thread(target=self._run, name="fleetmedic-full-passes", daemon=True)
        self._thread.start()
        log.info("full garbage-collector passes run between workflow activations (%d objects long-lived now)",
                 self._long_lived_total)

    def stop(self) -> None:
        """Give the full passes back to the interpreter."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()  # a pass waiting for a gap gives up
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            gc.callbacks.remove(self._account)
            self._thresholds = None

    def due(self) -> bool:
        return (gc.get_count()[2] > YOUNG_PASSES
                and self._long_lived_pending > self._long_lived_total * SHARE)

    def _account(self, phase: str, info: dict[str, Any]) -> None:
        """CPython's account, which Python does not expose: a middle-generation pass promotes its
        survivors (the young generations' objects less those it collected) into the oldest; a full
        pass, whoever made it, leaves the oldest holding every survivor and nothing pending."""
        generation = info["generation"]
        if generation == 1 and phase == "start":
            self._young = len(gc.get_objects(generation=0)) + len(gc.get_objects(generation=1))
        elif generation == 1:
            self._long_lived_pending += max(self._young - info["collected"], 0)
        elif generation == 2 and phase == "stop":
            self._long_lived_total, self._long_lived_pending = len(gc.get_objects(generation=2)), 0

    def collect_in_gap(self) -> float:
        """One full pass at a moment with no activation in flight (or after `gap_wait` without one);
        its length in seconds."""
        with self._lock:
            gap = self._lock.wait_for(lambda: self._in_flight == 0 or self._stop.is_set(), timeout=self.gap_wait)
            if self._stop.is_set():
                return 0.0
            forced = not gap
            self._closed, self._collector = True, threading.get_ident()
        try:
            began = time.perf_counter()
            gc.collect()
            seconds = time.perf_counter() - began
        finally:
            with self._lock:
                self._closed, self._collector = False, None
                self._lock.notify_all()
        self._count(seconds, forced)
        return seconds

    def _count(self, seconds: float, forced: bool) -> None:
        counts = self.counts
        if forced:
            counts.forced += 1
            log.warning("full garbage-collector pass of %.2f s made with workflow tasks in flight: the worker "
                        "had none free of them for %d s", seconds, self.gap_wait)
        else:
            counts.in_gap += 1
        if seconds >= 1:
            log.info("full garbage-collector pass: %.2f s, the worker stopped meanwhile (%d objects survived it)",
                     seconds, self._long_lived_total)
        self.on_pass(seconds, forced)

    def _run(self) -> None:
        while not self._stop.wait(self.look_every):
            try:
                if self.due():
                    self.collect_in_gap()
            except Exception:  # a pass that failed is CPython's bug, not a reason to stop collecting
                log.exception("full garbage-collector pass failed")


class _GatedExecutor(ThreadPoolExecutor):
    def __init__(self, gate: ActivationGate, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._gate = gate

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        self._gate.enter()
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:  # never ran (the executor was shut down): not in flight
            self._gate.leave()
            raise
        # Done, failed or cancelled before it ran: no longer in flight either way.
        future.add_done_callback(lambda _: self._gate.leave())
        return future
