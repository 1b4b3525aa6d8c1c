"""The one exception type meshplan raises for bad input.

It lives in the leaf package so that every layer (cost_models, planner, runtime) can raise it;
the CLI turns it into a single line on stderr and a non-zero exit.
"""


class MeshplanError(Exception):
    """A user-facing error: the message names what is wrong and what would be accepted."""


class DoesNotFitError(MeshplanError):
    """No plan of the model fits the devices' memory (a result, not bad input: a benchmark records
    it and goes on)."""
