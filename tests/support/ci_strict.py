"""A pytest plugin: under ``CI=true`` a skipped test or test module is a failure.

CI runs the real path or fails: a test that would skip there (no llama_cpp, no native capture callback, no C
compiler, no network namespaces) must not pass CI silently. On a developer's laptop a skip stays a skip.
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("true", "1")


def _fail_skip_in_ci(report: pytest.CollectReport | pytest.TestReport) -> None:
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (CI=true), which must run the real path: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())
