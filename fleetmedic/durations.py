"""Human durations in policy files: ``90s``, ``30m``, ``24h``, ``7d``, compound ones as Go,
Prometheus and kubectl write them (``1h30m``, ``2d12h``, ``1m30s500ms``), or a number of seconds."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = r"(\d+(?:\.\d+)?)(ms|s|m|h|d)"
_PATTERN = re.compile(rf"^(?:{_PART})+$")


def parse_duration(value: Any) -> Any:
    """Turn ``"90s"`` into a timedelta; leave timedeltas and ISO strings to pydantic."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a number of seconds or a string like '90s', '30m', '24h'")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return timedelta(seconds=value)
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        if _PATTERN.match(text):
            parts = re.findall(_PART, text)
            units = [unit for _, unit in parts]
            if len(set(units)) != len(units) or units != sorted(units, key=lambda u: -_UNITS[u]):
                raise ValueError(f"'{value}' is not a duration: write each unit once, largest first, e.g. '1h30m'")
            return timedelta(seconds=sum(float(number) * _UNITS[unit] for number, unit in parts))
        if not value.startswith("P"):
            raise ValueError(f"'{value}' is not a duration: use e.g. '90s', '30m', '1h30m', '7d'")
    return value


def format_duration(value: timedelta) -> str:
    """The shortest compound form (``1h30m``) that reads back to the same duration."""
    seconds = value.total_seconds()
    if seconds == 0:
        return "0s"
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            whole = int(seconds // size)
            out.append(f"{whole}{unit}")
            seconds -= whole * size
    if seconds:
        out.append(f"{seconds:g}s")
    return "".join(out)


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
