"""What every benchmark reports the same way."""

from __future__ import annotations


def percentile(values: list[float], p: float) -> float:
    """The nearest-rank p-th percentile (p in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]
