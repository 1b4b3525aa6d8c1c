"""Tests plan in one process (`planner.size_search`): starting worker processes costs a few
seconds a plan, more than the small plans of the tests take. `tests/test_size_search.py` checks
the worker processes against this."""

import os

os.environ.setdefault("MESHPLAN_PLANNER_PROCESSES", "1")
