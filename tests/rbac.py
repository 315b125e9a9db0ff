"""Who asks the Kubernetes API for what: every request the adapters send to the apiserver during
the tests, as RBAC sees it — (verb, API group, resource[/subresource]). `tests/test_rbac.py`
compares what was seen with the worker's ClusterRole.

scripts/test runs the suite in one process per core (pytest-xdist) and the RBAC test after them,
in a process of its own: each process that ran tests leaves its recording in the directory
`FLEETMEDIC_RBAC_RECORD` names (`save`), and the RBAC test judges all of them together (`everything`)."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (verb, group, resource) seen across this test session.
OBSERVED: set[tuple[str, str, str]] = set()
# (group, version, resource) of every custom or built-in resource the worker called.
VERSIONS: set[tuple[str, str, str]] = set()


def access(request: Any) -> tuple[str, str, str] | None:
    """The RBAC triple of one HTTP request to the API server (None for discovery and the like)."""
    parts = [p for p in request.url.path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    if not rest:
        return None
    resource = rest[0] + (f"/{rest[2]}" if len(rest) >= 3 else "")
    named = len(rest) >= 2
    method = request.method.value.upper()
    watching = str(request.url.query.get("watch", "")).lower() in ("true", "1")
    verb = {"GET": "get" if named else ("watch" if watching else "list"), "POST": "create", "PATCH": "patch",
            "PUT": "update", "DELETE": "delete" if named else "deletecollection"}.get(method)
    return (verb, group, resource) if verb else None


def api_version(request: Any) -> tuple[str, str, str] | None:
    """(group, version, resource) of one request to a resource (None for discovery)."""
    parts = [p for p in request.url.path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, version, rest = "", parts[1], parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    return (group, version, rest[0]) if rest else None


def record(requests: list[Any]) -> None:
    for request in requests:
        triple = access(request)
        if triple is not None:
            OBSERVED.add(triple)
        called = api_version(request)
        if called is not None:
            VERSIONS.add(called)


@dataclass
class Recording:
    """What the test processes of one suite run sent, and which test modules that run collected."""

    observed: set[tuple[str, str, str]]
    versions: set[tuple[str, str, str]]
    modules: set[str]  # the test modules collected (every process collects the whole selection)
    failed: int  # tests failed, in every process


def modules(items: Iterable[Any]) -> set[str]:
    """The test modules of `items` (pytest's), by name."""
    return {item.module.__name__.rsplit(".", 1)[-1] for item in items if item.module}


def record_dir() -> Path | None:
    where = os.environ.get("FLEETMEDIC_RBAC_RECORD")
    return Path(where) if where else None


def save(modules: set[str], failed: int) -> None:
    """This process's recording, for the RBAC test that runs after it (`FLEETMEDIC_RBAC_RECORD`)."""
    where = record_dir()
    if where is None:
        return
    where.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"observed": sorted(OBSERVED), "versions": sorted(VERSIONS), "modules": sorted(modules),
                       "failed": failed})
    path = where / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    tmp = path.with_suffix(".part")
    tmp.write_text(text)
    tmp.replace(path)  # a reader never sees half a recording


def everything(modules: set[str], failed: int) -> Recording:
    """This process's recording with every one the processes before it saved (`save`)."""
    total = Recording(set(OBSERVED), set(VERSIONS), set(modules), failed)
    where = record_dir()
    for path in sorted(where.glob("*.json")) if where is not None and where.is_dir() else []:
        saved = json.loads(path.read_text())
        total.observed |= {(a, b, c) for a, b, c in saved["observed"]}
        total.versions |= {(a, b, c) for a, b, c in saved["versions"]}
        total.modules |= set(saved["modules"])
        total.failed += int(saved["failed"])
    return total
