"""The event loop of FleetMedic's long-running processes (worker, webhook, node agent).

uvloop (libuv) by default: the worker's and the webhook's loops spend their time handing the
Temporal client's answers, HTTP requests and thread pool results back and forth, which asyncio's
own loop does in Python. `FLEETMEDIC_EVENT_LOOP=asyncio` runs them on asyncio's own loop instead.
A workflow's code never runs on this loop (the SDK runs each workflow on a deterministic loop of
its own), so the choice changes no run's history.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

import uvloop

T = TypeVar("T")
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"uvloop": uvloop.new_event_loop,
                                                             "asyncio": asyncio.new_event_loop}


def run(main: Coroutine[Any, Any, T], loop: Literal["uvloop", "asyncio"] = "uvloop") -> T:
    """`asyncio.run(main)` on the event loop named `loop` (one of LOOPS)."""
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        return runner.run(main)
