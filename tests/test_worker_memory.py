"""How many runs a worker keeps in memory: what its memory limit holds, read as a container gives it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetmedic.settings import Settings, SettingsError
from workers.memory import MOST, workflow_cache


def cgroup(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /sys/fs/cgroup tree with `files` and the /proc/self/cgroup that points into it."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    (tmp_path / "self-cgroup").write_text(proc)
    return root, tmp_path / "self-cgroup"


def cache(settings: Settings, where: tuple[Path, Path]) -> tuple[int, str]:
    size = workflow_cache(settings, *where)
    return size.runs, size.why


def test_the_shipped_limit_keeps_what_it_holds_and_no_more(tmp_path: Path) -> None:
    nowhere = cgroup(tmp_path, "", {})
    # The worker's 1Gi limit, as the downward API writes it (bytes) and as a person does.
    for value in (str(2**30), "1Gi"):
        runs, why = cache(Settings.from_env({"FLEETMEDIC_WORKER_MEMORY": value}), nowhere)
        assert runs == (1024 - 320) * 4 == 2816
        assert "1024 MiB (FLEETMEDIC_WORKER_MEMORY)" in why
    two_gb = cache(Settings.from_env({"FLEETMEDIC_WORKER_MEMORY": "2G"}), nowhere)[0]
    assert two_gb == (2 * 10**9 - 320 * 2**20) // 2**18
    # Less than the process needs still keeps a few; much more keeps no more than without a limit.
    assert cache(Settings.from_env({"FLEETMEDIC_WORKER_MEMORY": "256Mi"}), nowhere)[0] == 100
    assert cache(Settings.from_env({"FLEETMEDIC_WORKER_MEMORY": "64Gi"}), nowhere)[0] == MOST
    # No limit anywhere: as before the limit was read.
    assert cache(Settings.from_env({}), nowhere) == (MOST, "no memory limit")


def test_an_operators_number_wins_over_the_limit(tmp_path: Path) -> None:
    nowhere = cgroup(tmp_path, "", {})
    env = {"FLEETMEDIC_WORKER_MEMORY": "1Gi", "FLEETMEDIC_WORKFLOW_CACHE": "250"}
    assert cache(Settings.from_env(env), nowhere) == (250, "FLEETMEDIC_WORKFLOW_CACHE")
    assert cache(Settings.from_env({**env, "FLEETMEDIC_WORKFLOW_CACHE": "auto"}), nowhere)[0] == 2816


def test_the_limit_of_the_processs_cgroup_counts_without_the_variable(tmp_path: Path) -> None:
    # cgroup v2 inside a container: the process's cgroup is the namespace's root.
    v2 = cgroup(tmp_path / "v2", "0::/\n", {"memory.max": str(512 * 2**20)})
    runs, why = cache(Settings.from_env({}), v2)
    assert runs == 768 and "the cgroup's memory limit" in why
    # v2 on a host (a systemd unit's MemoryMax): the process's own cgroup, not the root's.
    unit = cgroup(tmp_path / "unit", "0::/system.slice/fleetmedic.service\n",
                  {"system.slice/fleetmedic.service/memory.max": str(2**30), "memory.max": "max"})
    assert cache(Settings.from_env({}), unit)[0] == 2816
    assert cache(Settings.from_env({}), cgroup(tmp_path / "max", "0::/\n", {"memory.max": "max"}))[0] == MOST
    # cgroup v1 (this machine's kind), limited and not: v1 writes "no limit" as a huge number.
    v1 = "4:memory:/kubepods/pod1/abc\n1:cpu,cpuacct:/kubepods/pod1/abc\n"
    limited = cgroup(tmp_path / "v1", v1, {"memory/kubepods/pod1/abc/memory.limit_in_bytes": str(2**30)})
    assert cache(Settings.from_env({}), limited)[0] == 2816
    unlimited = cgroup(tmp_path / "v1-none", v1, {"memory/memory.limit_in_bytes": "9223372036854771712"})
    assert cache(Settings.from_env({}), unlimited)[0] == MOST
    # The variable (the container's limit, from the downward API) wins over the cgroup.
    assert cache(Settings.from_env({"FLEETMEDIC_WORKER_MEMORY": "512Mi"}), limited)[0] == 768


def test_a_bad_memory_names_the_variable() -> None:
    for value in ("lots", "1GiB", "-1Gi"):
        with pytest.raises(SettingsError, match="FLEETMEDIC_WORKER_MEMORY: .*1Gi"):
            Settings.from_env({"FLEETMEDIC_WORKER_MEMORY": value})
    with pytest.raises(SettingsError, match="FLEETMEDIC_WORKFLOW_CACHE"):
        Settings.from_env({"FLEETMEDIC_WORKFLOW_CACHE": "big"})
