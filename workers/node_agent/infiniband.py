"""InfiniBand port counters from sysfs — not exported by default, and the most important
metrics of a training cluster. `/sys/class/infiniband/<device>/ports/<port>/`:
`state` ("4: ACTIVE"), `phys_state`, `rate`, `counters/*` (the IB PMA counters) and
`hw_counters/*` (the driver's own). The root is configurable so tests write the tree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("fleetmedic.agent.infiniband")

ACTIVE = 4
# PMA counters exported under their own metric names (the rules read the first three).
NAMED_COUNTERS = {
    "symbol_error": "symbol_errors",
    "port_rcv_errors": "receive_errors",
    "link_downed": "link_downed",
    "port_xmit_wait": "transmit_wait",
    "link_error_recovery": "link_error_recovery",
    "port_xmit_discards": "transmit_discards",
    "local_link_integrity_errors": "local_link_integrity_errors",
    "excessive_buffer_overrun_errors": "excessive_buffer_overrun_errors",
    "port_rcv_remote_physical_errors": "receive_remote_physical_errors",
}
# Data counters count 4-byte words (IBTA); exported in bytes.
DATA_COUNTERS = {"port_xmit_data": "transmit", "port_rcv_data": "receive"}


@dataclass
class PortSample:
    device: str
    port: str
    state: int | None = None  # 4 = ACTIVE
    state_name: str = ""
    phys_state: str = ""
    counters: dict[str, int] = field(default_factory=dict)  # named counter -> value
    data_bytes: dict[str, int] = field(default_factory=dict)  # transmit / receive -> bytes
    hw_counters: dict[str, int] = field(default_factory=dict)


class Infiniband:
    def __init__(self, root: str | Path = "/sys/class/infiniband") -> None:
        self.root = Path(root)
        self._warned: set[str] = set()

    def sample(self) -> list[PortSample]:
        if not self.root.is_dir():
            self._warn(str(self.root), "no InfiniBand devices (root missing): no InfiniBand metrics")
            return []
        ports = []
        for device in sorted(p for p in self.root.iterdir() if (p / "ports").is_dir()):
            for port in sorted((device / "ports").iterdir(), key=lambda p: p.name):
                ports.append(self._port(device.name, port))
        return ports

    def _port(self, device: str, path: Path) -> PortSample:
        sample = PortSample(device=device, port=path.name)
        state = self._read(path / "state")
        if state:
            number, _, name = state.partition(":")
            sample.state = int(number) if number.strip().isdigit() else None
            sample.state_name = name.strip()
        sample.phys_state = (self._read(path / "phys_state") or "").partition(":")[2].strip()
        counters = path / "counters"
        for file, name in NAMED_COUNTERS.items():
            value = self._number(counters / file)
            if value is not None:
                sample.counters[name] = value
        for file, direction in DATA_COUNTERS.items():
            value = self._number(counters / file)
            if value is not None:
                sample.data_bytes[direction] = value * 4
        hw = path / "hw_counters"
        if hw.is_dir():
            for counter in sorted(hw.iterdir()):
                value = self._number(counter)
                if value is not None:
                    sample.hw_counters[counter.name] = value
        return sample

    def _read(self, path: Path) -> str | None:
        try:
            return path.read_text().strip()
        except OSError as exc:
            self._warn(str(path), f"cannot read {path}: {exc.strerror}")
            return None

    def _number(self, path: Path) -> int | None:
        text = self._read(path) if path.exists() else None
        if text is None:
            return None
        try:
            return int(text, 0)
        except ValueError:
            self._warn(str(path), f"{path} is not a number: {text[:40]!r}")
            return None

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)
