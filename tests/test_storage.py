"""The newest checkpoint of a job, from the layout in the policy."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from activities.storage import StorageActivities
from fleetmedic.models import CheckpointQuery
from fleetmedic.policy import StoragePolicy
from tests.harness import run_activity


def test_newest_checkpoint_by_modification_time(tmp_path: Path) -> None:
    storage = StorageActivities(StoragePolicy(root=str(tmp_path), layout="{job_id}/ckpt-*", step_pattern=r"(\d+)"))
    job = tmp_path / "42"
    job.mkdir()
    now = time.time()
    for step, age in ((100, 30), (200, 20), (150, 5)):  # the newest file is not the highest step
        path = job / f"ckpt-{step}.pt"
        path.touch()
        os.utime(path, (now - age, now - age))
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "ckpt-999.pt").touch()
    found = run_activity(storage.newest_checkpoint, CheckpointQuery(job_id=42))
    assert found is not None and found.step == 150 and found.path.endswith("ckpt-150.pt")
    assert abs(found.modified.timestamp() - (now - 5)) < 1


def test_no_checkpoint_yet(tmp_path: Path) -> None:
    storage = StorageActivities(StoragePolicy(root=str(tmp_path)))
    assert run_activity(storage.newest_checkpoint, CheckpointQuery(job_id=7)) is None


def test_job_name_in_the_layout_and_names_without_a_step(tmp_path: Path) -> None:
    storage = StorageActivities(StoragePolicy(root=str(tmp_path), layout="{job_name}/latest*"))
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "latest").touch()
    found = run_activity(storage.newest_checkpoint, CheckpointQuery(job_id=1, job_name="llm"))
    assert found is not None and found.step is None


def test_storage_errors_are_retryable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = StorageActivities(StoragePolicy(root=str(tmp_path)))
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "step-1").touch()

    def stale(path: str) -> os.stat_result:
        raise OSError(116, "Stale file handle")

    monkeypatch.setattr(os, "stat", stale)
    with pytest.raises(ApplicationError) as err:
        run_activity(storage.newest_checkpoint, CheckpointQuery(job_id=5))
    assert err.value.type == "Unavailable" and not err.value.non_retryable


def test_a_checkpoint_still_being_written_does_not_count(tmp_path: Path) -> None:
    """`stable`: the newest file grows between the two reads (a writer at work): the older, complete
    one is the checkpoint to resume from."""
    import threading

    storage = StorageActivities(StoragePolicy(root=str(tmp_path), layout="{job_id}/step-*",
                                              stable_interval="300ms"))
    job = tmp_path / "9"
    job.mkdir()
    (job / "step-1").write_bytes(b"x" * 100)
    os.utime(job / "step-1", (time.time() - 60, time.time() - 60))
    partial = job / "step-2"
    partial.write_bytes(b"x" * 10)
    stop = threading.Event()

    def writer() -> None:
        with partial.open("ab") as out:
            while not stop.is_set():
                out.write(b"x" * 10)
                out.flush()
                time.sleep(0.02)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        found = run_activity(storage.newest_checkpoint, CheckpointQuery(job_id=9))
    finally:
        stop.set()
        thread.join()
    assert found is not None and found.step == 1 and found.complete_by == "stable size"
    found = run_activity(storage.newest_checkpoint, CheckpointQuery(job_id=9))
    assert found is not None and found.step == 2  # written out: now it counts


def test_marker_rule_counts_only_checkpoints_with_their_marker(tmp_path: Path) -> None:
    storage = StorageActivities(StoragePolicy(root=str(tmp_path), layout="{job_id}/step-*", complete="marker",
                                              marker="{path}/.metadata"))
    job = tmp_path / "11"
    (job / "step-1").mkdir(parents=True)
    (job / "step-1" / ".metadata").touch()
    os.utime(job / "step-1", (time.time() - 60, time.time() - 60))
    (job / "step-2").mkdir()
    (job / "step-2" / "shard-0.distcp").write_bytes(b"partial")  # no .metadata yet
    found = run_activity(storage.newest_checkpoint, CheckpointQuery(job_id=11))
    assert found is not None and found.step == 1 and found.complete_by == "marker"
    (job / "step-2" / ".metadata").touch()
    found = run_activity(storage.newest_checkpoint, CheckpointQuery(job_id=11))
    assert found is not None and found.step == 2


def test_a_marker_without_path_is_refused() -> None:
    with pytest.raises(ValueError, match="marker must contain"):
        StoragePolicy(complete="marker", marker="COMPLETE")
