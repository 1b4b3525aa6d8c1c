"""The `meshplan` command line.

Commands are found, not listed: each is a module named in the `meshplan.commands` entry-point group
of pyproject.toml (so the CLI names no layer above the runtime: `bench` lives in `benchmarks`). Each
command module exposes `register(subparsers)`, which adds a parser whose `func(args) -> int` runs the
command. Entry points are registered by installing the package (`pip install -e .`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib.metadata import EntryPoint, entry_points

from cost_models.errors import MeshplanError
from runtime.launch import LaunchError
from runtime.torchrun import record_error

GROUP = "meshplan.commands"
#: The order of `meshplan --help`, by entry-point name; commands not named here come after, by name.
ORDER = ("trace", "cluster", "plan", "profile", "run", "bench")


def command_modules() -> list[EntryPoint]:
    """The command modules of the `meshplan.commands` entry-point group, in `ORDER`."""
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    rank = {name: i for i, name in enumerate(ORDER)}
    return [found[n] for n in sorted(found, key=lambda n: (rank.get(n, len(ORDER)), n))]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshplan",
        description="Plan and run data, tensor and pipeline parallel training of PyTorch models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for ep in command_modules():
        try:
            module = ep.load()
        except ModuleNotFoundError as exc:
            if (
                exc.name == ep.module
            ):  # declared by an older install, gone from this checkout
                continue
            raise
        module.register(sub)
    return parser


def run_child(argv: list[str], what: str) -> subprocess.CompletedProcess[str]:
    """Run ``meshplan ARGV`` in a child process and return it (stdout and stderr captured). The
    runtime plans this way, as data through a plan file, instead of importing the planner's
    search. A child that fails raises MeshplanError: "<what> failed (exit N): <its last error
    line>"."""
    return run_children([argv], [what])


def run_children(
    argvs: list[list[str]], whats: list[str]
) -> subprocess.CompletedProcess[str]:
    """Run ``meshplan ARGV`` for each of `argvs`, in turn, in one child process (each child
    spends seconds importing torch and the planner), stopping at the first that fails; the
    child is returned (stdout and stderr captured, each holding every command's in turn). A
    command that fails raises MeshplanError: "<its what> failed (exit N): <its last error
    line>"."""
    cmd = [sys.executable, "-m", "runtime.cli", _EACH, json.dumps(argvs)]
    child = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if child.returncode != 0:
        lines = [line for line in child.stderr.splitlines() if line.strip()]
        started = [ln for ln in lines if ln.startswith(_STARTING)]
        i = int(started[-1].removeprefix(_STARTING)) if started else 0
        last = lines[-1].removeprefix("meshplan: error: ") if lines else "no message"
        raise MeshplanError(f"{whats[i]} failed (exit {child.returncode}): {last}")
    child.stderr = "".join(
        line for line in child.stderr.splitlines(True) if not line.startswith(_STARTING)
    )
    return child


#: `run_children`'s child: ``python -m runtime.cli --each JSON`` runs each argv of the JSON list
_EACH = "--each"
#: the line (to stderr) that opens each command of a `run_children` child, with its index
_STARTING = "meshplan: starting command "


def _main_each(argvs: list[list[str]]) -> int:
    for i, argv in enumerate(argvs):
        print(f"{_STARTING}{i}", file=sys.stderr, flush=True)
        code = main(argv)
        if code:
            return code
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (default: this program's arguments) and return its exit code; as
    this program (`argv` None), a command that sets ``exit_fast`` ends the process when it
    succeeds (`_exit_fast`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
        if argv is None and code == 0 and getattr(args, "exit_fast", False):
            _exit_fast()
    except MeshplanError as exc:
        print(f"meshplan: error: {exc}", file=sys.stderr)
        record_error(f"meshplan: error: {exc}")  # for torchrun's failure table
        # where each rank of a timed-out launch hung, or where the blamed rank crashed
        if isinstance(exc, LaunchError):
            for rank in exc.stacks:
                stack = exc.tracebacks[rank]
                print(f"--- rank {rank} ---\n{stack.rstrip()}", file=sys.stderr)
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


def _exit_fast() -> None:
    """End the process now, its output flushed, without the interpreter's teardown: a plan's
    search leaves millions of small objects (traced graphs, prices, layer profiles, in the
    planner's caches) that it would free one by one, 1.1 s of a 25.6 s `meshplan plan` of
    gpt-39b on 8x8 V100s, where nothing is left to do (its worker processes have ended, their
    queues are drained, the plan file is closed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1:2] == [_EACH]:
        sys.exit(_main_each(json.loads(sys.argv[2])))
    sys.exit(main())
