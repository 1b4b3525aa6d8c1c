"""Facts of ../shared/reference/alpa-osdi22-suite.md (model sizes, Megatron's best configurations,
measured TFLOP/s), read from the file rather than copied, so benchmarks and tests use the reference."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from cost_models.errors import MeshplanError


def reference_dir() -> Path:
    """``shared/reference`` beside the checkout (``/work/main`` -> ``/work/shared``), or beside its
    parent for a worktree one level deeper (``/work/wt/NAME`` -> ``/work/shared``)."""
    here = Path(__file__).resolve()
    candidates = [here.parents[i] / "shared" / "reference" for i in (2, 3)]
    return next((c for c in candidates if c.is_dir()), candidates[0])


REFERENCE = reference_dir() / "alpa-osdi22-suite.md"


@cache
def _text() -> str:
    try:
        return REFERENCE.read_text()
    except OSError as exc:
        raise MeshplanError(
            f"cannot read the reference suite {REFERENCE}: {exc.strerror} (the benchmarks "
            "read ../shared/reference beside the checkout)"
        ) from None


@cache
def _tables() -> dict[str, list[list[str]]]:
    """Markdown tables keyed by the nearest heading or paragraph line above them."""
    lines = _text().splitlines()
    out: dict[str, list[list[str]]] = {}
    title, rows = "", []
    for line in lines + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
            continue
        if rows:
            out[title] = rows
            rows = []
        if line.strip():
            title = line.strip().lstrip("#").strip()
    return out


def table(prefix: str) -> list[dict[str, str]]:
    """Rows (as header -> cell) of the first table whose title starts with `prefix`."""
    for title, rows in _tables().items():
        if title.startswith(prefix):
            return [dict(zip(rows[0], r)) for r in rows[1:]]
    raise MeshplanError(f"no table titled {prefix!r} in {REFERENCE}")


def scaling(prefix: str) -> dict[int, str]:
    """The 'GPUs -> model' line following a heading, e.g. {1: '350M', 2: '760M', ...}."""
    text = _text()
    section = text[text.index(prefix) :]
    line = next(x for x in section.splitlines() if "->" in x)
    return {int(g): m for g, m in re.findall(r"(\d+)->([\w.]*\w)", line)}


def gpt_megatron_configs() -> list[dict[str, int | str]]:
    """Megatron-LM's best GPT configurations: gpus, model, global batch, dp, tp, pp, micro-batches."""
    rows = table("Best Megatron-LM configurations")
    return [
        {
            "gpus": int(r["GPUs"]),
            "model": "gpt-" + r["model"].lower(),
            "global_batch": int(r["global batch"]),
            "dp": int(r["dp"]),
            "tp": int(r["tp"]),
            "pp": int(r["pp"]),
            "microbatches": int(r["micro-batches"]),
        }
        for r in rows
    ]


def measured_tflops(title_prefix: str, system: str) -> dict[int, float | None]:
    """Measured TFLOP/s per GPU of `system` from the 'Measured TFLOP/s per GPU' table after a heading."""
    text = _text()
    start = text.index("Measured TFLOP/s per GPU", text.index(title_prefix))
    rows = [line for line in text[start:].splitlines()[1:] if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(header):
            break  # the table ended
        if cells[0] == system:
            return {
                int(g): (float(v) if re.fullmatch(r"[\d.]+", v) else None)
                for g, v in zip(header[1:], cells[1:])
            }
    raise MeshplanError(f"no row {system!r} after {title_prefix!r} in {REFERENCE}")
