"""Names said in a decision or a result: a training job has tens of nodes, a migration may leave
hundreds of pods behind, and a line that names them all is read by nobody."""

from __future__ import annotations

from collections.abc import Sequence


def first_few(names: Sequence[str], shown: int, sep: str = ", ") -> str:
    """The first `shown` names, and how many more there are."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return sep.join(names[:shown]) + more
