"""Records every full (oldest-generation) garbage-collector pass of a benchmark's worker process.

CPython's full pass walks every object the process tracks and stops the whole worker meanwhile.
`recording(workdir)` writes a sitecustomize that only the `fleetmedic worker` process acts on and
returns the environment that loads it; `passes_in` reads back what it wrote. Used by
bench/gc_pauses.py (passes while alerts come one at a time) and bench/worker_scale.py (passes with
thousands of runs in flight).
"""

from __future__ import annotations

from pathlib import Path

# Loaded by the worker process only (PYTHONPATH): each full pass's end time and length, one line each.
HOOK = '''
import gc, os, sys, time
if "worker" in sys.argv:
    if os.environ.get("FLEETMEDIC_BENCH_UNFROZEN"):
        gc.freeze = lambda: None  # the floor: the same worker, nothing frozen
    if os.environ.get("FLEETMEDIC_BENCH_UNGATED"):
        # The floor: the same worker, its full passes the interpreter's own, wherever they fall.
        from workers.full_passes import ActivationGate
        ActivationGate.start = lambda self: None
    _log = open(os.path.join(os.environ["FLEETMEDIC_BENCH_GC_DIR"], "passes-%d" % os.getpid()), "a", buffering=1)
    _began = [0.0]
    def _timed(phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            _began[0] = time.perf_counter()
        else:
            _log.write("%.4f %.6f\\n" % (time.time(), time.perf_counter() - _began[0]))
    gc.callbacks.append(_timed)
'''


def recording(workdir: Path, unfrozen: bool = False, ungated: bool = False) -> tuple[dict[str, str], Path]:
    """The worker environment that records its full passes, and the folder they are written to.
    `unfrozen`: the same worker with gc.freeze made a no-op (nothing from start-up left out);
    `ungated`: with the interpreter making its own full passes (workers/full_passes.py not started)."""
    hook, passes = workdir / "gc-hook", workdir / "gc"
    hook.mkdir()
    passes.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {"PYTHONPATH": str(hook), "FLEETMEDIC_BENCH_GC_DIR": str(passes)}
    if unfrozen:
        env["FLEETMEDIC_BENCH_UNFROZEN"] = "1"
    if ungated:
        env["FLEETMEDIC_BENCH_UNGATED"] = "1"
    return env, passes


def passes_in(directory: Path, began: float, ended: float) -> list[tuple[float, float]]:
    """(start, seconds) of each full pass of the worker that began between `began` and `ended`
    (wall clock)."""
    found = []
    for path in directory.glob("passes-*"):
        for line in path.read_text().splitlines():
            end, length = (float(x) for x in line.split())
            if began <= end - length <= ended:
                found.append((end - length, length))
    return sorted(found)
