"""A stage's graph run with its layers under activation checkpoints (recomputation), for
`runtime.executor.PlanExecutor`: the nodes of each layer of ``ex.recompute_layers`` (a
transformer block for "full", a plan layer for "layer", an attention core for "selective",
`runtime.stages.recomputed`) as one segment under ``torch.utils.checkpoint`` (non-reentrant),
the nodes outside every layer one by one without it. Each segment's values are freed after
their last use inside it, and the graph's values after the last segment reading them, as
``torch.fx.Interpreter.run`` frees values: what a segment keeps for backward is only what
autograd saved (the checkpoint: its inputs), as the plan's memory prices it
(`planner.inter.full_recompute`).

What PyTorch lacks: ``torch.utils.checkpoint`` wraps a function, and ``torch.fx.Interpreter``
runs a whole graph; nothing runs chosen node ranges of an fx graph under checkpoints.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.fx.node import map_arg
from torch.utils.checkpoint import checkpoint

__all__ = ["run_checkpointed"]


def run_checkpointed(
    ex: Any, env: dict[torch.fx.Node, Any], microbatch: int = 0
) -> Any:
    """Run the graph of `ex` (a `runtime.executor.PlanExecutor`, which imports this module)
    with every layer's nodes under a non-reentrant activation checkpoint (module docstring).
    With FSDP parameters, a segment re-run in backward reads the backward's gathered copies
    of micro-batch `microbatch` (`runtime.fsdp.FsdpParams.recomputing`)."""
    layer_of = ex.recompute_layers or {}
    segments: list[list[torch.fx.Node]] = []
    for n in ex.opgraph.gm.graph.nodes:
        if n.op in ("placeholder", "output") or n in env:  # pre-filled samples: inputs
            continue
        key = layer_of.get(n.name)
        last = segments[-1][-1] if segments else None
        if last is not None and key is not None and layer_of.get(last.name) == key:
            segments[-1].append(n)
        else:
            segments.append([n])
    out_node = next(n for n in ex.opgraph.gm.graph.nodes if n.op == "output")
    # free every value after the last segment reading it (the graph's outputs stay), as
    # torch.fx.Interpreter.run does: else what runs outside the checkpoints (the logits,
    # say) would stay alive through the backward
    free_after = _last_reads(segments, set(out_node.all_input_nodes))
    ex.env = env
    for i, seg in enumerate(segments):
        inside = set(seg)
        ext = list(
            dict.fromkeys(u for n in seg for u in n.all_input_nodes if u not in inside)
        )
        leaving = [n for n in seg if any(w not in inside for w in n.users)]

        def run_segment(
            *values: Any,
            seg: list[torch.fx.Node] = seg,
            ext: list[torch.fx.Node] = ext,
            leaving: list[torch.fx.Node] = leaving,
        ) -> tuple[Any, ...]:
            outer, ex.env = ex.env, dict(zip(ext, values))
            fsdp = ex.fsdp
            # outside the forward: checkpoint re-runs the segment in backward
            again = fsdp is not None and not fsdp.in_forward
            try:
                free = _last_reads([[n] for n in seg], set(leaving))
                with fsdp.recomputing(microbatch) if again else nullcontext():
                    for k, n in enumerate(seg):
                        ex.env[n] = ex.run_node(n)
                        for u in free.get(k, ()):
                            del ex.env[u]
                return tuple(ex.env[n] for n in leaving)
            finally:
                ex.env = outer

        values = [env[u] for u in ext]
        if len(seg) == 1 and seg[0].name not in layer_of:
            outs = run_segment(*values)
        else:
            outs = checkpoint(run_segment, *values, use_reentrant=False)
        env.update(zip(leaving, outs))
        for u in free_after.get(i, ()):
            env.pop(u, None)
    ex.env = {}
    return map_arg(out_node.args[0], lambda a: env[a])


def _last_reads(
    steps: list[list[torch.fx.Node]], keep: set[torch.fx.Node]
) -> dict[int, list[torch.fx.Node]]:
    """Per step (a list of nodes run together), the values not in `keep` that no later step
    reads: the inputs its nodes read for the last time and the nodes it produces that no later
    step reads."""
    last: dict[torch.fx.Node, int] = {}
    for i, step in enumerate(steps):
        for n in step:
            last[n] = i
            for u in n.all_input_nodes:
                last[u] = i
    out: dict[int, list[torch.fx.Node]] = {}
    for u, i in last.items():
        if u not in keep:
            out.setdefault(i, []).append(u)
    return out
