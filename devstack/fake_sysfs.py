"""An InfiniBand sysfs tree as the kernel lays it out, written under a test's directory."""

from __future__ import annotations

from pathlib import Path

PORT_STATES = {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}


def write_port(root: Path, device: str, port: int = 1, *, state: int = 4, counters: dict[str, int] | None = None,
               hw_counters: dict[str, int] | None = None) -> Path:
    path = root / device / "ports" / str(port)
    (path / "counters").mkdir(parents=True, exist_ok=True)
    (path / "hw_counters").mkdir(exist_ok=True)
    (path / "state").write_text(f"{state}: {PORT_STATES.get(state, 'UNKNOWN')}\n")
    (path / "phys_state").write_text("5: LinkUp\n" if state == 4 else "3: Disabled\n")
    (path / "rate").write_text("400 Gb/sec (4X NDR)\n")
    values = {"symbol_error": 0, "port_rcv_errors": 0, "link_downed": 0, "port_xmit_wait": 0,
              "link_error_recovery": 0, "port_xmit_discards": 0, "local_link_integrity_errors": 0,
              "excessive_buffer_overrun_errors": 0, "port_rcv_remote_physical_errors": 0,
              "port_xmit_data": 0, "port_rcv_data": 0, **(counters or {})}
    for name, value in values.items():
        (path / "counters" / name).write_text(f"{value}\n")
    for name, value in {"out_of_buffer": 0, "rx_write_requests": 0, **(hw_counters or {})}.items():
        (path / "hw_counters" / name).write_text(f"{value}\n")
    return path


def write_fabric(root: Path, devices: int = 8) -> Path:
    """A GPU node's compute fabric: one 400G port per GPU (mlx5_0 … mlx5_7), all ACTIVE."""
    for i in range(devices):
        write_port(root, f"mlx5_{i}")
    return root
