"""Output native libraries write straight to the process's file descriptors, kept from the user:
HiGHS's banner on standard output (`planner.intra.highs`) and kineto's profiler start and stop
lines on standard error (`runtime.peak_memory`). Neither library has a setting that turns its
line off, and Python's `contextlib.redirect_stdout` only swaps `sys.stdout`, not descriptor 1."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def fd_silenced(fd: int) -> Iterator[None]:
    """File descriptor `fd` (1 or 2) pointed at /dev/null while the block runs: what native code
    writes there is dropped. Python's matching stream is flushed first, so what it buffered
    before still appears; exceptions propagate."""
    (sys.stdout if fd == 1 else sys.stderr).flush()
    saved = os.dup(fd)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(null)
