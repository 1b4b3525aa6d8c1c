"""plan(), manual plans, plan files and the plan / manual / explain commands."""

from __future__ import annotations

import functools
import json

import pytest

from cost_models.errors import DoesNotFitError, MeshplanError
from planner import Cluster, plan
from planner.models import build_model
from planner.plans.manual import manual_plan
from planner.vocab.plan_file import ParallelPlan
from runtime.cli import main

SMALL = "gpt:hidden=256,layers=4,heads=4,seq=128,vocab=1024"


@functools.cache
def _small_plan(spec: str = "1x4xV100-16GB", batch: int = 16) -> ParallelPlan:
    return plan(SMALL, spec, global_batch=batch, microbatch_size=[2, 4])


def test_plan_tiles_layers_and_devices() -> None:
    p = _small_plan()
    L = len(p.layer_nodes)
    assert p.stages[0].layers[0] == 0 and p.stages[-1].layers[1] == L - 1
    for a, b in zip(p.stages, p.stages[1:]):
        assert b.layers[0] == a.layers[1] + 1
    devices = sorted(d for s in p.stages for d in s.devices)
    assert devices == list(range(4))
    for s in p.stages:
        assert (
            len(s.devices)
            == s.submesh[0] * s.submesh[1]
            == s.logical_mesh[0] * s.logical_mesh[1]
        )
        assert s.memory_bytes <= p.memory_budget_bytes
    assert p.global_batch == 16 and 16 % p.num_microbatches == 0
    assert (
        p.dtype == "float16"
    )  # the training dtype (the default), not some op's output dtype
    assert p.estimate.iteration_time_s > 0 and p.estimate.tflops_per_device > 0
    # Every parameter of the model is placed by exactly one stage.
    placed = [path for s in p.stages for path in s.param_placements]
    model, _ = build_model(SMALL)
    assert sorted(placed) == sorted(name for name, _ in model.named_parameters())


def test_plan_json_round_trip(tmp_path) -> None:
    p = _small_plan()
    path = tmp_path / "p.json"
    p.save(path)
    data = json.loads(path.read_text())
    for key in ("params", "flops_per_iteration", "fingerprint"):
        assert key in data["model"]
    assert data["cluster"]["spec"] == "1x4xV100-16GB"
    for key in (
        "layers",
        "devices",
        "submesh",
        "logical_mesh",
        "recompute",
        "param_placements",
        "time_s",
        "memory_bytes",
    ):
        assert key in data["stages"][0]
    for key in ("iteration_time_s", "tflops_per_device", "peak_memory_bytes"):
        assert key in data["estimate"]
    back = ParallelPlan.load(path)
    assert back.to_json() == p.to_json()


def test_auto_plan_at_least_as_fast_as_manual_configs() -> None:
    p = _small_plan()
    for dp, tp, pp in ((4, 1, 1), (1, 4, 1), (2, 2, 1), (1, 1, 4), (2, 1, 2)):
        m = manual_plan(
            SMALL,
            "1x4xV100-16GB",
            dp=dp,
            tp=tp,
            pp=pp,
            num_microbatches=4,
            global_batch=16,
            allow_oom=True,
        )
        assert p.estimate.iteration_time_s <= m.estimate.iteration_time_s * 1.001, (
            dp,
            tp,
            pp,
        )


def test_manual_plan_places_megatron_weights() -> None:
    m = manual_plan(
        SMALL, "1x4xV100-16GB", dp=2, tp=2, pp=1, num_microbatches=2, global_batch=16
    )
    pl = m.stages[0].param_placements
    assert pl["blocks.0.attn.qkv.weight"] == ["R", "S(0)"]
    assert pl["blocks.0.mlp.proj.weight"] == ["R", "S(1)"]
    assert pl["blocks.0.ln_1.weight"] == ["R", "R"]
    assert m.manual["fits"] and m.stages[0].dp_tp == "2x2"


def test_manual_errors() -> None:
    with pytest.raises(MeshplanError, match="dp x tp x pp"):
        manual_plan(SMALL, "1x4xV100-16GB", dp=2, tp=2, pp=2, num_microbatches=2)
    with pytest.raises(MeshplanError, match="tp=8 must divide the 4 devices per host"):
        manual_plan(SMALL, "2x4xV100-16GB", dp=1, tp=8, pp=1, num_microbatches=2)
    with pytest.raises(MeshplanError, match="exactly one of"):
        manual_plan(SMALL, "1x4xV100-16GB", dp=4, tp=1, pp=1)


def test_microbatch_size_means_rows_per_microbatch_everywhere(tmp_path, capsys) -> None:
    """`manual_plan(microbatch_size=b)` and `plan(microbatch_size=b)` both mean b rows of the
    global batch per micro-batch; the manual command's old --micro-batch-size (rows per
    data-parallel replica) still works, says it is deprecated, and gives the same plan."""
    m = manual_plan(
        SMALL, "1x4xV100-16GB", dp=2, tp=2, pp=1, microbatch_size=4, global_batch=16
    )
    assert m.num_microbatches == 4 and m.manual["microbatch_size"] == 4
    auto = plan(SMALL, "1x4xV100-16GB", global_batch=16, microbatch_size=4)
    assert auto.num_microbatches == 4
    with pytest.raises(MeshplanError, match="split evenly over dp=2"):
        manual_plan(
            SMALL, "1x4xV100-16GB", dp=2, tp=2, pp=1, microbatch_size=3, global_batch=12
        )
    common = ["manual", SMALL, "--cluster", "1x4xV100-16GB", "--batch", "16"]
    common += ["--dp", "2", "--tp", "2", "--pp", "1"]
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    assert main([*common, "--microbatch-size", "4", "--json", str(new)]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert main([*common, "--micro-batch-size", "2", "--json", str(old)]) == 0
    err = capsys.readouterr().err
    assert "--micro-batch-size" in err and "deprecated" in err
    assert "--microbatch-size 4" in err
    a, b = ParallelPlan.load(new), ParallelPlan.load(old)
    assert (
        (a.num_microbatches, a.estimate)
        == (b.num_microbatches, b.estimate)
        == (
            4,
            m.estimate,
        )
    )


def test_a_zero_batch_is_an_error_not_the_default(capsys) -> None:
    with pytest.raises(MeshplanError, match="global batch must be positive, got 0"):
        plan(SMALL, "1x4xV100-16GB", global_batch=0)
    with pytest.raises(MeshplanError, match="global batch must be positive, got 0"):
        manual_plan(
            SMALL, "1x4xV100-16GB", dp=4, tp=1, pp=1, num_microbatches=1, global_batch=0
        )
    assert main(["plan", SMALL, "--cluster", "1x4xV100-16GB", "--batch", "0"]) == 2
    assert "got 0" in capsys.readouterr().err


def test_memory_messages_never_print_two_equal_numbers() -> None:
    from cost_models.errors import gib

    assert gib(20 * 2**30, 16 * 2**30) == ("20.0 GiB", "16.0 GiB")
    need, have = gib(16 * 2**30 + 2**20, 16 * 2**30)
    assert need != have and float(need.split()[0]) > float(have.split()[0])
    assert gib(2**30, 2**30) == ("1.0 GiB", "1.0 GiB")  # equal counts may print equal


@pytest.mark.slow
def test_solver_banner_does_not_reach_the_output() -> None:
    """HiGHS prints a banner on the first solve of a process; a fresh `meshplan plan` shows only
    the plan."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "runtime.cli",
        "plan",
        SMALL,
        "--cluster",
        "1x2xA100-80GB",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "HiGHS" not in out.stdout + out.stderr
    assert out.stdout.startswith("auto plan for")


def test_infeasible_model_states_memory() -> None:
    with pytest.raises(
        MeshplanError, match=r"needs [\d.]+ GiB per device, [\d.]+ GiB available"
    ):
        plan(
            "gpt:hidden=4096,layers=8,heads=32,seq=1024,vocab=51200",
            Cluster.from_spec("1x2xV100-16GB"),
            global_batch=8,
            microbatch_size=8,
        )


def test_state_that_cannot_fit_is_refused_before_tracing() -> None:
    """The up-front bound (every parameter's 16 bytes of mixed-precision Adam state spread over all
    devices) is at most the fullest device's memory in a plan, and a budget under it fails
    before tracing."""
    module, _ = build_model(SMALL, device="meta")
    need = sum(p.numel() for p in module.parameters()) * 16 / 4
    assert max(s.memory_bytes for s in _small_plan().stages) >= need
    said: list[str] = []
    with pytest.raises(
        DoesNotFitError,
        # the count as people write it: a small model's is not "0.00 B"
        match=r"its \d+\.\d M parameters' .* state alone need [\d.]+ GiB per device",
    ):
        plan(
            SMALL,
            "1x4xV100-16GB",
            global_batch=16,
            memory_budget=0.999 * need,
            progress=said.append,
        )
    assert not any("tracing" in m for m in said)


def test_a_microbatch_size_that_cannot_be_traced_is_skipped() -> None:
    """wresnet-tiny's last block is 1x1 pixels: BatchNorm cannot train on one row there. The plan
    skips that size and says so; asked for that size alone, plan raises the tracer's error."""
    said: list[str] = []
    p = plan(
        "wresnet-tiny",
        "1x2xA100-80GB",
        global_batch=4,
        dtype="float32",
        optimizer="adam_fp32",
        microbatch_size=[1, 2],
        progress=said.append,
    )
    assert p.num_microbatches == 2
    assert any("] micro-batch 1 skipped: cannot trace" in m for m in said), said
    with pytest.raises(MeshplanError, match="more than 1 value per channel"):
        plan("wresnet-tiny", "1x2xA100-80GB", global_batch=4, microbatch_size=1)


def test_cli_plan_and_explain(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "plan",
                SMALL,
                "--cluster",
                "1x2xV100-16GB",
                "--batch",
                "8",
                "--microbatch-size",
                "4",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "stage" in text and "TFLOP/s per device" in text
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert "parameter placements" in text and "blocks.0.attn.qkv.weight" in text


def test_cli_errors(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["explain", str(bad)]) == 2
    assert "not a JSON plan" in capsys.readouterr().err
    assert (
        main(
            [
                "manual",
                SMALL,
                "--cluster",
                "1x4xV100-16GB",
                "--dp",
                "3",
                "--tp",
                "1",
                "--pp",
                "1",
                "--microbatches",
                "2",
            ]
        )
        == 2
    )
    assert "dp x tp x pp" in capsys.readouterr().err


def test_plan_refuses_other_model() -> None:
    p = _small_plan()
    with pytest.raises(MeshplanError, match="plan was made for model"):
        p.check_model("0000", "other")
    # the same model in another dtype: the refusal says so
    name = p.model["name"]
    with pytest.raises(
        MeshplanError, match=f"in {p.dtype}, and this model's parameters are"
    ):
        p.check_model("0000", name, "bfloat16" if p.dtype != "bfloat16" else "float32")
    p.check_model(p.model["fingerprint"], name, "anything")  # the same graph runs
    # the same model tracing to other ops (e.g. a forward iterating over a set of strings)
    with pytest.raises(
        MeshplanError, match="traces to other ops here.*PYTHONHASHSEED=0"
    ):
        p.check_model("0000", name)


def test_intra_only_is_one_stage_on_the_whole_cluster() -> None:
    p = plan(
        SMALL, "1x4xV100-16GB", global_batch=16, microbatch_size=[4], mode="intra-only"
    )
    assert (
        len(p.stages) == 1 and p.stages[0].submesh == (1, 4) and p.kind == "intra-only"
    )
    assert p.stages[0].layers == (0, len(p.layer_nodes) - 1)


def test_inter_only_keeps_parameters_replicated() -> None:
    p = plan(
        SMALL, "1x4xV100-16GB", global_batch=16, microbatch_size=[4], mode="inter-only"
    )
    for s in p.stages:
        assert s.logical_mesh[0] == 1
        assert all(set(pl) == {"R"} for pl in s.param_placements.values())
        assert not s.zero_params
    auto = plan(SMALL, "1x4xV100-16GB", global_batch=16, microbatch_size=[4])
    assert auto.estimate.iteration_time_s <= p.estimate.iteration_time_s * 1.001


def test_unknown_mode() -> None:
    with pytest.raises(MeshplanError, match="unknown mode"):
        plan(SMALL, "1x4xV100-16GB", mode="both")


def test_microbatch_candidates() -> None:
    from planner.api import larger_microbatch_sizes, microbatch_sizes

    assert microbatch_sizes(1024) == [1, 2, 4, 8, 16, 32]
    assert microbatch_sizes(24) == [1, 2, 4, 8]
    assert microbatch_sizes(6) == [1, 2]
    assert microbatch_sizes(3) == [1]
    one_host, two_hosts = (
        Cluster.from_spec("1x8xA100-80GB"),
        Cluster.from_spec("2x4xA100-80GB"),
    )
    assert microbatch_sizes(1024, one_host) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert microbatch_sizes(96, one_host) == [1, 2, 4, 8, 16, 32]
    assert microbatch_sizes(1024, Cluster.from_spec("1x1xA100-80GB")) == [
        1,
        2,
        4,
        8,
        16,
        32,
    ]
    assert microbatch_sizes(1024, two_hosts) == [1, 2, 4, 8, 16, 32]
    # beyond one host, the manual grid's sizes up to 16 rows per device come after
    assert larger_microbatch_sizes(1024, two_hosts) == [64, 128]
    assert larger_microbatch_sizes(96, two_hosts) == []
    assert larger_microbatch_sizes(1024, one_host) == []


@pytest.mark.slow
def test_larger_microbatches_are_tried_only_while_they_win() -> None:
    """On 2 hosts the candidates stop at 32 rows; 64 is traced only when 32 is the best so far.
    Ground truth: the best of the plans at each size alone."""
    tiny, spec = "gpt:hidden=64,layers=2,heads=2,seq=32,vocab=128", "2x2xA100-80GB"

    def alone(b: int, budget: float | None) -> float:
        try:
            p = plan(
                tiny, spec, global_batch=64, memory_budget=budget, microbatch_size=b
            )
        except MeshplanError:  # does not fit at this size
            return float("inf")
        return p.estimate.iteration_time_s

    from planner.api import microbatch_sizes

    base = microbatch_sizes(64, Cluster.from_spec(spec))
    assert base == [1, 2, 4, 8, 16, 32]
    # both branches of the rule: 32 rows best (64 tried), and 16 best under a tight budget
    for budget, traced in ((None, True), (1.3e6, False)):
        msgs: list[str] = []
        p = plan(
            tiny, spec, global_batch=64, memory_budget=budget, progress=msgs.append
        )
        sizes = [int(m.split()[-1]) for m in msgs if " tracing " in f" {m}"]
        best = min((alone(b, budget), b) for b in base)
        assert (64 in sizes) is (best[1] == 32) is traced
        if traced:
            best = min(best, (alone(64, budget), 64))
        assert p.estimate.iteration_time_s == pytest.approx(best[0])
        assert 64 // p.num_microbatches == best[1]


def test_larger_sizes_reach_one_row_per_device() -> None:
    """The rule over `larger_microbatch_sizes`, brute force: walking sizes 64 to 1024 on 256
    devices with a best size drawn at random after each evaluation, every size evaluated is
    either one the largest-so-far rule takes or the first of at least 256 rows, and that one
    is always evaluated."""
    import random

    from planner.api import next_size_step

    D, larger = 256, [64, 128, 256, 512, 1024]
    rng = random.Random(0)
    for _ in range(200):
        tried, before, best, evaluated = 32, None, rng.choice([1, 32]), []
        for b in larger:
            step = next_size_step(b, tried, best, D, before)
            if step == "stop":
                break
            if step == "try":
                assert best in (tried, before) or (tried < D <= b)
                evaluated.append(b)
                before, tried = (tried if tried in larger else None), b
                best = rng.choice([best, b])
            else:
                assert b < D and best not in (tried, before)
        assert 256 in evaluated
        # the sizes past 256 only while the largest tried, or the one before it, wins
        assert evaluated == sorted(evaluated)
    # a larger size that loses does not stop the walk at once (moe-10b on 16 A100s: 64 rows
    # beat 32, 128 lost to 64, 256 beat both); one that loses after a loss does
    assert next_size_step(256, 128, 64, 16, before=64) == "try"
    assert next_size_step(512, 256, 64, 16, before=128) == "stop"
    assert next_size_step(64, 32, 16, 16, before=None) == "stop"


def test_a_batch_smaller_than_the_cluster_tries_its_largest_size() -> None:
    """Global batch 256 on 512 devices (llama3-405b in the llama suite): no size reaches a row
    per device; the largest, the whole batch (FSDP over dp256 x tp2), is evaluated even when
    the best of 1 to 32 rows is 4, and the sizes between are skipped."""
    from planner.api import larger_microbatch_sizes, next_size_step, rows_to_reach

    cluster = Cluster.from_spec("64x8xH100-80GB")
    larger = larger_microbatch_sizes(256, cluster)
    assert larger == [64, 128, 256]
    rows = rows_to_reach(larger, cluster.num_devices)
    assert rows == 256
    steps = [next_size_step(b, 32, 4, rows) for b in larger]
    assert steps == ["skip", "skip", "try"]
    # with a row per device reachable, as before: the first of at least 512 rows
    assert [next_size_step(b, 32, 4, 512) for b in (256, 512)] == ["skip", "try"]
    assert next_size_step(1024, 512, 4, 512) == "stop"


def test_walk_next_guesses_the_size_the_walk_tries_next() -> None:
    """`walk_next` on 64 devices (sizes 1 to 32 first, then 64, 128, 256; 64 rows in any
    case): the walk's next size on the results so far; a size searched ahead still running
    taken to win, one searched with the first sizes awaited; nothing while no first size is
    done or once the walk would stop."""
    from planner.api import walk_next

    base = [32, 16, 8, 4, 2, 1]
    guess = functools.partial(walk_next, [64, 128, 256], 32, 64, base)
    first = set(base)  # 64 rows not among the first sizes: as on 32 devices
    assert guess(first, {}, set()) is None
    assert guess(first, {16: 5.0}, set()) == 64  # 64 rows in any case
    assert guess(first, {16: 5.0, 64: 6.0}, set()) is None  # 16 best: stop after 64
    assert guess(first, {32: 4.0, 16: 5.0, 64: 3.0}, set()) == 128
    assert guess(first, {32: 4.0, 16: 5.0, 64: 3.0}, {128}) == 256  # as if 128 wins
    assert guess(first, {32: 4.0, 16: 5.0, 64: 3.0, 128: 3.5}, set()) == 256
    assert guess(first, {32: 4.0, 16: 5.0, 64: 4.0}, set()) is None  # a tie: 32
    assert guess(first, {32: 4.0, 16: 5.0}, {64}) == 128  # as if 64 wins
    assert guess(first, {32: 4.0, 16: 5.0}, {64, 128, 256}) is None
    # 64 rows searched with the first sizes: awaited while it runs, then walked on from
    listed = first | {64}
    assert guess(listed, {32: 4.0, 16: 5.0}, set()) is None
    assert guess(listed, {32: 4.0, 16: 5.0, 64: 3.0}, set()) == 128
    assert guess(listed, {32: 4.0, 16: 5.0, 64: 6.0}, set()) is None


def test_the_size_tried_in_any_case_is_searched_with_the_first_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first larger size of a row per device (64 rows on 64 devices) is evaluated with the
    sizes 1 to 32, not after them; the sizes evaluated and the plan returned are those of the
    serial walk (`next_size_step` after every size up to 32), for a best size below, at and
    beyond 32 rows, with ties going to the earlier size of the walk. With n planner processes
    each later size the walk needs is searched with up to n - 1 sizes after it (`planner.api.
    _walk_larger`), and a process with none of the first sizes left searches ahead the size
    the walk would try next were the sizes still running to change nothing (`planner.api.
    walk_next`, here with the smallest size still running, 1 row, whose result may change
    the walk): more sizes may be searched, never another plan returned, whichever sizes'
    plans are left unassembled as slower than a size the search keeps."""
    import copy

    from planner import api
    from planner.size_eval import SizeResult

    made = plan("gpt-tiny", "1x2xA100-80GB", global_batch=4, microbatch_size=4)
    cluster = Cluster.from_spec("8x8xA100-80GB")
    G = 256
    base = api.microbatch_sizes(G, cluster)
    larger = api.larger_microbatch_sizes(G, cluster)
    rows = api.rows_to_reach(larger, cluster.num_devices)
    assert (base, larger, rows) == ([1, 2, 4, 8, 16, 32], [64, 128, 256], 64)

    def result(b: int, seconds: dict[int, float]) -> SizeResult:
        out = copy.deepcopy(made)
        out.num_microbatches = G // b  # marks the size the plan came from
        return SizeResult(b, seconds=seconds[b], plan=out)

    def serial(seconds: dict[int, float]) -> tuple[set[int], int]:
        done = {b: seconds[b] for b in sorted(base, reverse=True)}
        tried, before = 32, None
        for b in larger:
            best = min(done, key=lambda k: (done[k], list(done).index(k)))
            step = api.next_size_step(b, tried, best, rows, before)
            if step == "stop":
                break
            if step == "try":
                done[b] = seconds[b]
                before, tried = (tried if tried in larger else None), b
        return set(done), min(done, key=lambda k: (done[k], list(done).index(k)))

    profiles = [
        {
            1: 9,
            2: 8,
            4: 5,
            8: 6,
            16: 7,
            32: 8,
            64: 9,
            128: 1,
            256: 1,
        },  # best 4; 64 only
        {1: 9, 2: 8, 4: 7, 8: 6, 16: 5, 32: 4, 64: 3, 128: 2, 256: 1},  # ever larger
        {1: 9, 2: 8, 4: 7, 8: 6, 16: 5, 32: 4, 64: 4, 128: 5, 256: 3},  # a tie at 64
        # best 1, which the guess has not seen: 128 and 256 searched ahead in vain, and
        # 256, faster, is not one the walk tries
        {1: 0.5, 2: 8, 4: 7, 8: 6, 16: 5, 32: 4, 64: 3, 128: 2, 256: 0.25},
    ]
    guessed = [[], [128, 256], [], [128, 256]]  # the sizes searched ahead
    for seconds, guess in zip(profiles, guessed):
        sizes, best = serial(seconds)
        for width in (1, 2, 3):
            batches: list[list[int]] = []
            searched_ahead: list[int] = []

            def evaluate_all(
                job,
                make,
                sizes,
                say,
                kept=None,
                bar=float("inf"),
                ahead=None,
                seconds=seconds,
                batches=batches,
                searched_ahead=searched_ahead,
                width=width,
            ):
                # as `size_search.evaluate_all` would at most leave unassembled: every size
                # slower than `bar` or than any kept size
                batches.append(list(sizes))
                kept = range(len(sizes)) if kept is None else kept
                bar = min([bar] + [seconds[sizes[k]] for k in kept])

                def done(b: int) -> SizeResult:
                    if seconds[b] > bar:
                        return SizeResult(b, seconds[b], beaten=True)
                    return result(b, seconds)

                if ahead is not None and width > 1:
                    # the 1-row size still running: the walk guessed without it
                    finished = {b: seconds[b] for b in sizes if b != 1}
                    while (b := ahead.pick(finished, set())) is not None:
                        assert b not in finished and b not in sizes
                        finished[b] = seconds[b]
                        ahead.found[b] = done(b)
                        searched_ahead.append(b)
                return [done(b) for b in sizes]

            monkeypatch.setattr(api, "evaluate_all", evaluate_all)
            monkeypatch.setenv("MESHPLAN_PLANNER_PROCESSES", str(width))
            got = plan("gpt-tiny", cluster, global_batch=G)
            assert batches[0] == [64, 32, 16, 8, 4, 2, 1]
            later = [b for batch in batches[1:] for b in batch]
            # the serial walk's sizes, each once, and at most width - 1 searched ahead
            # of each size the walk needs
            assert sizes <= set(batches[0]) | set(later) | set(searched_ahead)
            assert 64 not in later + searched_ahead
            assert len(later + searched_ahead) == len(set(later + searched_ahead))
            assert all(len(batch) <= width for batch in batches[1:])
            assert searched_ahead == (guess if width > 1 else [])
            if width == 1:
                assert set(batches[0]) | set(later) == sizes
            assert got.num_microbatches == G // best


@pytest.mark.slow
def test_cli_output_into_a_closed_pipe_is_not_an_error(tmp_path) -> None:
    import subprocess
    import sys

    out = tmp_path / "p.json"
    _small_plan().save(out)
    # The reader is gone before the command writes (like `meshplan explain p.json | head -1`).
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "explain", str(out), "--params", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait() == 0 and "Traceback" not in err, err


def test_boundary_sends_share_the_network_card_only_among_senders() -> None:
    """Across hosts a device gets NIC / (devices of the host sending at once): a 1-device stage
    has the whole card (V100 host: 25 Gbps), a whole-host stage an eighth per device - the same
    time for the whole boundary either way; inside a host the NVLink price is unchanged."""
    from cost_models.cluster import Cluster
    from cost_models.pipeline import stage_send_times

    cluster = Cluster.from_spec("2x8xV100-16GB")
    nic = 25e9 / 8
    alpha = cluster.inter_host_link.latency_s
    b = 16e6
    one, host = (
        stage_send_times(cluster, [b, b], [[7], [8], list(range(8, 16))])[0],
        stage_send_times(cluster, [b], [list(range(8)), list(range(8, 16))])[0],
    )
    assert one == pytest.approx(2 * (alpha + b / nic))
    assert host == pytest.approx(2 * (alpha + (b / 8) / (nic / 8)))
    inside = stage_send_times(cluster, [b], [[0], [1]])[0]
    link = cluster.intra_host_link
    assert inside == pytest.approx(
        2 * (link.latency_s + b / link.bandwidth_bytes_per_s)
    )


def test_logical_shapes_offer_both_orientations_inside_a_host() -> None:
    from cost_models.communication import LogicalMesh
    from cost_models.resharding import reshard_cost
    from planner.inter.mesh_shapes import _seeds_only, logical_shapes

    assert logical_shapes((1, 8)) == [(1, 8), (2, 4), (4, 2)]
    assert logical_shapes((1, 4)) == [(1, 4), (2, 2)]
    assert logical_shapes((1, 2)) == [(1, 2)]
    assert logical_shapes((2, 8)) == [(2, 8), (8, 2), (4, 4), (1, 16)]
    assert logical_shapes((4, 8)) == [(4, 8), (16, 2), (8, 4), (1, 32)]
    assert logical_shapes((2, 2)) == [(2, 2), (1, 4)]
    # across hosts only hosts x devices, and m x 2 on two hosts, get the free program
    for sub, full in (((2, 8), {(2, 8), (8, 2)}), ((4, 8), {(4, 8)}), ((1, 8), None)):
        free = {s for s in logical_shapes(sub) if not _seeds_only(sub, s, "auto")}
        assert free == (full or set(logical_shapes(sub)))
    # Why a mesh and its transpose both count: Megatron's dp4 x tp2 activation layout (batch split
    # over every device, dp outer) gathered over tp before a column-parallel matmul. On 4 x 2 (tp on
    # axis 1) that is one all-gather among 2 devices; with tp on axis 0 of 2 x 4 the nested shard
    # is misaligned and DTensor replicates it first (all 8 devices), then splits it again.
    host = Cluster.from_spec("1x8xA100-80GB")
    shape, fp16 = (8, 1024, 8192), 2
    tp_inner = reshard_cost(
        LogicalMesh(host, (1, 8), (4, 2)), shape, fp16, ("S(0)", "S(0)"), ("S(0)", "R")
    )
    tp_outer = reshard_cost(
        LogicalMesh(host, (1, 8), (2, 4)), shape, fp16, ("S(0)", "S(0)"), ("R", "S(0)")
    )
    assert tp_outer > 2 * tp_inner > 0


@pytest.mark.slow
def test_planner_threads_do_not_change_the_plan(monkeypatch) -> None:
    """The per-mesh intra-op passes run on threads; the plan is the one a single thread finds."""
    plans = []
    for threads in ("1", "3"):
        monkeypatch.setenv("MESHPLAN_PLANNER_THREADS", threads)
        p = plan(SMALL, "1x4xV100-16GB", global_batch=16, microbatch_size=[2, 4])
        plans.append({k: v for k, v in p.to_json().items() if k != "planner_time_s"})
    assert plans[0] == plans[1]
    monkeypatch.setenv("MESHPLAN_PLANNER_THREADS", "two")
    with pytest.raises(
        MeshplanError, match="MESHPLAN_PLANNER_THREADS must be a positive"
    ):
        plan(SMALL, "1x4xV100-16GB", global_batch=16, microbatch_size=2)


def test_plan_process_ends_with_its_output_written(tmp_path) -> None:
    """`meshplan plan` as a program ends without the interpreter's teardown
    (`runtime.cli._exit_fast`): its summary, piped (so block-buffered), and its plan file are
    complete; a failing plan still exits 2 with its message."""
    import os
    import subprocess
    import sys

    out = tmp_path / "p.json"
    argv = [sys.executable, "-m", "runtime.cli", "plan", SMALL, "--cluster"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    ok = subprocess.run(
        [*argv, "1x2xA100-80GB", "--batch", "4", "--quiet", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "iteration" in ok.stdout and f"wrote {out}" in ok.stderr
    assert ParallelPlan.load(out).estimate.iteration_time_s > 0
    bad = subprocess.run(
        [*argv, "1x2xA100-80GB", "--batch", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert bad.returncode == 2 and "global batch must be positive" in bad.stderr
