"""The `meshplan` command line.

The entry point lives in `runtime` because imports flow runtime -> planner -> cost_models: the
planner's commands (trace, cluster, ...) are collected from `planner.commands`, and the commands that
need processes or devices (profile, run) from `runtime.commands`. Each command module exposes
`register(subparsers)`, which adds a parser whose `func(args) -> int` runs the command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from cost_models.errors import MeshplanError

# Order here is the order in `meshplan --help`.
COMMAND_MODULES = [
    "planner.commands.trace",
    "planner.commands.cluster",
    "planner.commands.plan",
    "runtime.commands.profile",
    "runtime.commands.run",
    "runtime.commands.bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshplan",
        description="Plan and run data, tensor and pipeline parallel training of PyTorch models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # command not built in this checkout
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except MeshplanError as exc:
        print(f"meshplan: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshplan: interrupted", file=sys.stderr)
        return 130
    except (
        BrokenPipeError
    ):  # output piped into e.g. `head`, which closed early: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
