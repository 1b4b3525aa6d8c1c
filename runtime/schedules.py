"""The order in which a pipeline rank runs its forwards and backwards (`runtime.pipeline`).

An action is ``(kind, chunk, micro-batch)``: kind ``"F"`` (forward) or ``"B"`` (backward), chunk
the index of a stage of the plan (``plan.stages``).

* GPipe: every forward, then every backward.
* 1F1B: stage ``s`` of ``S`` runs ``S - s - 1`` warm-up forwards, then one forward and one backward
  alternately, then the remaining backwards.
* Interleaved 1F1B (Megatron-LM's ``forward_backward_pipelining_with_interleaving``): ``p`` device
  groups, ``v`` chunks each (chunk ``c`` on group ``c % p``), ``B`` micro-batches (a multiple of
  ``p``). Group ``r`` runs ``B * v`` forwards and as many backwards; its k-th forward is of its
  model chunk ``(k mod p*v) // p`` (global chunk ``j * p + r``), micro-batch
  ``(k // (p*v)) * p + k mod p``; its k-th backward visits the chunks in reverse. It runs
  ``min((p - r - 1) * 2 + (v - 1) * p, B * v)`` warm-up forwards (every forward when ``B == p``),
  then alternates forward and backward, then the remaining backwards.

`deadlock_free(orders, inputs)` checks that per-group orders can run with blocking receives and
non-blocking sends: it simulates the groups, each running its next action once every action
that sends to it has run, until none can move, and returns the actions left blocked (none when the
orders are safe).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cost_models.errors import MeshplanError

__all__ = [
    "SCHEDULES",
    "Action",
    "deadlock_free",
    "interleaved_order",
    "schedule_order",
]

# zero_bubble: torch.distributed.pipelining's ScheduleInterleavedZeroBubble (`runtime.torch_pipeline`)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")

Action = tuple[str, int, int]  # ("F" | "B", chunk, micro-batch)


def schedule_order(
    schedule: str, stage: int, num_stages: int, B: int
) -> list[tuple[str, int]]:
    """The (``"F"`` or ``"B"``, micro-batch) actions of one stage of a GPipe or 1F1B pipeline."""
    if schedule == "gpipe":
        return [("F", m) for m in range(B)] + [("B", m) for m in range(B)]
    if schedule != "1f1b":
        raise MeshplanError(
            f"schedule {schedule!r} is not supported here; use gpipe or 1f1b"
        )
    warm = min(num_stages - stage - 1, B)
    out = [("F", m) for m in range(warm)]
    for m in range(warm, B):
        out += [("F", m), ("B", m - warm)]
    return out + [("B", m) for m in range(B - warm, B)]


def interleaved_order(group: int, p: int, v: int, B: int) -> list[Action]:
    """The actions of device group `group` (of `p`) in an interleaved 1F1B pipeline of `v` chunks
    per group and `B` micro-batches (module docstring)."""
    if p < 1 or v < 1 or not 0 <= group < p:
        raise MeshplanError(
            f"no group {group} in an interleaved pipeline of {p} groups"
        )
    if B % p:
        raise MeshplanError(
            f"interleaved 1F1B needs the micro-batches ({B}) to be a multiple of the "
            f"pipeline groups ({p})"
        )
    total = B * v

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def fwd(k: int) -> Action:
        return ("F", ((k % (p * v)) // p) * p + group, micro(k))

    def bwd(k: int) -> Action:
        return ("B", (v - 1 - (k % (p * v)) // p) * p + group, micro(k))

    warm = total if B == p else min((p - group - 1) * 2 + (v - 1) * p, total)
    out = [fwd(k) for k in range(warm)]
    for k in range(total - warm):
        out += [fwd(k + warm), bwd(k)]
    return out + [bwd(k) for k in range(total - warm, total)]


def deadlock_free(
    orders: Sequence[Sequence[Action]],
    inputs: Mapping[int, set[int]],
) -> list[Action]:
    """The actions that can never run when group ``g`` runs ``orders[g]`` in order with blocking
    receives (``[]``: the orders are deadlock-free). ``inputs[c]`` are the chunks sending values
    to chunk ``c``. ``F(c, m)`` waits for ``F(s, m)``
    of every ``s`` in ``inputs[c]``; ``B(c, m)`` waits for ``F(c, m)`` and ``B(t, m)`` of every
    chunk ``t`` reading from ``c``."""
    readers: dict[int, set[int]] = {}
    for c, srcs in inputs.items():
        for s in srcs:
            readers.setdefault(s, set()).add(c)
    done: set[Action] = set()
    pos = [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for g, order in enumerate(orders):
            while pos[g] < len(order):
                kind, c, m = order[pos[g]]
                if kind == "F":
                    need = [("F", s, m) for s in inputs.get(c, ())]
                else:
                    need = [("F", c, m)] + [("B", t, m) for t in readers.get(c, ())]
                if not all(a in done for a in need):
                    break
                done.add(order[pos[g]])
                pos[g] += 1
                progress = True
    return [order[pos[g]] for g, order in enumerate(orders) if pos[g] < len(order)]
