"""A rank's peak memory while it trains: the bytes of live tensors its allocator reports.

    with PeakMemory("cpu") as rec:        # before the Trainer is built
        trainer = Trainer(...)
        rec.steps_begin()                 # setup done: the peak covers the steps from here
        for b in batches:
            trainer.step(b)
    rec.peak_bytes                        # the most bytes live during the steps

What is measured: the most bytes the allocator had handed out and not yet freed at any moment of
the steps, counting only what was allocated since the recorder started (the trainer's parameters,
gradients, optimizer state, activations, communication buffers, ...), not what the caller held
before (the full model it built, its batches). The peak covers the steps, not the setup: the plan
predicts a training step's peak (`cost_models.memory.stage_peak_bytes`), while building the
trainer transiently holds a full copy of the model that a real job would load sharded.

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` at `steps_begin`,
  less ``memory_allocated`` when the recorder started.
* CPU: PyTorch has no allocator statistics for the CPU (``torch.cuda.memory_stats`` has no CPU
  counterpart in torch 2.13), but its CPU allocator reports every allocation and free, with the
  running total of bytes live, to the profiler when memory profiling is on
  (``torch.profiler.profile(profile_memory=True)``; c10's ``ProfiledCPUMemoryReporter``). The
  recorder keeps a profiler session open from `__enter__` to `__exit__` and reads the peak of that
  running total over the allocation events after `steps_begin`, less its value when the session
  began. The profiler turns the reporting on for its own thread only, while gloo's worker threads
  also free tensors (a free on a thread without it is never subtracted, and the running total
  drifts up); c10's flag ``caffe2_report_cpu_memory_usage`` makes the allocator track every
  thread's allocations and frees in that total. PyTorch has no Python switch for it, so the
  recorder sets the exported flag in ``libc10`` through ctypes while it records. Blocks allocated
  before the recorder started are not tracked (one freed inside is not subtracted), hence it
  starts before the trainer is built. The profiler roughly doubles a step's time on the CPU:
  measure in dedicated steps, not timed ones. Kineto (torch 2.13) writes a line to the process's
  standard error at each profiler start and stop (``USDT:... profiler_start``), from C++, with no
  setting that turns it off (``KINETO_LOG_LEVEL`` does not); the recorder points file descriptor 2
  at ``/dev/null`` for those two calls only (`planner.native_output.fd_silenced`), so that a measured run's
  output holds only meshplan's own lines.
"""

from __future__ import annotations

import ctypes
import os
import time
from types import TracebackType
from typing import Any, Self

import torch

from cost_models.errors import MeshplanError
from planner.native_output import fd_silenced

__all__ = ["PeakMemory"]


def _report_flag() -> ctypes.c_bool:
    """c10's ``FLAGS_caffe2_report_cpu_memory_usage`` (module docstring)."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    return ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")


class PeakMemory:
    """Records the peak bytes live on ``device_type`` ("cpu" or "cuda") during the steps
    (module docstring); `peak_bytes` after the ``with`` block."""

    def __init__(self, device_type: str = "cpu") -> None:
        if device_type not in ("cpu", "cuda"):
            raise MeshplanError(
                f"peak memory is recorded on 'cpu' or 'cuda', not {device_type!r}"
            )
        self.device_type = device_type
        self.peak_bytes: int | None = None
        self._prof: Any = None
        self._base = 0
        self._steps_ns: int | None = None
        self._flag: ctypes.c_bool | None = None
        self._flag_before = False

    def __enter__(self) -> Self:
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self._flag = _report_flag()
            self._flag_before = bool(self._flag.value)
            self._flag.value = True
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with fd_silenced(2):
                self._prof.__enter__()
        return self

    def steps_begin(self) -> None:
        """Setup is done: the peak covers what follows."""
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._steps_ns = time.time_ns()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            if exc_type is None:
                self.peak_bytes = torch.cuda.max_memory_allocated() - self._base
            return
        with fd_silenced(2):
            self._prof.__exit__(exc_type, exc, tb)
        self._flag.value = self._flag_before
        if exc_type is None:
            self.peak_bytes = self._cpu_peak()

    def _cpu_peak(self) -> int:
        if self._steps_ns is None:
            raise MeshplanError("PeakMemory: call steps_begin() before the steps")
        from torch._C._profiler import _EventType

        events = []  # (time, bytes allocated (+) or freed (-), running total after it)
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation:
                f = e.extra_fields
                events.append((e.start_time_ns, f.alloc_size, f.total_allocated))
            stack.extend(e.children)
        if not events:
            return 0
        events.sort(key=lambda e: e[0])
        first = events[0]
        base = first[2] - first[1]  # the running total when the session began
        at_steps = base
        peak = None
        for t, _, total in events:
            if t < self._steps_ns:
                at_steps = total
            else:
                peak = total if peak is None else max(peak, total)
        return max(at_steps, peak if peak is not None else at_steps) - base
