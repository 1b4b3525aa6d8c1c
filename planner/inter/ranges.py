"""[k, j] tables over the layer ranges k..j of a stage (principle 4: a per-layer figure summed or
maximised over every range at once, from prefix sums and running maxima). Only the upper
triangle (j >= k) is meaningful."""

from __future__ import annotations

import numpy as np

__all__ = ["range_max", "range_sums"]


def range_sums(x: np.ndarray) -> np.ndarray:
    """[k, j] = sum of x[k..j]."""
    p = np.concatenate([[0.0], np.cumsum(x)])
    return p[None, 1:] - p[:-1, None]


def range_max(x: np.ndarray) -> np.ndarray:
    """[k, j] = max of x[k..j] (0 below the diagonal)."""
    L = len(x)
    out = np.zeros((L, L))
    for k in range(L):
        out[k, k:] = np.maximum.accumulate(x[k:])
    return out
