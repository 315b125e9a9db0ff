"""Workflow code stays deterministic. The worker runs workflows without Temporal's sandbox (see
workers/worker.py), so what the sandbox would refuse at run time is refused here, from the source:
no clock, randomness, environment, file, network or subprocess call in a workflow module or in the
domain modules they call (`fleetmedic`, but its settings, which no workflow imports), and no
import of the activities or of client libraries. Time comes from `workflow.now()`, sleeps from
`workflow.sleep`, randomness from `workflow.random()`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
# What a workflow may run: its own modules and the domain modules, but the process settings.
WORKFLOWS = sorted([*(ROOT / "workflows").glob("*.py"),
                    *(p for p in (ROOT / "fleetmedic").glob("*.py") if p.name != "settings.py")])
# Calls whose answer differs between a run and its replay.
FORBIDDEN_CALLS = {
    "datetime.now", "datetime.utcnow", "datetime.today", "date.today", "time.time", "time.monotonic",
    "time.sleep", "time.perf_counter", "uuid.uuid4", "uuid.uuid1", "os.getenv", "os.urandom", "open",
    "asyncio.sleep", "random.random", "random.randint", "random.choice", "random.shuffle", "random.uniform",
}
FORBIDDEN_MODULES = {"random", "os", "subprocess", "socket", "threading", "requests", "httpx", "kubernetes", "uuid",
                     "activities", "workers", "devstack", "secrets"}


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def violations(source: str) -> list[str]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and dotted(node.func) in FORBIDDEN_CALLS:
            found.append((node.lineno, f"line {node.lineno}: {dotted(node.func)}()"))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [(node.lineno, f"line {node.lineno}: import {n}") for n in names
                      if n.split(".")[0] in FORBIDDEN_MODULES]
    return [text for _, text in sorted(found)]


@pytest.mark.parametrize("path", WORKFLOWS, ids=[f"{p.parent.name}.{p.stem}" for p in WORKFLOWS])
def test_no_nondeterministic_call_in_workflow_code(path: Path) -> None:
    assert violations(path.read_text()) == []


def test_the_check_catches_what_it_is_for() -> None:
    bad = "import random\nfrom datetime import datetime\nx = datetime.now()\nimport activities.slurm\n"
    assert violations(bad) == ["line 1: import random", "line 3: datetime.now()", "line 4: import activities.slurm"]


def test_no_workflow_imports_the_process_settings() -> None:
    # settings.py reads the environment, so it is left out of the check above on this condition.
    imports = [p.name for p in WORKFLOWS if "fleetmedic.settings" in p.read_text() or
               "from fleetmedic import settings" in p.read_text()]
    assert imports == []
