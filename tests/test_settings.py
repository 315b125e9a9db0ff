"""Environment settings: every variable of DESIGN.md read, defaults documented in the README."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetmedic.settings import ENVIRONMENT, Settings, SettingsError

DESIGN_VARIABLES = [
    "TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "TEMPORAL_API_KEY", "TEMPORAL_TLS", "KUBECONFIG", "SLURM_CONF",
    "FLEETMEDIC_SLURMRESTD_URL", "SLURM_JWT", "SLACK_BOT_TOKEN", "FLEETMEDIC_SLACK_CHANNEL",
    "FLEETMEDIC_SLACK_API_URL", "FLEETMEDIC_WEBHOOK_TOKEN", "FLEETMEDIC_POLICY",
]


def test_defaults() -> None:
    settings = Settings.from_env({})
    assert settings.task_queue == "fleetmedic"
    assert settings.slack_api_url == "https://slack.com/api/"
    assert settings.policy_path is None and settings.metrics_port == 9464


def test_values_are_read() -> None:
    settings = Settings.from_env({"FLEETMEDIC_SLURMRESTD_URL": "http://slurm:6820", "SLURM_JWT": "jwt",
                                  "FLEETMEDIC_DRY_RUN": "true", "FLEETMEDIC_ACTIVITY_THREADS": "8",
                                  "SLACK_BOT_TOKEN": "xoxb-1"})
    assert settings.slurmrestd_url == "http://slurm:6820" and settings.dry_run and settings.activity_threads == 8
    assert "xoxb-1" not in repr(settings) and "jwt" not in repr(settings)  # secrets stay out of logs


def test_a_bad_value_names_the_variable() -> None:
    with pytest.raises(SettingsError, match="FLEETMEDIC_METRICS_PORT"):
        Settings.from_env({"FLEETMEDIC_METRICS_PORT": "many"})
    with pytest.raises(SettingsError, match="FLEETMEDIC_SLURM"):
        Settings.from_env({"FLEETMEDIC_SLURM": "sometimes"})


def test_every_design_variable_is_documented_in_the_readme() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    documented = {var.name for var in ENVIRONMENT}
    for name in DESIGN_VARIABLES:
        assert name in documented, name
    for var in ENVIRONMENT:
        assert f"`{var.name}`" in readme, f"README's configuration table lacks {var.name}"


def test_the_long_running_processes_run_on_the_event_loop_asked_for() -> None:
    """uvloop by default (workers/event_loop.py), Python's own loop when asked; anything else is
    refused with the variable's name, before a process starts."""
    import asyncio

    import uvloop

    from workers import event_loop

    async def running_loop() -> type:
        return type(asyncio.get_running_loop())

    assert Settings.from_env({}).event_loop == "uvloop"
    assert event_loop.run(running_loop(), Settings.from_env({}).event_loop) is uvloop.Loop
    chosen = Settings.from_env({"FLEETMEDIC_EVENT_LOOP": "asyncio"}).event_loop
    assert not issubclass(event_loop.run(running_loop(), chosen), uvloop.Loop)
    with pytest.raises(SettingsError, match="FLEETMEDIC_EVENT_LOOP"):
        Settings.from_env({"FLEETMEDIC_EVENT_LOOP": "trio"})
