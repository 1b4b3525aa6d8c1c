"""`meshplan trace MODEL`: trace a model into the op graph and summarise it."""

from __future__ import annotations

import argparse
import json
import sys
import time

from planner.commands.fmt import nbytes, si, table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="trace a model into the op graph and summarise it",
        description="Trace MODEL on fake tensors (no weights are allocated) and summarise its op graph.",
    )
    p.add_argument(
        "model",
        help="built-in name (e.g. gpt-1.3b), spec (gpt:hidden=..,layers=..,heads=..) or pkg.module:factory",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="batch size of the example batch (default: the model's)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="write params, flops_per_iteration and nodes as JSON",
    )
    p.add_argument(
        "--top",
        type=int,
        default=8,
        help="how many of the heaviest ops to list (default 8)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.models import build_model
    from planner.tracing.tracer import trace

    if args.batch is not None and args.batch < 1:
        from cost_models.errors import MeshplanError

        raise MeshplanError(f"--batch must be a positive integer, got {args.batch}")
    t0 = time.perf_counter()
    model, batch = build_model(args.model, batch=args.batch, device="meta")
    graph = trace(model, batch, model_name=args.model)
    elapsed = time.perf_counter() - t0
    print(
        f"model {args.model}: batch {batch[0].shape[0] if batch[0].dim() else 1}, traced in {elapsed:.1f} s"
    )
    print(f"  parameters            {graph.num_params:,} ({nbytes(graph.param_bytes)})")
    print(
        f"  FLOPs per iteration   {si(graph.flops_per_iteration, 'FLOP')} (forward {si(graph.fwd_flops, 'FLOP')}, backward {si(graph.bwd_flops, 'FLOP')})"
    )
    print(f"  saved activations     {nbytes(graph.saved_activation_bytes())}")
    print(
        f"  ops                   {len(graph.ops)}: "
        + ", ".join(f"{k} {v}" for k, v in graph.kinds().most_common())
    )
    heavy = sorted(graph.ops, key=lambda n: -(n.fwd_flops + n.bwd_flops))[: args.top]
    rows = [
        [
            n.name,
            n.target,
            n.module_path,
            "x".join(map(str, n.outputs[0].shape)) if n.outputs else "",
            si(n.fwd_flops + n.bwd_flops, "FLOP"),
        ]
        for n in heavy
    ]
    print("\nheaviest ops (forward + backward):")
    print(table(rows, ["node", "op", "module", "output", "FLOPs"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(graph.to_json(), f)
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0
