"""Human durations in policy files: ``90s``, ``30m``, ``24h``, ``7d`` or a number of seconds."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")


def parse_duration(value: Any) -> Any:
    """Turn ``"90s"`` into a timedelta; leave timedeltas and ISO strings to pydantic."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a number of seconds or a string like '90s', '30m', '24h'")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return timedelta(seconds=value)
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match:
            return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
        if not value.startswith("P"):
            raise ValueError(f"'{value}' is not a duration: use e.g. '90s', '30m', '24h', '7d'")
    return value


def format_duration(value: timedelta) -> str:
    seconds = value.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
