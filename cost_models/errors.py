"""The one exception type meshplan raises for bad input.

It lives in the leaf package so that every layer (cost_models, planner, runtime) can raise it;
the CLI turns it into a single line on stderr and a non-zero exit.
"""


class MeshplanError(Exception):
    """A user-facing error: the message names what is wrong and what would be accepted."""


class DoesNotFitError(MeshplanError):
    """No plan of the model fits the devices' memory (a result, not bad input: a benchmark records
    it and goes on)."""


def gib(need: float, have: float) -> tuple[str, str]:
    """Two byte counts in GiB for a "needs X, Y available" message, with as many decimals (1 to 6)
    as it takes for unequal counts not to print as equal numbers."""
    for digits in range(1, 7):
        a, b = f"{need / 2**30:.{digits}f}", f"{have / 2**30:.{digits}f}"
        if a != b or need == have:
            break
    return f"{a} GiB", f"{b} GiB"
