"""The worker's full garbage-collector passes fall between workflow activations (workers/full_passes.py).

The activations here are plain functions on the gate's executor, as the SDK submits them; the passes
are seen through CPython's own gc.callbacks, not through the gate's bookkeeping."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from workers.full_passes import NEVER, ActivationGate


@contextmanager
def full_passes_seen() -> Iterator[list[tuple[float, float]]]:
    """(start, end) of every full pass in this process meanwhile, on perf_counter's clock."""
    seen: list[tuple[float, float]] = []
    began = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            seen.append((began[0], time.perf_counter()))
    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)


def busy_activation(spans: list[tuple[float, float]]) -> None:
    """~5 ms of interpreter work that allocates as a workflow's step does."""
    began = time.perf_counter()
    kept = []
    while time.perf_counter() - began < 0.005:
        kept.append({"step": [len(kept)]})
    spans.append((began, time.perf_counter()))


def test_no_full_pass_falls_inside_an_activation() -> None:
    # A pass always due, looked for every 100 ms, while two pollers submit activations back to back
    # with 5 ms between: the passes must all land in the gaps.
    gate = ActivationGate(look_every=0.1, gap_wait=10)
    gate.due = lambda: True  # type: ignore[method-assign]
    executor = gate.executor(4, "test-workflow")
    spans: list[tuple[float, float]] = []
    stop = threading.Event()

    def poller() -> None:
        while not stop.is_set():
            executor.submit(busy_activation, spans).result()
            time.sleep(0.005)

    with full_passes_seen() as passes:
        gate.start()
        try:
            pollers = [threading.Thread(target=poller) for _ in range(2)]
            for thread in pollers:
                thread.start()
            time.sleep(3)
            stop.set()
            for thread in pollers:
                thread.join()
        finally:
            gate.stop()
            executor.shutdown()
    assert len(spans) > 20, "the activations did not run"
    assert len(passes) >= 3, f"only {len(passes)} full passes in 3 s"
    inside = [(p, s) for p in passes for s in spans if p[0] < s[1] and s[0] < p[1]]
    assert not inside, f"{len(inside)} full passes fell inside an activation: {inside[:3]}"
    assert gate.counts.forced == 0 and gate.counts.in_gap >= len(passes) - 1


def test_a_pass_with_no_gap_runs_anyway_after_its_wait_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    # An activation that never yields (a real deadlock, which the SDK reports and cannot stop) must
    # not keep memory from being collected for ever.
    gate = ActivationGate(look_every=3600, gap_wait=0.3)
    executor = gate.executor(2, "test-workflow")
    release = threading.Event()
    stuck = executor.submit(release.wait)
    try:
        with full_passes_seen() as passes, caplog.at_level(logging.WARNING, "workers.full_passes"):
            began = time.perf_counter()
            gate.collect_in_gap()
            waited = time.perf_counter() - began
        assert len(passes) == 1 and gate.counts.forced == 1 and gate.counts.in_gap == 0
        assert waited >= 0.3
        assert "with workflow tasks in flight" in caplog.text
        # The gate is open again: the next activation is not held.
        assert executor.submit(lambda: "ran").result(timeout=5) == "ran"
    finally:
        release.set()
        stuck.result(timeout=5)
        executor.shutdown()


def test_an_activation_submitted_during_a_pass_starts_after_it() -> None:
    gate = ActivationGate()
    executor = gate.executor(2, "test-workflow")
    started: list[float] = []
    with full_passes_seen() as passes:
        # A finalizer run by the pass submits an activation from the collector's own thread (it
        # must not wait for itself); one from another thread, submitted meanwhile, waits.
        submitted = threading.Event()
        others: list[threading.Thread] = []

        class Submits:
            def __del__(self) -> None:
                other = threading.Thread(target=lambda: (submitted.set(),
                                                         executor.submit(lambda: started.append(time.perf_counter()))))
                others.append(other)
                other.start()
                time.sleep(0.2)  # the pass goes on meanwhile: the other thread's activation waits
                executor.submit(lambda: started.append(-1.0)).result(timeout=5)

        gc.disable()  # the cycle is collected by the gate's pass, not by a young one before it
        try:
            cycle = Submits()
            cycle.self = cycle  # type: ignore[attr-defined]
            del cycle
            gate.collect_in_gap()
        finally:
            gc.enable()
        for other in others:
            other.join(timeout=5)
        executor.shutdown(wait=True)
    assert submitted.is_set() and len(passes) == 1
    assert -1.0 in started, "the collector's own submission waited for itself"
    after = [at for at in started if at >= 0]
    assert after and after[0] >= passes[0][1], "an activation started inside the pass"


def test_the_interpreter_makes_no_full_pass_of_its_own_while_the_gate_holds() -> None:
    def promote_many() -> int:
        kept = [[i] for i in range(600_000)]  # survivors: promoted to the oldest generation
        with full_passes_seen() as passes:
            kept += [[i] for i in range(600_000)]
        return len(passes)

    gc.collect()
    assert promote_many() >= 1, "the interpreter made no full pass on its own here: this test cannot fail"
    gate = ActivationGate(look_every=3600)
    before = gc.get_threshold()
    gate.start()
    try:
        assert gc.get_threshold()[2] == NEVER
        assert promote_many() == 0
    finally:
        gate.stop()
    assert gc.get_threshold() == before


def test_a_pass_comes_due_where_the_interpreter_would_have_made_one() -> None:
    # The gate keeps CPython's account (survivors promoted since the last full pass against those
    # that survived it), which Python does not expose: long-lived objects a quarter more than the
    # last pass left make a pass due, and its thread makes it.
    gate = ActivationGate(look_every=0.05)
    gate.start()
    try:
        with full_passes_seen() as passes:
            gc.collect()
            assert not gate.due()
            kept = [[i] for i in range(int(len(gc.get_objects(generation=2)) * 0.3) + 100_000)]
            deadline = time.monotonic() + 10
            while len(passes) < 2 and time.monotonic() < deadline:  # the first: gc.collect() above
                time.sleep(0.05)
        assert len(passes) >= 2, "the gate made no pass with its long-lived objects grown by 30 %"
        assert gate.counts.in_gap >= 1 and not gate.due()
        del kept
    finally:
        gate.stop()
