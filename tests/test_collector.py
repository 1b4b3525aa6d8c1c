"""`planner.collector.sparse_collections`: the garbage collector's thresholds raised while the
planner searches a size, the caller's back afterwards (also after an error, and after nested
or overlapping uses), and a caller's own choice (collection off, or rarer) left alone;
`frozen_heap`: what was alive before a search left out of its collections, given back after,
and a caller's own freeze left alone."""

from __future__ import annotations

import gc
import threading

import pytest

from planner.collector import OLDER, YOUNG, frozen_heap, sparse_collections


@pytest.fixture(autouse=True)
def _restore_thresholds():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_raised_inside_and_restored_after() -> None:
    gc.set_threshold(700, 10, 10)
    with sparse_collections():
        assert gc.get_threshold() == (YOUNG, OLDER, OLDER)
        with (
            sparse_collections()
        ):  # nested: still raised, not restored by the inner end
            pass
        assert gc.get_threshold() == (YOUNG, OLDER, OLDER)
    assert gc.get_threshold() == (700, 10, 10)
    with pytest.raises(ValueError), sparse_collections():
        raise ValueError("a failed search")
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("caller", [(0, 10, 10), (10 * YOUNG, 5, 5)])
def test_a_callers_own_setting_is_kept(caller: tuple[int, int, int]) -> None:
    gc.set_threshold(*caller)
    with sparse_collections():
        assert gc.get_threshold() == caller
    assert gc.get_threshold() == caller


def test_overlapping_threads_restore_once_both_end() -> None:
    gc.set_threshold(700, 10, 10)
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with sparse_collections():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with sparse_collections():
        t.start()
        assert inside.wait(10)
    assert gc.get_threshold() == (
        YOUNG,
        OLDER,
        OLDER,
    )  # the other thread is still inside
    release.set()
    t.join(10)
    assert gc.get_threshold() == (700, 10, 10)


def test_frozen_heap_freezes_inside_and_gives_back_after() -> None:
    gc.unfreeze()

    class Held:
        pass

    held = Held()  # alive before the body: left out of its collections

    def collected() -> bool:
        return any(o is held for o in gc.get_objects())

    assert collected()
    with frozen_heap():
        assert not collected()
    assert collected() and gc.get_freeze_count() == 0
    with pytest.raises(ValueError), frozen_heap():
        raise ValueError("a failed search")
    assert collected() and gc.get_freeze_count() == 0


def test_frozen_heap_leaves_a_callers_freeze() -> None:
    gc.unfreeze()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() == frozen  # not given back: the caller froze it
    finally:
        gc.unfreeze()
