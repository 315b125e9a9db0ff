"""The catalog of destructive activities is complete: every activity the worker registers is either
destructive (gated, see tests/gate_check.py) or listed as safe."""

from __future__ import annotations

from pathlib import Path

from temporalio import activity

from fleetmedic.policy import load_policy
from fleetmedic.settings import Settings
from tests.gate_check import DESTRUCTIVE, SAFE
from workers.worker import build_activities


def test_every_registered_activity_is_classified(tmp_path: Path) -> None:
    settings = Settings.model_validate({"task_queue": "q", "cluster": "c", "slurm": "off",
                                        "kubeconfig": str(tmp_path / "none")})
    registered = {activity._Definition.must_from_callable(fn).name or "" for fn in
                  build_activities(settings, load_policy(None), None, api_client=lambda: None)}  # type: ignore[arg-type]
    assert registered == set(DESTRUCTIVE) | SAFE, (registered ^ (set(DESTRUCTIVE) | SAFE))
    assert not set(DESTRUCTIVE) & SAFE
