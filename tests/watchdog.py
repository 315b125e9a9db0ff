"""A bound on every test: one that hangs fails, saying where it waits, and the suite goes on.

CI stops a run at 90 minutes. Stop 37's run printed 107 results of 480 and then nothing until
that limit: one test (or a fixture between two) waited on something that never came, and the run
said nothing about where. Past `test_limit_s` (setup, call and teardown together) this prints the
stack of every thread and the await chain of every asyncio task, then ends the test:

- an async test is cancelled through its task, so its `async with` blocks unwind (its workers
  stop, its stand-ins close) and the next test starts clean;
- anything else (a blocking call, a fixture, a cancellation that itself hangs `GRACE_S` later)
  gets `Failed` raised where the main thread is.

The limit is far above any test's own bounds (the longest, the 40-node storm, waits up to 900 s
for its runs): it catches a hang, it is not a speed target.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import pytest

DEFAULT_LIMIT_S = 1200
GRACE_S = 120
HUNG = pytest.StashKey[list[str]]()
# Frames of Python itself and of installed packages: the await chain's last one of ours is named.
LIBRARIES = tuple({str(Path(p).resolve()) + "/" for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("test_limit_s", "seconds a test (setup, call, teardown) may take before it is ended as hung",
                  default=str(DEFAULT_LIMIT_S))


def pytest_configure(config: pytest.Config) -> None:
    config.stash[HUNG] = []


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Each hung test and where, whole, just above the short summary (which cuts its lines at the
    terminal's width): the end of the output is what CI shows."""
    for line in config.stash[HUNG]:
        terminalreporter.write_line(line)


def await_chain(task: asyncio.Task[Any]) -> list[str]:
    """`file:line function` of each coroutine the task is suspended in, outermost first: a task's
    own stack shows only its outermost frame."""
    frames: list[str] = []
    awaitable: Any = task.get_coro()
    while awaitable is not None:
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "ag_frame", None)
        if frame is not None:
            frames.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "ag_await", None)
    return frames


def ours(frames: list[str]) -> list[str]:
    return [f for f in frames if not f.startswith(LIBRARIES)]


def dump(out: TextIO, header: str, loop: asyncio.AbstractEventLoop | None) -> None:
    print(f"\n+++ {header}: every thread, then every asyncio task +++", file=out)
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        print(f"--- thread {names.get(ident, ident)}", file=out)
        traceback.print_stack(frame, file=out)
    for task in asyncio.all_tasks(loop) if loop is not None else ():
        print(f"--- task {task.get_name()}", *(f"    {f}" for f in await_chain(task)), sep="\n", file=out)
    out.flush()


def running_test_task(loop: asyncio.AbstractEventLoop | None, item: pytest.Item) -> asyncio.Task[Any] | None:
    """The task pytest-asyncio runs the test's coroutine in, if the test is running now."""
    name = getattr(getattr(item, "function", None), "__name__", None)
    for task in asyncio.all_tasks(loop) if loop is not None else ():
        if getattr(task.get_coro(), "__name__", None) == name and not task.done():
            return task
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    limit = float(item.config.getini("test_limit_s"))
    began, cancelled = time.monotonic(), False

    def expire(signum: int, frame: FrameType | None) -> None:
        nonlocal cancelled
        try:  # the handler runs in the main thread: inside the event loop when an async step waits
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        held = f"{item.nodeid} still running after {time.monotonic() - began:.0f} s (limit {limit:g} s)"
        dump(sys.stderr, held, loop)
        task = None if cancelled else running_test_task(loop, item)
        if task is not None:
            chain = await_chain(task)
            where = " > ".join(dict.fromkeys(ours(chain)[-3:] + chain[-1:]))  # ours, then what it awaits
            cancelled = True
            item.config.stash[HUNG].append(f"HUNG {held}, waiting at {where}")
            signal.setitimer(signal.ITIMER_REAL, GRACE_S)
            # Thread-safe: it wakes the loop, which the handler interrupted in a select it resumes.
            loop.call_soon_threadsafe(task.cancel, f"hung: {held}, waiting at {where}")  # type: ignore[union-attr]
            return
        at = traceback.extract_stack(frame)[-1] if frame is not None else None
        where = f"{at.filename}:{at.lineno} {at.name}" if at is not None else "an unknown place"
        item.config.stash[HUNG].append(f"HUNG {held}, at {where}")
        pytest.fail(f"hung: {held}, at {where}")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
