"""`meshplan bench`: Alpa's weak-scaling suites, automatic plans against the best manual configuration.

meshplan bench --suite gpt                          # 1..64 V100s; writes benchmarks/results/gpt-V100-16GB.json
meshplan bench --suite moe --gpus 1 2 4 --json moe.json
meshplan bench --suite moe --gpus 16 --device H100-80GB   # re-run one case into the default file
meshplan bench --suite wresnet --device A100-80GB
meshplan bench --suite llama                        # Llama 3 / Mixtral on H100s vs torchtitan/Megatron-Core
meshplan bench --report                             # regenerate benchmarks/results/REPORT.md only
meshplan bench --suite local [--gpus 2 4] [--json FILE]   # measured on this machine's processes

The GPT, MoE and Wide-ResNet suites are predicted by the cost models (no device is used); see
`benchmarks.suites`. The local suite profiles this machine, plans small models for 2 to 8 local
processes and executes the plans, predicted against measured; see `benchmarks.local_suite`
(`--gpus` is then the process counts; `--device` does not apply).

The CLI finds this module through the `bench` entry point of the `meshplan.commands` group
(pyproject.toml; see `runtime.cli`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the `bench` command."""
    from benchmarks.suites import DEVICES, SUITES

    p = subparsers.add_parser(
        "bench",
        help="benchmark suites: automatic plans vs the best manual Megatron configuration",
        description=(
            "Run one of Alpa's weak-scaling suites (GPT, MoE, Wide-ResNet; 1 to 64 GPUs) or the "
            "llama suite (Llama 3 8B to 405B and Mixtral 8x7B on 8 to 512 H100s): plan each "
            "case automatically, search a grid of manual configurations (Megatron-LM's of 2021, "
            "or torchtitan's and Megatron-Core's space for llama) priced by the same cost "
            "models, print a table, write the results as JSON and regenerate the markdown report. "
            "Progress goes to stderr."
        ),
    )
    p.add_argument(
        "--suite",
        choices=(*SUITES, "local"),
        help="which suite to run (local: measured on this machine's processes)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        nargs="+",
        help="GPU counts to run, or process counts for the local suite (default: all cases); "
        "for a predicted suite, written into an existing results file, these cases replace its "
        "cases of the same counts",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        help="device of the clusters (8 per host; default V100-16GB, as measured; H100-80GB "
        "for the llama suite)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="results file (default benchmarks/results/SUITE-DEVICE.json)",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="regenerate benchmarks/results/REPORT.md from the results files "
        "(done after every full run to the default file)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the suite and/or the report; 0 on success."""
    from benchmarks.records import RESULTS, merge_results, write_results
    from benchmarks.report import write_report
    from benchmarks.suites import HEADER, format_row, run_suite, suite_cases
    from cost_models.errors import MeshplanError

    if not args.suite and not args.report:
        raise MeshplanError("give --suite SUITE, or --report")
    if args.suite == "local":
        return _run_local(args)
    if args.device is None:
        args.device = "H100-80GB" if args.suite == "llama" else "V100-16GB"
    if args.suite:
        try:
            suite_cases(args.suite, args.gpus, args.device)  # refuse bad input first
        except ValueError as exc:
            raise MeshplanError(str(exc)) from None
        print(HEADER, flush=True)
        try:
            results = run_suite(
                args.suite,
                args.gpus,
                args.device,
                say=lambda msg: print(msg, file=sys.stderr, flush=True),
                on_case=lambda case: print(format_row(case), flush=True),
            )
        except ValueError as exc:
            raise MeshplanError(str(exc)) from None
        path = Path(args.json or RESULTS / f"{args.suite}-{args.device}.json")
        done = f"{len(results['cases'])} cases in {results['total_time_s']:.0f} s"
        # a re-run of some cases into an existing file keeps the file's other cases
        if args.gpus and path.exists():
            order = [
                (c.model, c.num_devices)
                for c in suite_cases(args.suite, None, args.device)
            ]
            results = merge_results(json.loads(path.read_text()), results, order)
            done += ", merged with the file's other cases"
        write_results(results, path)
        print(f"{done}; wrote {path}")
        if args.json is None:
            args.report = True
    if args.report:
        print(f"wrote {write_report()}")
    return 0


def _run_local(args: argparse.Namespace) -> int:
    """The local measured suite (`benchmarks.local_suite`)."""
    from benchmarks import local_suite as ls
    from benchmarks.records import RESULTS, merge_results, write_results
    from benchmarks.report import write_report
    from cost_models.errors import MeshplanError

    try:
        cases = ls.local_cases(args.gpus)
    except ValueError as exc:
        raise MeshplanError(str(exc)) from None
    print(ls.HEADER, flush=True)
    results = ls.run_local_suite(
        cases=cases,
        say=lambda msg: print(msg, file=sys.stderr, flush=True),
        on_case=lambda case: print(ls.format_row(case), flush=True),
    )
    path = Path(args.json or RESULTS / f"local-{ls.DEVICE}.json")
    # as for the predicted suites, a re-run of some process counts keeps the file's other cases
    if args.gpus and path.exists():
        results = merge_results(json.loads(path.read_text()), results)
        results["summary"] = ls.summary(results["cases"])
    write_results(results, path)
    s = results["summary"]
    print(
        f"{s['cases']} cases in {results['total_time_s']:.0f} s; median |error| "
        f"{s['median_abs_error']:.0%}, faster plan agrees in {s['agree']} of {s['cases']}; "
        f"wrote {path}"
    )
    if args.json is None or args.report:
        print(f"wrote {write_report()}")
    return 0
