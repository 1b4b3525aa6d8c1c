"""runtime.peak_memory: the peak of live tensors the CPU allocator reports, against tensors whose
sizes are known (one process, no launch)."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from cost_models.errors import MeshplanError
from runtime.peak_memory import PeakMemory

F32 = 4


def test_peak_is_the_known_live_set_of_a_step() -> None:
    """w (256x512) is built after the recorder starts, so it counts; x, made before, does not; a
    setup tensor freed before the steps does not. In the step, y = x @ w and z = relu(y) are
    live with relu's input gradient and w's gradient at the end of backward: the peak is
    w + y + z + grad y + grad w (plus a few scalars: the loss and its gradient seed)."""
    x = torch.randn(64, 256)
    with PeakMemory("cpu") as rec:
        w = torch.randn(256, 512, requires_grad=True)
        scratch = torch.empty(1 << 20)
        del scratch
        rec.steps_begin()
        y = x @ w
        z = y.relu()
        z.sum().backward()
        del y, z
    expected = F32 * (256 * 512 * 2 + 64 * 512 * 3)
    assert expected <= rec.peak_bytes <= expected + 64


def test_a_free_on_another_thread_is_subtracted() -> None:
    """gloo's worker threads free tensors: a block freed on another thread leaves the running
    total (else the next block would count twice)."""
    n = 1 << 18
    with PeakMemory("cpu") as rec:
        rec.steps_begin()
        held = [torch.empty(n)]
        t = threading.Thread(target=held.clear)
        t.start()
        t.join()
        b = torch.empty(n)
        del b
    assert F32 * n <= rec.peak_bytes < 2 * F32 * n


def test_bad_device_and_missing_steps_begin() -> None:
    with pytest.raises(MeshplanError, match="'cpu' or 'cuda'"):
        PeakMemory("tpu")
    with pytest.raises(MeshplanError, match="steps_begin"), PeakMemory("cpu"):
        torch.empty(10)


def test_the_profiler_writes_nothing_to_standard_error(
    capfd: pytest.CaptureFixture,
) -> None:
    """Kineto's start and stop lines (written by C++ to file descriptor 2) do not reach a run's
    output; what Python writes there before and after still does."""
    print("before", file=sys.stderr)
    with PeakMemory("cpu") as rec:
        rec.steps_begin()
        torch.empty(10)
    print("after", file=sys.stderr)
    err = capfd.readouterr().err
    assert "profiler_st" not in err
    assert err.split() == ["before", "after"]
