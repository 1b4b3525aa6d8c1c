"""`meshplan cluster SPEC`: show what a cluster spec means (devices, peaks, memory, links)."""

from __future__ import annotations

import argparse
import json
import sys

from cost_models.cluster import DEVICE_NAMES, DTYPES, Cluster
from planner.commands.fmt import nbytes, si, table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster",
        help="show what a cluster spec means",
        description=(
            "Describe the cluster HOSTSxDEVICESxDEVICE (devices: "
            + ", ".join(DEVICE_NAMES)
            + "): device count, peak FLOP/s per dtype, memory, memory bandwidth and links."
        ),
    )
    p.add_argument("spec", help="HOSTSxDEVICESxDEVICE, e.g. 8x8xV100-16GB or 1x4xCPU")
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="measured profile (from `meshplan profile`); required for CPU",
    )
    p.add_argument(
        "--json", metavar="FILE", help="write the cluster description as JSON"
    )
    p.set_defaults(func=run)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def describe(cluster: Cluster) -> str:
    """A readable, multi-line description of ``cluster``."""
    d = cluster.device
    head = (
        f"cluster {cluster.spec}: {_plural(cluster.num_devices, 'device')} = "
        f"{_plural(cluster.hosts, 'host')} x {cluster.devices_per_host} per host"
    )
    dev = (
        f"device {d.name}: memory {nbytes(d.memory_bytes)}, "
        f"memory bandwidth {si(d.memory_bandwidth_bytes_per_s, 'B/s')}"
    )
    lines = [head, dev, ""]
    dtypes = [*DTYPES, *(k for k in d.peak_flops if k not in DTYPES)]
    rows = [[dt, si(d.peak(dt), "FLOP/s")] for dt in dtypes]
    lines += [table(rows, ["dtype", "peak"]), ""]
    links = [
        ["inside a host", cluster.intra_host_link],
        ["between hosts", cluster.inter_host_link],
    ]
    rows = [
        [name, si(link.bandwidth_bytes_per_s, "B/s"), f"{link.latency_s * 1e6:.3g} us"]
        for name, link in links
    ]
    lines.append(table(rows, ["link", "bandwidth per device", "latency per step"]))
    if cluster.profile is not None:
        p = cluster.profile
        fits = sorted({f"{f.op}@{f.world_size}" for f in p.collectives})
        lines.append("")
        lines.append(
            f"measured profile: {p.device_name} ({p.backend}), {len(p.matmul)} matmul samples, "
            f"collective fits: {', '.join(fits) or 'none'}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    profile = None
    if args.profile:
        from cost_models.profile import load_profile

        profile = load_profile(args.profile)
    cluster = Cluster.from_spec(args.spec, profile=profile)
    print(describe(cluster))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(cluster.to_json(), f, indent=1)
            f.write("\n")
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0
