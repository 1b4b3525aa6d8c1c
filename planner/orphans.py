"""Child processes that end with their parent: Linux's parent-death signal, for the planner's
forked workers (`planner.size_search`) and the runtime's ranks (`runtime.launch`). Python's
multiprocessing has no such option: a child whose parent is killed with SIGKILL keeps running
until it notices by itself, and a forked child that holds its own queues never does."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

#: prctl's option: the signal this process gets when its parent ends (linux/prctl.h)
PR_SET_PDEATHSIG = 1


def end_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent ends (Linux only; elsewhere nothing).
    With `parent`, the pid the parent had: exit at once if it already ended before the signal
    was asked for (this process then has another parent)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # no libc prctl to call
        return
    if parent is not None and os.getppid() != parent:
        os._exit(1)
