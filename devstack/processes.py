"""FleetMedic's own commands as child processes (`fleetmedic worker`, `fleetmedic webhook`), for
tests and benchmarks that need them apart from the caller: a crash to simulate, or CPU that the
measuring process must not share. Each is stopped by its own PID, never by name."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

try:  # loaded in the parent: a child started as another user may not be able to read Python's modules
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None


def _die_with_parent() -> None:
    # In the child, before exec: Linux's PR_SET_PDEATHSIG (= 1). Elsewhere nothing.
    if _LIBC is not None:
        with contextlib.suppress(AttributeError):
            _LIBC.prctl(1, signal.SIGTERM)


def die_with_parent() -> Callable[[], None] | None:
    """Popen's preexec_fn for a child that must end with what started it: SIGTERM to it when the
    starter dies (a test run or a benchmark killed by a timeout must not leave an apiserver, a
    slurmctld or a worker behind). Only from the main thread: the kernel's "parent" is the thread
    that started the child, and one started from another thread would be stopped when that thread
    ends (the crash-safety test's watcher starts a fresh worker, then returns)."""
    return _die_with_parent if threading.current_thread() is threading.main_thread() else None


class FleetMedicProcess:
    """`fleetmedic <args>` with `env`, its output appended to `log`. `python`: another install's
    interpreter (a previous release's virtualenv, for the upgrade test), started with `-P` in `cwd`
    so that nothing of this checkout is imported by accident; this one's by default."""

    def __init__(self, args: Sequence[str], env: dict[str, str], log: Path, python: str | None = None,
                 cwd: Path | None = None) -> None:
        self.args, self.env, self.log = list(args), env, log
        self.python, self.cwd = python or sys.executable, cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.kills = 0

    def start(self) -> None:
        with open(self.log, "ab") as out:
            # -P: the working directory is not put on the path (`-m` would put it first).
            isolated = ["-P"] if self.python != sys.executable else []
            self.proc = subprocess.Popen([self.python, *isolated, "-m", "workers.cli", *self.args], env=self.env,
                                         stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd,
                                         preexec_fn=die_with_parent())

    def kill(self) -> None:
        """SIGKILL, as a node losing power would."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.kills += 1

    def stop(self, grace_s: float = 40) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL after `grace_s`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
