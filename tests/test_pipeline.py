"""Pipeline schedule latency and in-flight micro-batches against a discrete-event simulator."""

from __future__ import annotations

import random

import pytest

from cost_models import MeshplanError
from cost_models.memory import microbatches_in_flight
from cost_models.pipeline import pipeline_time
from runtime.schedules import interleaved_order, schedule_order

Task = tuple[str, int, int]  # ("F" or "B", stage/chunk, micro-batch)


def device_orders(schedule: str, p: int, b: int, v: int = 1) -> list[list[Task]]:
    """Per device, its tasks in the order the runtime runs them (`runtime.schedules`, Megatron-LM's
    rules), so that the prices are checked against the schedules that run."""
    if schedule == "interleaved":
        return [interleaved_order(d, p, v, b) for d in range(p)]
    return [[(k, d, m) for k, m in schedule_order(schedule, d, p, b)] for d in range(p)]


def simulate(
    schedule: str,
    stage_times: list[float],
    b: int,
    v: int = 1,
    send_times: list[float] | None = None,
) -> tuple[float, list[int]]:
    """Makespan, and per device the peak number of (micro-batch, stage) forwards done whose
    backward is not. F(i, m) takes t_i / 3 and needs F(i-1, m) plus s_{i-1} / 2; B(i, m) takes
    2 t_i / 3 and needs F(i, m) and B(i+1, m) plus s_i / 2; each device runs its tasks in order,
    each as soon as the device is free and its inputs have arrived."""
    n = len(stage_times)
    p = n // v
    s = send_times or [0.0] * (n - 1)
    orders = device_orders(schedule, p, b, v)
    end: dict[Task, float] = {}
    free = [0.0] * p
    nxt = [0] * p
    held = [0] * p
    peak = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d in range(p):
            while nxt[d] < len(orders[d]):
                kind, c, m = orders[d][nxt[d]]
                if kind == "F":
                    deps = [(("F", c - 1, m), s[c - 1] / 2)] if c > 0 else []
                    duration = stage_times[c] / 3
                else:
                    deps = [(("F", c, m), 0.0)]
                    if c < n - 1:
                        deps.append((("B", c + 1, m), s[c] / 2))
                    duration = 2 * stage_times[c] / 3
                if any(dep not in end for dep, _ in deps):
                    break
                start = max([free[d]] + [end[dep] + delay for dep, delay in deps])
                end[(kind, c, m)] = free[d] = start + duration
                held[d] += 1 if kind == "F" else -1
                peak[d] = max(peak[d], held[d])
                nxt[d] += 1
                remaining -= 1
                progressed = True
        assert progressed, "schedule deadlocked"
    return max(free), peak


def rel(a: float, b: float) -> float:
    return (a - b) / b


UNIFORM_CASES = [
    (1, 1),
    (1, 5),
    (2, 1),
    (2, 2),
    (3, 5),
    (4, 2),
    (4, 8),
    (5, 16),
    (8, 8),
]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uniform_stage_times_exact(schedule: str) -> None:
    for p, b in UNIFORM_CASES:
        t = [3.0] * p
        sim, _ = simulate(schedule, t, b)
        assert pipeline_time(t, b, schedule) == pytest.approx(sim, rel=1e-12)
        assert sim == pytest.approx((b + p - 1) * 3.0)


def test_interleaved_uniform_chunks_exact_megatron_bubble() -> None:
    for p, v, k in [
        (1, 2, 3),
        (2, 2, 1),
        (2, 3, 2),
        (3, 2, 2),
        (4, 2, 1),
        (4, 2, 3),
        (4, 4, 2),
    ]:
        b, tc = p * k, 0.75
        t = [tc] * (p * v)
        sim, _ = simulate("interleaved", t, b, v)
        got = pipeline_time(t, b, "interleaved", virtual_stages=v)
        assert got == pytest.approx(sim, rel=1e-12)
        # Megatron: (B + (p - 1) / v) iterations of the device's time v * tc
        assert got == pytest.approx((b + (p - 1) / v) * v * tc)
        # small sends (one way <= a chunk's forward) only add their fill and drain
        s = [2 * tc / 3] * (p * v - 1)
        sim, _ = simulate("interleaved", t, b, v, s)
        got = pipeline_time(t, b, "interleaved", virtual_stages=v, send_times=s)
        assert got == pytest.approx(sim, rel=1e-12)


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    t = [1.0, 2.0, 0.5]
    assert pipeline_time(t, 7, "interleaved") == pipeline_time(t, 7, "1f1b")


def test_gpipe_exact_for_any_stage_and_send_times() -> None:
    rng = random.Random(0)
    for _ in range(300):
        p, b = rng.randint(1, 6), rng.randint(1, 12)
        t = [rng.uniform(0.2, 2.0) for _ in range(p)]
        s = [rng.uniform(0.0, 1.5) for _ in range(p - 1)] if rng.random() < 0.5 else []
        sim, _ = simulate("gpipe", t, b, send_times=s)
        assert pipeline_time(t, b, "gpipe", send_times=s) == pytest.approx(
            sim, rel=1e-12
        )


def test_1f1b_is_an_upper_bound() -> None:
    rng = random.Random(1)
    worst = {"no sends": 0.0, "sends": 0.0}
    for trial in range(1200):
        p, b = rng.randint(1, 7), rng.randint(1, 16)
        t = [rng.uniform(0.2, 2.0) for _ in range(p)]
        case = "sends" if trial % 2 else "no sends"
        s = [rng.uniform(0.0, 1.5) for _ in range(p - 1)] if case == "sends" else []
        sim, _ = simulate("1f1b", t, b, send_times=s)
        got = pipeline_time(t, b, "1f1b", send_times=s)
        assert got >= sim * (1 - 1e-12)
        worst[case] = max(worst[case], rel(got, sim))
    print(f"1f1b formula above simulation by at most {worst}")
    assert max(worst.values()) < 0.25


def test_1f1b_uniform_sends_within_one_send() -> None:
    for p in range(2, 6):
        for b in range(1, 14):
            t, s = [3.0] * p, [0.5] * (p - 1)
            sim, _ = simulate("1f1b", t, b, send_times=s)
            # the strict 1F1B order exposes (S - 1) / S of a send per micro-batch
            assert sim == pytest.approx(
                3.0 * (b + p - 1) + 0.5 * (p - 1 + (b - 1) * (p - 1) // p)
            )
            got = pipeline_time(t, b, "1f1b", send_times=s)
            assert 0 <= got - sim < 0.5
            assert got >= pipeline_time(t, b, "gpipe", send_times=s)


@pytest.mark.parametrize("spread,low,high", [(0.1, 0.07, 0.09), (0.3, 0.17, 0.16)])
def test_interleaved_heterogeneous_within_tolerance(
    spread: float, low: float, high: float
) -> None:
    rng = random.Random(2)
    lo = hi = 0.0
    for _ in range(400):
        p, v, k = rng.randint(2, 6), rng.randint(2, 4), rng.randint(1, 6)
        t = [rng.uniform(1 - spread, 1 + spread) for _ in range(p * v)]
        sim, _ = simulate("interleaved", t, p * k, v)
        err = rel(pipeline_time(t, p * k, "interleaved", virtual_stages=v), sim)
        lo, hi = min(lo, err), max(hi, err)
    print(
        f"interleaved, chunk times 1 +- {spread}: formula vs simulation {lo:+.3f} .. {hi:+.3f}"
    )
    assert -low <= lo and hi <= high


def test_interleaved_large_sends_optimistic() -> None:
    p, v, b, tc = 2, 2, 6, 3.0
    s = [6.0] * (p * v - 1)
    sim, _ = simulate("interleaved", [tc] * (p * v), b, v, s)
    assert (
        pipeline_time([tc] * 4, b, "interleaved", virtual_stages=v, send_times=s) < sim
    )


def test_peak_inflight_matches_simulation() -> None:
    for p, b in UNIFORM_CASES:
        t = [1.0 + 0.1 * i for i in range(p)]
        for schedule in ("gpipe", "1f1b"):
            _, peak = simulate(schedule, t, b)
            assert [microbatches_in_flight(schedule, b, p, i) for i in range(p)] == peak
    for p, v, k in [
        (1, 3, 2),
        (2, 2, 1),
        (2, 2, 3),
        (3, 2, 2),
        (4, 2, 1),
        (4, 2, 2),
        (4, 3, 3),
    ]:
        _, peak = simulate("interleaved", [1.0] * (p * v), p * k, v)
        got = [
            microbatches_in_flight("interleaved", p * k, p, i, virtual_stages=v) * v
            for i in range(p)
        ]
        assert got == pytest.approx(peak)
    # Korthikanti et al. 2022: the first device holds p (1 + (p - 1) / (p v)) micro-batches
    assert microbatches_in_flight(
        "interleaved", 16, 4, 0, virtual_stages=2
    ) == pytest.approx(4 * (1 + 3 / 8))
    assert microbatches_in_flight(
        "Interleaved1F1B", 16, 4, 3, virtual_stages=1
    ) == microbatches_in_flight("1f1b", 16, 4, 3)


@pytest.mark.parametrize(
    "args,kwargs,needle",
    [
        (([1.0], 4, "dualpipe"), {}, "gpipe, 1f1b, interleaved, zero_bubble"),
        (([1.0], 0, "1f1b"), {}, ">= 1"),
        (([1.0, 1.0], 4, "interleaved"), {"virtual_stages": 0}, "virtual_stages"),
        (([1.0, 1.0], 4, "1f1b"), {"virtual_stages": 2}, "interleaved"),
        (([1.0] * 6, 4, "interleaved"), {"virtual_stages": 2}, "multiple of the 3"),
        (([1.0] * 5, 4, "interleaved"), {"virtual_stages": 2}, "chunk times"),
        (
            ([1.0, 2.0], 4, "gpipe"),
            {"send_times": [1.0, 1.0]},
            "one send time per link",
        ),
        (([1.0, -2.0], 4, "gpipe"), {}, ">= 0"),
        (([], 4, "gpipe"), {}, "at least one"),
    ],
)
def test_errors(args: tuple, kwargs: dict, needle: str) -> None:
    with pytest.raises(MeshplanError, match=needle) as info:
        pipeline_time(*args, **kwargs)
    assert "\n" not in str(info.value)


def test_peak_inflight_errors() -> None:
    for bad, kw in [
        (("dualpipe", 8, 4, 0), {}),
        (("interleaved", 6, 4, 0), {"virtual_stages": 2}),
        (("1f1b", 8, 4, 0), {"virtual_stages": 2}),
        (("interleaved", 8, 4, 0), {"virtual_stages": 0}),
    ]:
        with pytest.raises(MeshplanError):
            microbatches_in_flight(*bad, **kw)
