"""The typed activity references the workflows call (fleetmedic/activity_refs.py) are exactly the
activities the worker registers: the same names, arguments and results; nothing dead, nothing missing."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Any

from temporalio import activity

from fleetmedic import activity_refs
from fleetmedic.policy import load_policy
from fleetmedic.settings import Settings
from workers.worker import build_activities


def registered(tmp_path: Path) -> dict[str, Any]:
    settings = Settings.model_validate({"task_queue": "q", "cluster": "c", "slurm": "off",
                                        "kubeconfig": str(tmp_path / "none")})
    functions = build_activities(settings, load_policy(None), None, api_client=lambda: None)  # type: ignore[arg-type]
    return {activity._Definition.must_from_callable(fn).name: fn for fn in functions}


def test_every_reference_is_a_registered_activity_with_its_types(tmp_path: Path) -> None:
    functions = registered(tmp_path)
    refs = {ref.name: ref for ref in activity_refs.ALL}
    assert set(refs) == set(functions), set(refs) ^ set(functions)
    for name, fn in functions.items():
        hints = typing.get_type_hints(fn)
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        ref = refs[name]
        assert tuple(hints[p] for p in params) == ref.params, name
        expected = type(None) if ref.result is None else ref.result
        assert hints["return"] == expected, (name, hints["return"], ref.result)


def test_every_reference_is_called_by_a_workflow() -> None:
    source = "\n".join(path.read_text() for path in Path(__file__).parent.parent.joinpath("workflows").glob("*.py"))
    constants = [name for name, value in vars(activity_refs).items() if isinstance(value, activity_refs.Activity)]
    assert [name for name in constants if f"refs.{name}" not in source] == []
