"""Python's cyclic garbage collector held back while the planner searches (`sparse_collections`).

A size's search allocates millions of small objects (prices, options, per-node tables) that live
until the size is done. With the interpreter's default thresholds (a young collection every 700
allocations, an oldest-generation one every 100 young ones) the oldest generation, which holds
the traced graph and every price kept so far, is walked again and again: on one llama3-70b size
(8x8xH100-80GB, 4 rows per micro-batch, one process) the collections of the oldest generation
took about 3 s of its 20 s of CPU, and collected next to nothing (the planner's objects are
freed by reference counting when the size ends). Collecting young objects every `YOUNG`
allocations, and the older generations proportionally less often, takes that away; the
same plan's peak memory did not change (916-917 MB). PyTorch has nothing for this: it is the
interpreter's own setting, `gc.set_threshold`, set for the search and restored after.

The collections that remain still walk every object the search began with: the interpreter's
and torch's modules, the model, the caller's. `frozen_heap` leaves those out (`gc.freeze`, as
Python's documentation advises before a fork; a forked worker freezes what it inherits itself,
`planner.size_search.start_forked_worker`). Planning gpt-39b on 8x8 V100s, the planning
process's two collections of the oldest generation during the search took 0.23 and 0.26 s
and collected 0 and 2 objects; the second ran while the plan was assembled, after the other
process had ended. With both (and `meshplan plan` under `sparse_collections` from before its
imports), that process spent 0.82-0.88 s collecting instead of 1.04-1.44 s (three runs each,
`gc.callbacks`), and four alternating runs took 15.7-16.6 s against 16.3-17.4 s
(benchmarks/planning_time_log.md, 2026-12-07).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: allocations between young collections during a search (the interpreter's default is 700)
YOUNG = 50_000
#: young collections per middle one, and middle ones per collection of the oldest generation
OLDER = 20

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] = ()


@contextmanager
def sparse_collections() -> Iterator[None]:
    """Run the body with the collector's thresholds at (`YOUNG`, `OLDER`, `OLDER`), unless the
    caller set higher ones; the caller's thresholds come back when the outermost such body
    (of any thread) ends."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            if _saved[0] and _saved[0] < YOUNG:  # 0: the caller turned collection off
                gc.set_threshold(YOUNG, OLDER, OLDER)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_saved)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Run the body with every object alive at its start left out of the collections
    (`gc.freeze`), given back to them at its end (`gc.unfreeze`); neither where objects are
    frozen already (by the caller, or a forked worker's inheritance), since unfreezing would
    give theirs back too."""
    with _lock:
        mine = gc.get_freeze_count() == 0
        if mine:
            gc.freeze()
    try:
        yield
    finally:
        if mine:
            gc.unfreeze()
