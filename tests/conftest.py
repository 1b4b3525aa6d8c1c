"""Tests plan in one process (`planner.size_search`): starting worker processes costs a few
seconds a plan, more than the small plans of the tests take. `tests/test_size_search.py` checks
the worker processes against this."""

import os

os.environ.setdefault("MESHPLAN_PLANNER_PROCESSES", "1")
# what the test modules that ranks import (as their main module) import besides the runtime:
# once in each worker's fork server instead of in every rank (`runtime.launch.PRELOAD`)
os.environ.setdefault("MESHPLAN_PRELOAD", "pytest,planner.api,planner.plans.manual")


import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed launch's per-rank tracebacks (a timeout's: each hung rank's stack) go into the
    test report, so a hang seen once in CI can be read from its log."""
    outcome = yield
    exc = call.excinfo.value if call.excinfo else None
    tracebacks = getattr(exc, "tracebacks", None)
    if tracebacks:
        report = outcome.get_result()
        for rank, text in sorted(tracebacks.items()):
            report.sections.append((f"rank {rank}", text))
