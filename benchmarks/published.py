"""Published measured training runs priced by meshplan, predicted against measured, fit kept apart.

``python -m benchmarks.published`` prices, with ``planner.plans.manual.manual_plan`` (what
``meshplan manual`` runs), every row of two references:

* ``published-measurements.md``: Korthikanti et al. 2022 (arXiv 2205.05198), GPT on DGX
  A100-80GB hosts; each row at its exact tp, pp, micro-batch, global batch and interleaving,
  dp = 1, Megatron's block split (``split="blocks"``), per-block recomputation, fp16, Adam;
* ``alpa-osdi22-suite.md``: Megatron-LM's best GPT configurations of Alpa's artifact on AWS
  p3.16xlarge (V100) hosts. The reference gives measured TFLOP/s per GPU; seconds per iteration
  are ``F / (TFLOP/s * 1e12 * GPUs)`` with ``F`` the suite's own FLOP count
  (``benchmarks.megatron_gpt.alpa_gpt_flops``, Alpa's ``compute_gpt_tflops`` with recomputation:
  ``96 G s L h^2 (1 + s/(6h)) + 6 G s h V``), the count the TFLOP/s were computed with.

Every row is priced for the computation it ran: the GPT with explicit attention (scores, masked
softmax, attention dropout, product with v) and ``attn_dropout=0.1``, Megatron-LM's default
``--attention-dropout`` in these runs; ``attn=explicit`` (batched products folded heads first)
for the tensor-parallel runs, ``attn=explicit-batch`` (batch first) for the one data-parallel run,
so that each device's products are the ones Megatron-LM ran (`planner.models.gpt.explicit_attention`;
with the other fold that run's plan reshards around every attention and is priced 12% slower).

The fit (one parameter): the tensor-core ``E_max`` of A100-80GB
(``cost_models.compute.TENSOR_CORE_E_MAX``), the fraction of peak a large fp16 matrix product
sustains, fitted on the A100 rows. Every other constant stays the preset's (datasheet figures and
NCCL's latencies, `cost_models.cluster`). A matrix product's time is ``flops / (peak E_max eff(d))``,
so a row's iteration time is ``t(u) = a + b u`` in ``u = 1 / E_max`` wherever its products are
compute-bound; each row is priced at two values of ``E_max`` (``E_PROBES``), which gives ``a`` and
``b``. ``fit_u`` minimises the squared relative error ``sum_i ((a_i + b_i u) / m_i - 1)^2`` over
the rows it is given, in closed form. Leave-one-out: each row's prediction uses the ``u`` fitted
without it (``leave_one_out``). The V100 rows fit nothing (the V100 preset's committed suites stay
as they are): they are checked only. So are the selective-recomputation rows (selective
recomputation with sequence parallelism, ``MODES``), priced at the E_max the full rows fitted.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.megatron_gpt import alpa_gpt_flops
from benchmarks.reference import gpt_megatron_configs, measured_tflops, reference_dir
from cost_models import compute
from cost_models.errors import MeshplanError
from planner.models import get_config
from planner.plans.manual import manual_plan

RESULTS = Path(__file__).resolve().parent / "results"
PUBLISHED = reference_dir() / "published-measurements.md"
#: Megatron-LM's ``--attention-dropout`` default, used by the 2021-2022 runs priced here.
ATTN_DROPOUT = 0.1
#: manual_plan's arguments per recomputation mode of the published table: Megatron's per-block
#: recomputation, and selective recomputation (the attention cores) with sequence parallelism.
MODES: dict[str, dict[str, Any]] = {
    "full": {"recompute": True},
    "selective": {"recompute": "selective", "sequence_parallel": True},
}
#: The modes whose A100 rows fit E_max; the others are checked at the fitted value only.
FIT_MODES = ("full",)
#: The device whose tensor-core E_max the A100 rows fit, and the two E_max values each row is
#: priced at (``t = a + b / E_max`` through them).
FIT_DEVICE = "A100-80GB"
E_PROBES = (0.80, 0.70)


@dataclass(frozen=True)
class Row:
    """One published run: a Megatron configuration and its measured seconds per iteration."""

    source: str  # "korthikanti-full", "korthikanti-selective", "alpa-megatron"
    name: str
    model: str  # a gpt: spec string
    cluster: str
    dp: int
    tp: int
    pp: int
    global_batch: int
    num_microbatches: int
    virtual_stages: int
    measured_s: float
    mode: str = "full"

    @property
    def device(self) -> str:
        return self.cluster.split("x", 2)[2]


def _markdown_table(text: str, header_start: str) -> list[dict[str, str]]:
    """Rows of the first markdown table whose header row starts with ``| header_start``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"| {header_start}"):
            head = [c.strip() for c in line.strip().strip("|").split("|")]
            rows = []
            for body in lines[i + 2 :]:
                if not body.startswith("|"):
                    break
                rows.append(
                    dict(
                        zip(
                            head,
                            (c.strip() for c in body.strip().strip("|").split("|")),
                        )
                    )
                )
            return rows
    raise MeshplanError(f"no table starting with {header_start!r} in the reference")


def _gpt(
    hidden: int, layers: int, heads: int, seq: int, vocab: int, *, dp: int, tp: int
) -> str:
    """The GPT spec of a run: explicit attention folded heads first, or batch first when the
    run splits the batch and not the heads (`planner.models.gpt.explicit_attention`)."""
    if dp > 1 and tp > 1:
        raise MeshplanError(
            f"dp={dp} with tp={tp}: explicit attention carries one split through its fold"
        )
    attn = "explicit-batch" if dp > 1 else "explicit"
    return (
        f"gpt:hidden={hidden},layers={layers},heads={heads},seq={seq},vocab={vocab},"
        f"attn={attn},attn_dropout={ATTN_DROPOUT}"
    )


def _cluster(gpus: int, device: str) -> str:
    return f"1x{gpus}x{device}" if gpus <= 8 else f"{gpus // 8}x8x{device}"


def korthikanti_rows(path: Path = PUBLISHED) -> list[Row]:
    """The A100 rows of ``published-measurements.md``, both recomputation modes (seq 2048, vocab
    51200, dp 1, as its text says)."""
    out = []
    for r in _markdown_table(path.read_text(), "model"):
        gpus, G, mb = int(r["GPUs"]), int(r["global batch"]), int(r["micro-batch"])
        for mode, column in (
            ("full", "full recompute: s / iteration"),
            ("selective", "selective recompute + sequence parallel: s / iteration"),
        ):
            out.append(
                Row(
                    f"korthikanti-{mode}",
                    r["model"],
                    _gpt(
                        int(r["hidden"]),
                        int(r["layers"]),
                        int(r["heads"]),
                        2048,
                        51200,
                        dp=1,
                        tp=int(r["tp"]),
                    ),
                    _cluster(gpus, "A100-80GB"),
                    1,
                    int(r["tp"]),
                    int(r["pp"]),
                    G,
                    G // mb,
                    int(r["interleaving"]),
                    float(r[column]),
                    mode,
                )
            )
    return out


def alpa_rows() -> list[Row]:
    """Megatron-LM's best GPT configurations of Alpa's artifact, measured TFLOP/s converted to
    seconds per iteration with the suite's FLOP count (module docstring)."""
    measured = measured_tflops("## GPT", "Megatron-LM")
    out = []
    for r in gpt_megatron_configs():
        c = get_config(str(r["model"]))
        gpus, G = int(r["gpus"]), int(r["global_batch"])
        flops = alpa_gpt_flops(G, c.seq, c.layers, c.hidden, c.vocab, recompute=True)
        out.append(
            Row(
                "alpa-megatron",
                f"{r['model']} on {gpus}",
                _gpt(
                    c.hidden,
                    c.layers,
                    c.heads,
                    c.seq,
                    c.vocab,
                    dp=int(r["dp"]),
                    tp=int(r["tp"]),
                ),
                _cluster(gpus, "V100-16GB"),
                int(r["dp"]),
                int(r["tp"]),
                int(r["pp"]),
                G,
                int(r["microbatches"]),
                1,
                flops / (float(measured[gpus]) * 1e12 * gpus),
            )
        )
    return out


@contextlib.contextmanager
def tensor_core_e_max(device: str, value: float | None) -> Iterator[None]:
    """``compute.TENSOR_CORE_E_MAX[device]`` set to ``value`` (None: no entry) inside the block."""
    table = compute.TENSOR_CORE_E_MAX
    old = table.get(device)
    if value is None:
        table.pop(device, None)
    else:
        table[device] = value
    try:
        yield
    finally:
        if old is None:
            table.pop(device, None)
        else:
            table[device] = old


def price(row: Row) -> float:
    """Predicted seconds per iteration of ``row``: ``manual_plan`` at its configuration."""
    plan = manual_plan(
        row.model,
        row.cluster,
        dp=row.dp,
        tp=row.tp,
        pp=row.pp,
        num_microbatches=row.num_microbatches,
        global_batch=row.global_batch,
        virtual_stages=row.virtual_stages,
        split="blocks",
        allow_oom=True,
        **MODES[row.mode],
    )
    return float(plan.estimate.iteration_time_s)


def fit_u(points: Sequence[tuple[float, float, float]]) -> float:
    """``u = 1 / E_max`` minimising ``sum ((a + b u) / m - 1)^2`` over ``points`` = (a, b, m):
    ``u = sum (b/m)(1 - a/m) / sum (b/m)^2``."""
    num = sum((b / m) * (1.0 - a / m) for a, b, m in points)
    den = sum((b / m) ** 2 for a, b, m in points)
    if den <= 0:
        raise MeshplanError("no row depends on E_max: nothing to fit")
    return num / den


def leave_one_out(points: Sequence[tuple[float, float, float]]) -> list[float]:
    """For each point, ``fit_u`` of the others (the held-out point is not in its fit)."""
    if len(points) < 2:
        raise MeshplanError("leave-one-out needs at least two rows")
    return [
        fit_u([p for j, p in enumerate(points) if j != i]) for i in range(len(points))
    ]


def line(row: Row) -> tuple[float, float]:
    """(a, b) of ``t(u) = a + b u`` for ``row``, from its prices at the two ``E_PROBES``."""
    (e0, e1) = E_PROBES
    with tensor_core_e_max(row.device, e0):
        t0 = price(row)
    with tensor_core_e_max(row.device, e1):
        t1 = price(row)
    b = (t1 - t0) / (1 / e1 - 1 / e0)
    return t0 - b / e0, b


def run(out: Path = RESULTS / "published.json") -> dict[str, Any]:
    """Price every row, fit, write ``out``; returns the document."""
    start = time.perf_counter()
    rows = korthikanti_rows() + alpa_rows()
    fit_rows = [r for r in rows if r.mode in FIT_MODES and r.device == FIT_DEVICE]
    lines = [line(r) for r in fit_rows]
    points = [(a, b, r.measured_s) for (a, b), r in zip(lines, fit_rows)]
    u_all = fit_u(points)
    u_loo = leave_one_out(points)
    records = []
    for r, (a, b), u in zip(fit_rows, lines, u_loo):
        with tensor_core_e_max(r.device, 1 / u_all):
            exact = price(r)
        records.append(
            asdict(r)
            | {
                "line_a_s": a,
                "line_b_s": b,
                "fitted_on_it": True,
                "loo_e_max": 1 / u,
                "predicted_s": a + b * u,
                "fit_all_predicted_s": a + b * u_all,
                "fit_all_priced_s": exact,
            }
        )
    for r in rows:
        if r in fit_rows:
            continue
        rec = asdict(r) | {"fitted_on_it": False}
        if r.mode in MODES:
            rec["predicted_s"] = price(r)
        else:
            rec["predicted_s"] = None
            rec["note"] = "not priced yet: manual_plan has no selective recomputation"
        records.append(rec)
    for rec in records:
        p = rec["predicted_s"]
        rec["error"] = None if p is None else p / rec["measured_s"] - 1.0
    doc = {
        "benchmark": "published",
        "date": time.strftime("%Y-%m-%d"),
        "fit": {
            "parameter": f"tensor-core E_max of {FIT_DEVICE}",
            "rows": [r.name for r in fit_rows],
            "e_max": 1 / u_all,
            "e_probes": list(E_PROBES),
        },
        "attn_dropout": ATTN_DROPOUT,
        "rows": records,
        "summary": summary(records),
        "total_time_s": time.perf_counter() - start,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean and worst |predicted / measured - 1| of the priced rows: per source, in all, and over
    the full-recomputation rows (those of issue 22's target: the fitted rows and Alpa's)."""
    out: dict[str, Any] = {}
    groups: dict[str, list[float]] = {}
    for rec in records:
        if rec["error"] is not None:
            groups.setdefault(rec["source"], []).append(abs(rec["error"]))
            groups.setdefault("all", []).append(abs(rec["error"]))
            if rec["mode"] in FIT_MODES:  # the rows of issue 22's target
                groups.setdefault("full recomputation", []).append(abs(rec["error"]))
    for key, errs in groups.items():
        out[key] = {
            "rows": len(errs),
            "mean_abs_error": sum(errs) / len(errs),
            "max_abs_error": max(errs),
        }
    return out


def table(doc: dict[str, Any]) -> list[str]:
    """Markdown lines: the fit and every row, predicted against measured."""
    fit = doc["fit"]
    out = [
        "## Published measured runs, predicted against measured",
        "",
        (
            f"File `published.json` (`python -m benchmarks.published`), {doc['date']}. Each row priced "
            "by `manual_plan` at its exact configuration with the GPT written out as these runs "
            f"computed attention (`attn=explicit`, or `explicit-batch` for the data-parallel run; attention dropout {doc['attn_dropout']}). Fit: "
            f"{fit['parameter']} = {fit['e_max']:.4f} on {', '.join(fit['rows'])}; a row used in "
            "the fit is predicted leave-one-out (E_max fitted without it). Alpa rows: seconds = the "
            "suite's FLOP count / (measured TFLOP/s x GPUs); not used in the fit."
        ),
        "",
        "| source | run | cluster | tp | pp | micro-batches | interleaving | measured s | predicted s | error | E_max used |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        pred = (
            "not priced yet" if r["predicted_s"] is None else f"{r['predicted_s']:.2f}"
        )
        err = "" if r["error"] is None else f"{r['error']:+.1%}"
        e = f"{r['loo_e_max']:.3f} (LOO)" if r.get("fitted_on_it") else "preset"
        out.append(
            f"| {r['source']} | {r['name']} | {r['cluster']} | {r['tp']} | {r['pp']} | "
            f"{r['num_microbatches']} | {r['virtual_stages']} | {r['measured_s']:.2f} | {pred} | "
            f"{err} | {e} |"
        )
    out.append("")
    for key, s in doc["summary"].items():
        out.append(
            f"- {key}: {s['rows']} rows, mean |predicted/measured - 1| "
            f"{s['mean_abs_error']:.1%}, worst {s['max_abs_error']:.1%}"
        )
    return out


def figure(doc: dict[str, Any], path: Path) -> bool:
    """Predicted against measured seconds (log-log, the diagonal and +-15%); False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    priced = [r for r in doc["rows"] if r["predicted_s"] is not None]
    for source, marker in (
        ("korthikanti-full", "o"),
        ("korthikanti-selective", "^"),
        ("alpa-megatron", "s"),
    ):
        pts = [r for r in priced if r["source"] == source]
        ax.plot(
            [r["measured_s"] for r in pts],
            [r["predicted_s"] for r in pts],
            marker,
            label=source,
        )
    lo = min(r["measured_s"] for r in priced) / 1.5
    hi = max(r["measured_s"] for r in priced) * 1.5
    for f, style in ((1.0, "-"), (1.15, ":"), (0.85, ":")):
        ax.plot([lo, hi], [lo * f, hi * f], "k" + style, lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured s / iteration")
    ax.set_ylabel("predicted s / iteration")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def section(directory: Path) -> list[str]:
    """REPORT.md's lines for ``published.json`` in ``directory`` ([] without one)."""
    path = directory / "published.json"
    if not path.exists():
        return []
    doc = json.loads(path.read_text())
    out = table(doc)
    if figure(doc, directory / "published.png"):
        out += ["", "![published runs: predicted against measured](published.png)"]
    return out + [""]


def main(argv: Sequence[str] = ()) -> None:
    doc = run()
    print("\n".join(table(doc)))
    print(f"{doc['total_time_s']:.0f} s", file=sys.stderr)


__all__ = [
    "Row",
    "alpa_rows",
    "fit_u",
    "korthikanti_rows",
    "leave_one_out",
    "line",
    "price",
    "run",
    "section",
    "table",
]

if __name__ == "__main__":
    main(sys.argv[1:])
