"""The suite's bound on a hung test (tests/watchdog.py): the test fails naming where it waited, an
async one unwinds its `async with` blocks, and the tests after it still run."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

HUNG = '''import asyncio
import time
from pathlib import Path


async def test_waits_for_an_answer_that_never_comes():
    try:
        await asyncio.Event().wait()
    finally:
        Path("unwound").write_text("the async test's cleanup ran")


def test_blocks_in_a_call_without_a_deadline():
    time.sleep(3600)


def test_after_them():
    pass
'''


def line(text: str) -> int:
    return next(n for n, line in enumerate(HUNG.splitlines(), 1) if text in line)


def test_a_hung_test_fails_saying_where_and_the_suite_goes_on(pytester: pytest.Pytester,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeini("[pytest]\nasyncio_mode = auto\ntest_limit_s = 2\n")
    pytester.makeconftest('pytest_plugins = ["tests.watchdog"]\n')
    pytester.makepyfile(test_hung=HUNG)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-ra", timeout=120)
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    # Each names the test, the limit and the line it waited on, whole, above the short summary
    # (which cuts a line at the terminal's width): the end of the output is what CI shows.
    waits, blocks = "test_waits_for_an_answer_that_never_comes", "test_blocks_in_a_call_without_a_deadline"
    result.stdout.re_match_lines([
        rf"HUNG test_hung.py::{waits} still running after \d+ s \(limit 2 s\), "
        rf"waiting at \S*test_hung.py:{line('Event().wait()')} {waits} > \S*asyncio/locks.py:\d+ wait$",
        rf"HUNG test_hung.py::{blocks} still running after \d+ s \(limit 2 s\), "
        rf"at \S*test_hung.py:{line('time.sleep(3600)')} {blocks}$",
    ], consecutive=True)
    assert "every thread, then every asyncio task" in out
    assert (pytester.path / "unwound").read_text() == "the async test's cleanup ran"
