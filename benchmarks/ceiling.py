"""The fastest any plan of a case could be under the cost models, and so the largest ratio any plan
could reach against the best manual configuration.

Bound. Let T1 be the predicted iteration time of the whole model on ONE device of the cluster's
kind, at the whole global batch in one micro-batch, without recomputation and ignoring memory
(`manual_plan(dp=tp=pp=1, num_microbatches=1, allow_oom=True)` on a 1x1 cluster). Then every plan
of the case on N devices is predicted to take at least

    T_min = T1 / N.

This is `planner.size_bound`'s bound T_min(b) at b = the global batch. Its module docstring
derives it op by op for the datasheet cost models, for the plans of micro-batch size b: their
pieces of an op add up to at least the op's FLOPs, bytes and kernel launches, at shapes no
larger than the op's at b rows, and communication, pipeline bubbles and waiting only add time.
No piece of a plan of any size is larger than the op at the whole batch, so the same argument
bounds every plan of the case by T_min. TFLOP/s per device is at most the model's FLOPs /
(N * T_min), T1's own TFLOP/s.

So ``max_ratio = best manual time / T_min`` bounds the ratio of every automatic plan; where it is
below a target, no planner pricing with these cost models can reach the target on that case. The
bound is loose (it grants every piece the efficiency of the whole batch's GEMMs and no
communication), which only makes such a conclusion safer. With a measured profile attached to the
cluster, GEMM rates are interpolated from samples and need not grow with the shape, so the bound is
not claimed there (`ceiling` refuses such a cluster).

    python -m benchmarks.ceiling FILE.json [...]   # add the bound to existing results files
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.records import write_results
from cost_models.cluster import Cluster
from cost_models.errors import MeshplanError
from planner.plans.manual import manual_plan


def ceiling(
    model: str,
    cluster: Cluster | str,
    global_batch: int,
    *,
    dtype: str = "float16",
    optimizer: str = "adam_mixed",
    manual_time_s: float | None = None,
) -> dict[str, Any]:
    """`iteration_time_s` = T_min, the least iteration time any plan of `model` on `cluster` can
    be predicted to take (module docstring), the `tflops_per_device` that time would give, and
    `max_ratio` = `manual_time_s` / T_min (None without a manual time)."""
    cluster = Cluster.from_spec(cluster) if isinstance(cluster, str) else cluster
    if cluster.profile is not None:
        raise MeshplanError(
            f"the iteration-time bound holds for datasheet pricing only; {cluster.spec} carries "
            "a measured profile (pass the cluster without one)"
        )
    one = manual_plan(
        model,
        cluster.with_shape(1, 1),
        dp=1,
        tp=1,
        pp=1,
        num_microbatches=1,
        global_batch=global_batch,
        recompute=False,
        dtype=dtype,
        optimizer=optimizer,
        allow_oom=True,
    )
    t_min = one.estimate.iteration_time_s / cluster.num_devices
    return {
        "iteration_time_s": t_min,
        "tflops_per_device": one.estimate.tflops_per_device,
        "max_ratio": None if manual_time_s is None else manual_time_s / t_min,
    }


def case_ceiling(case: dict[str, Any]) -> dict[str, Any]:
    """`ceiling` of a suite's case record (`benchmarks.suites.run_case`)."""
    return ceiling(
        case["model"],
        case["cluster"],
        case["global_batch"],
        dtype=case["dtype"],
        optimizer=case["optimizer"],
        manual_time_s=case["manual_best"]["iteration_time_s"],
    )


def annotate(path: str | Path) -> Path:
    """Add `ceiling` to every case of a results file written before the suites recorded it."""
    doc = json.loads(Path(path).read_text())
    for case in doc["cases"]:
        case["ceiling"] = case_ceiling(case)
    return write_results(doc, path)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m benchmarks.ceiling RESULTS.json [...]")
    for name in sys.argv[1:]:
        print(annotate(name))
