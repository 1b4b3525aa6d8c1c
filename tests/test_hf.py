"""Hugging Face ``transformers`` models as they are: built from small configs (no weights), traced,
planned and trained on 4 gloo processes to the losses and parameters of one device."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
import single_device
import torch
from profiles import cpu_cluster

from cost_models.cluster import Cluster
from cost_models.communication import LogicalMesh
from cost_models.errors import MeshplanError
from planner import plan, trace
from planner.inter import boundaries as bd
from planner.inter import stage_solves
from planner.intra.megatron import Seed, axes_filter
from planner.models import build_model, param_count
from planner.plans.manual import manual_plan, megatron_placement
from runtime.launch import launch
from runtime.train import _random_batches

pytest.importorskip("transformers")

_DENSE = "hidden_size=64,intermediate_size=96,num_hidden_layers=2,num_attention_heads=4"
SPECS = {
    "gpt2": "hf:gpt2:n_embd=64,n_layer=2,n_head=4,vocab_size=128,n_positions=16,seq=16,"
    "resid_pdrop=0,embd_pdrop=0,attn_pdrop=0,bos_token_id=0,eos_token_id=0",
    "llama": f"hf:llama:{_DENSE},num_key_value_heads=2,vocab_size=128,seq=16",
    # 8 query heads and 4 key/value heads: tp4 splits both (grouped-query attention's heads)
    "qwen2": "hf:qwen2:hidden_size=64,intermediate_size=96,num_hidden_layers=2,"
    "num_attention_heads=8,num_key_value_heads=4,vocab_size=128,seq=16",
    "bert": f"hf:bert:{_DENSE},vocab_size=128,task=masked-lm,seq=16,"
    "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
    "mixtral": f"hf:mixtral:{_DENSE},num_key_value_heads=2,vocab_size=128,seq=16,"
    "num_local_experts=4",
    "qwen2_moe": f"hf:qwen2_moe:{_DENSE},num_key_value_heads=2,vocab_size=128,seq=16,"
    "moe_intermediate_size=32,shared_expert_intermediate_size=64,num_experts=4,"
    "num_experts_per_tok=2",
    # multi-head latent attention, whose rotary half is written into part of the query and key
    # (slice_scatter and copy: `runtime.differentiable`); a dense first block, then shared plus
    # routed experts
    "deepseek_v3": f"hf:deepseek_v3:{_DENSE},num_key_value_heads=2,vocab_size=128,seq=16,"
    "moe_intermediate_size=32,n_routed_experts=4,num_experts_per_tok=2,n_shared_experts=1,"
    "first_k_dense_replace=1,kv_lora_rank=16,q_lora_rank=16,qk_rope_head_dim=8,"
    "qk_nope_head_dim=8,v_head_dim=16,n_group=1,topk_group=1",
    # multi-query attention with a fused projection; its forward makes tensors from data
    # (`planner.tracing.constants`) and reshapes a batch-of-one copy as a view (the fingerprint)
    "falcon": "hf:falcon:hidden_size=64,num_hidden_layers=2,num_attention_heads=4,"
    "vocab_size=128,seq=16",
}
#: the manual plans trained per model, besides the automatic one. qwen2 is llama's graph with
#: biases and qwen2_moe mixtral's with a shared expert: tensor parallelism is what their extra
#: parameters change. BERT's tied decoder runs across two stages; its dp4 adds nothing to GPT-2's.
MANUAL = {
    "gpt2": ("tp4", "dp4", "pp2_dp2"),
    "llama": ("tp4", "dp4", "pp2_dp2"),
    "qwen2": ("tp4",),
    "bert": ("tp4", "pp2_dp2"),
    "mixtral": ("tp4", "dp4", "pp2_dp2"),
    "qwen2_moe": ("tp4",),
    "deepseek_v3": ("tp4",),
    "falcon": ("tp4",),
}
#: the models whose automatic plan runs compiled (the others' eagerly): a Mixtral (transformers'
#: grouped matrix products) and DeepSeek-V3 (the scatters' autograd functions). Compiling costs
#: a small model's launch several seconds per rank (llama 8.4 s compiled, 2.3 s eager; about
#: 3 CPU-s of AOTAutograd trace per rank and model): tied embeddings train compiled in
#: tests/test_tied_params.py and a Llama in tests/test_llama.py
COMPILED = ("mixtral", "deepseek_v3")
#: the models whose automatic plan for 4 A100s is planned too and checked against the model's
#: fingerprint at batch 1 (GPT-2's causal-LM loss lost an op at batch 1; Mixtral's router;
#: Falcon's attention reshapes a view where larger batches reshape a copy)
A100_CHECKED = ("gpt2", "mixtral", "falcon")
#: a Mixtral whose experts outweigh the rest: its plan for 4 A100s shards the experts'
#: grouped products (transformers' float32 operator), trained in the same launch
WIDE_MIXTRAL = SPECS["mixtral"].replace(
    "intermediate_size=96", "intermediate_size=1024"
)
LR = 0.1
STEPS = 3
BATCH = 8


@pytest.mark.parametrize("name", list(SPECS))
def test_traces_with_the_models_own_parameters(name: str) -> None:
    model, batch = build_model(SPECS[name], batch=2, device="meta")
    graph = trace(model, batch, model_name=name)
    assert graph.num_params == param_count(SPECS[name])
    assert set(graph.params) == {k for k, _ in model.named_parameters()}
    assert graph.fwd_flops > 0 and graph.bwd_flops > graph.fwd_flops


@pytest.mark.parametrize("name", ["gpt2", "falcon"])
def test_fingerprint_does_not_depend_on_the_batch(name: str) -> None:
    prints = set()
    for b in (1, 2, 4):
        model, batch = build_model(SPECS[name], batch=b, device="meta")
        prints.add(trace(model, batch).fingerprint())
    assert len(prints) == 1


def test_bad_specs_are_named() -> None:
    with pytest.raises(MeshplanError, match="no_such_key"):
        build_model("hf:llama:hidden_size=64,no_such_key=3", batch=1)
    with pytest.raises(MeshplanError, match="task must be one of"):
        build_model("hf:llama:hidden_size=64,task=vision", batch=1)
    with pytest.raises(MeshplanError, match="no config file"):
        build_model("hf:/nonexistent/config.json", batch=1)
    # a short line with the nearest types, not transformers' list of hundreds
    with pytest.raises(MeshplanError, match="no model type 'mixtrall'") as err:
        build_model("hf:mixtrall:hidden_size=64", batch=1)
    assert "did you mean mixtral" in str(err.value) and len(str(err.value)) < 300
    with pytest.raises(MeshplanError, match="notatype"):
        build_model("hf:notatype:hidden_size=64", batch=1)
    with pytest.raises(MeshplanError, match="no model type"):
        build_model("hf:", batch=1)
    # transformers' own validation: a value of the wrong type, an inconsistent config
    with pytest.raises(MeshplanError, match="'num_hidden_layers' expected int"):
        build_model("hf:llama:num_hidden_layers=abc", batch=1)
    with pytest.raises(
        MeshplanError, match="multiple of the number of attention heads"
    ):
        build_model("hf:llama:hidden_size=64,num_attention_heads=5", batch=1)
    with pytest.raises(MeshplanError, match="seq must be a positive integer, got 0"):
        build_model("hf:llama:hidden_size=64,seq=0", batch=1)
    with pytest.raises(MeshplanError, match="no causal-lm head for this config"):
        build_model(
            "hf:vit:hidden_size=64,num_attention_heads=4", batch=1, device="meta"
        )
    # attn: transformers' own choice unless given (Gemma-2 has no sdpa path here)
    gemma2 = f"hf:gemma2:{_DENSE},head_dim=16,seq=16"
    with pytest.raises(MeshplanError, match=r"attn=eager builds it"):
        build_model(f"{gemma2},attn=sdpa", batch=1, device="meta")
    model, _ = build_model(gemma2, batch=1, device="meta")
    assert model.config._attn_implementation == "eager"
    model, _ = build_model(f"hf:llama:{_DENSE},seq=16", batch=1, device="meta")
    assert model.config._attn_implementation == "sdpa"
    # a module reading a key its sub-config lacks (Dbrx's attn_config)
    dbrx = "hf:dbrx:d_model=64,n_heads=4,n_layers=2,max_seq_len=16,vocab_size=128"
    with pytest.raises(MeshplanError, match="could not build the model.*rope_theta"):
        build_model(dbrx, batch=1, device="meta")
    # Phi-3's default padding token (32000) outside a small vocabulary
    phi3 = f"hf:phi3:{_DENSE},num_key_value_heads=2,vocab_size=128,seq=16"
    with pytest.raises(MeshplanError, match="pad_token_id 32000 is not a token"):
        build_model(phi3, batch=1, device="meta")
    model, _ = build_model(f"{phi3},pad_token_id=0", batch=1, device="meta")
    assert model.model.embed_tokens.padding_idx == 0
    assert build_model(f"{phi3},pad_token_id=null", batch=1, device="meta")


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_unpadded_batch_has_no_mask_tensor(name: str) -> None:
    """Without an attention_mask every attention runs causal (or, for BERT, unmasked) with no
    mask tensor, as transformers runs it on unpadded rows; with the batch's own mask, every
    attention reads a mask."""
    model, (ids, labels) = build_model(SPECS[name], batch=2, device="meta")

    def inputs(batch: tuple) -> list[int]:
        """The tensor inputs of each attention: query, key, value and any mask."""
        graph = trace(model, batch)
        return [
            len(n.inputs) for n in graph.ops if "scaled_dot_product" in str(n.target)
        ]

    layers = model.config.num_hidden_layers
    assert inputs((ids, labels)) == [3] * layers
    assert inputs((ids, labels, torch.ones_like(ids))) == [4] * layers


#: models that make their own padding mask of ones when called without one
SELF_MASKED = {
    "biogpt": f"hf:biogpt:{_DENSE},vocab_size=128,seq=16,hidden_dropout_prob=0,"
    "attention_probs_dropout_prob=0",
    "megatron-bert": f"hf:megatron-bert:{_DENSE},vocab_size=128,seq=16,task=masked-lm,"
    "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
}


@pytest.mark.parametrize("name", list(SELF_MASKED))
def test_a_mask_of_ones_the_model_makes_is_no_mask(name: str) -> None:
    """BioGPT (sdpa attention) and Megatron-BERT (eager) make a mask of ones when called
    without one, and transformers reads its values (an error while tracing): the trace has no
    mask tensor ([batch, 1, seq, seq]), as transformers runs such a mask on a device, and the
    traced graph computes the model's loss."""
    from planner.tracing.calls import call_for_loss

    torch.manual_seed(0)
    model, batch = build_model(SELF_MASKED[name], batch=2, device="cpu")
    graph = trace(model, batch)
    rows, seq = batch[0].shape
    mask = (rows, 1, seq, seq)
    assert not [n for n in graph.ops if any(o.shape == mask for o in n.outputs)]
    sdpa = [n for n in graph.ops if "scaled_dot_product" in str(n.target)]
    assert all(len(n.inputs) == 3 for n in sdpa)
    # the graph's inputs flat (a functionalized graph's calling convention): parameters,
    # buffers, then the batch
    flat = [*model.parameters(), *model.buffers(), *batch]
    got = torch.fx.Interpreter(graph.gm).run(*flat)
    want = call_for_loss(model, tuple(batch))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_python_literals_in_specs() -> None:
    """True, False and None as a config's repr writes them, besides JSON's."""
    from planner.models import hf

    config, _ = hf.parse("hf:qwen2:use_sliding_window=True,tie_word_embeddings=false")
    assert config.use_sliding_window is True and config.tie_word_embeddings is False
    config, _ = hf.parse("hf:qwen2:sliding_window=None")
    assert config.sliding_window is None
    # a list, its commas inside the brackets (JSON: double quotes)
    config, _ = hf.parse(
        'hf:qwen2:num_hidden_layers=2,layer_types=["full_attention","sliding_attention"],'
        "max_window_layers=1"
    )
    assert config.layer_types == ["full_attention", "sliding_attention"]
    assert config.max_window_layers == 1


@pytest.mark.parametrize("name", ["llama", "qwen2", "mixtral", "bert"])
def test_manual_tensor_parallel_is_megatrons(name: str) -> None:
    """`meshplan manual --tp 4` of a Hugging Face Llama- or BERT-family model places every
    weight as Megatron does on the tensor-parallel axis (q/k/v, gate and up projections and
    BERT's intermediate by output features, o and down projections and BERT's output denses by
    input features, the embedding and BERT's decoder bias by vocabulary; norms, Mixtral's router
    and its fused experts replicated), and the batch of a dense model is not split there:
    before, no name matched, every weight was replicated and "tp4" ran data-parallel."""
    p = manual_plan(
        SPECS[name], "1x4xA100-80GB", dp=1, tp=4, pp=1, num_microbatches=1,
        global_batch=BATCH, dtype="float32", allow_oom=True,
    )  # fmt: skip
    (stage,) = p.stages
    got = {path: pl[1] for path, pl in stage.param_placements.items()}
    want = {path: megatron_placement(path) for path in got}
    assert got == want
    if name == "bert":
        layer = "bert.encoder.layer.0."
        assert got[layer + "attention.self.key.weight"] == "S(0)"
        assert got[layer + "attention.output.dense.weight"] == "S(1)"
        assert got[layer + "intermediate.dense.weight"] == "S(0)"
        assert got[layer + "output.dense.weight"] == "S(1)"
        assert got["bert.embeddings.word_embeddings.weight"] == "S(0)"
        assert got["cls.predictions.bias"] == "S(0)"
        assert got["cls.predictions.transform.dense.weight"] == "R"
    else:
        assert got["model.layers.0.self_attn.q_proj.weight"] == "S(0)"
        assert got["model.layers.0.self_attn.o_proj.weight"] == "S(1)"
        assert got["model.embed_tokens.weight"] == "S(0)"
    if name == "mixtral":
        assert got["model.layers.0.mlp.gate.weight"] == "R"  # the router
    else:  # a mixture's activations stay free (`planner.intra.megatron.batch_axes`)
        assert stage.data_parallel_axes == []
    if name in ("llama", "qwen2"):
        assert got["model.layers.0.mlp.down_proj.weight"] == "S(1)"
    if name == "bert":
        return
    # Qwen2's 4 key/value heads split over 4 devices: the attention kernel splits the heads
    # (Llama's 2 cannot be)
    sdpa = next(
        s
        for n, s in stage.node_strategies.items()
        if n.startswith("_scaled_dot_product")
    )
    heads = ["R", "S(1)"] in sdpa["inputs"]
    assert heads == (name == "qwen2"), sdpa


def test_a_config_json_is_planned_in_the_dtype_it_declares(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """`meshplan plan hf:config.json` without --dtype plans in the dtype the config declares
    (a hub checkpoint's ``torch_dtype``: bfloat16), --dtype overrides it, an inline spec stays
    float16; the table's first line says which."""
    from planner.models import hf
    from runtime.cli import main

    config, _ = hf.parse(SPECS["llama"])
    saved = config.to_dict() | {"torch_dtype": "bfloat16"}
    saved.pop("dtype", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved))
    spec = f"hf:{path},seq=16"
    assert hf.declared_dtype(spec) == "bfloat16"
    assert hf.declared_dtype(SPECS["llama"]) is None
    for extra, want in (([], "bfloat16"), (["--dtype", "float32"], "float32")):
        out = tmp_path / f"{want}.json"
        argv = ["plan", spec, "--cluster", "1x2xA100-80GB", "--batch", "4", "--quiet"]
        assert main([*argv, "--microbatch-size", "4", "--json", str(out), *extra]) == 0
        assert json.loads(out.read_text())["dtype"] == want
        assert f"on 1x2xA100-80GB in {want}:" in capsys.readouterr().out


def test_fused_projections_are_not_taken_for_megatrons() -> None:
    """Names match at a module boundary: Phi-3's and CodeGen's fused ``qkv_proj`` is not a
    ``v_proj``, nor Phi-3's ``gate_up_proj`` an ``up_proj`` (a split of a fused output by
    features gives no device whole heads or matching gate and up columns); before, both were
    split by output features."""
    fused = (
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "transformer.h.0.attn.qkv_proj.weight",
    )
    assert [megatron_placement(p) for p in fused] == ["R"] * 3
    assert megatron_placement("model.layers.0.self_attn.v_proj.weight") == "S(0)"
    assert megatron_placement("model.layers.0.mlp.up_proj.weight") == "S(0)"
    assert megatron_placement("lm_head.weight") == "S(0)"  # at the top level too


@pytest.mark.parametrize(
    ("column", "row"),
    [
        ("model.decoder.layers.0.fc1", "model.decoder.layers.0.fc2"),  # OPT
        ("model.layers.0.mlp.fc1", "model.layers.0.mlp.fc2"),  # Phi
        ("transformer.h.0.mlp.fc_in", "transformer.h.0.mlp.fc_out"),  # GPT-J, CodeGen
        ("gpt_neox.layers.0.mlp.dense_h_to_4h", "gpt_neox.layers.0.mlp.dense_4h_to_h"),
    ],
)
def test_other_families_mlps_are_megatrons(column: str, row: str) -> None:
    """The MLPs of OPT, Phi, GPT-J and GPT-NeoX/Bloom/Falcon: the first projection column-,
    the second row-parallel (its bias replicated, added once after the reduction)."""
    assert megatron_placement(column + ".weight") == "S(0)"
    assert megatron_placement(column + ".bias") == "S(0)"
    assert megatron_placement(row + ".weight") == "S(1)"
    assert megatron_placement(row + ".bias") == "R"
    # the attention output of OPT and Phi, whose q, k and v are split; not GPT-J's and MPT's
    # attn.out_proj (MPT's q, k and v are fused)
    assert (
        megatron_placement("model.decoder.layers.0.self_attn.out_proj.weight") == "S(1)"
    )
    assert megatron_placement("model.layers.0.self_attn.dense.weight") == "S(1)"
    assert megatron_placement("transformer.blocks.0.attn.out_proj.weight") == "R"


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_manual_tensor_parallel_replicates_a_vocabulary_that_does_not_split(
    name: str,
) -> None:
    """A vocabulary that is not a multiple of the tensor-parallel size (BERT's 30522 over 4;
    Megatron pads it, the planner splits only evenly): the embedding is replicated on the
    tensor-parallel axis and every other weight keeps Megatron's placement. Before, `meshplan
    manual --tp 4` failed with "no allowed placement for parameter ...", and the automatic
    search dropped every tensor-parallel seed of the model."""
    spec = SPECS[name].replace("vocab_size=128", "vocab_size=130")
    p = manual_plan(
        spec, "1x4xA100-80GB", dp=1, tp=4, pp=1, num_microbatches=1,
        global_batch=BATCH, dtype="float32", allow_oom=True,
    )  # fmt: skip
    got = {path: pl[1] for path, pl in p.stages[0].param_placements.items()}
    vocab = {
        path
        for path in got
        if path.endswith(
            ("embed_tokens.weight", "word_embeddings.weight", "lm_head.weight")
        )
        or path == "cls.predictions.bias"
    }
    assert vocab and all(got[path] == "R" for path in vocab), got
    want = {path: megatron_placement(path) for path in got if path not in vocab}
    assert {path: got[path] for path in want} == want
    assert sum(pl != "R" for pl in want.values()) >= 8


def test_a_tensor_parallel_seed_with_an_uneven_vocabulary_is_solved() -> None:
    """The automatic search's Megatron seed (`planner.intra.megatron.seed_filters`) on a
    model whose vocabulary tp does not divide: solved, with the embedding and LM head
    replicated on the tensor-parallel axis. Before, its parameter-state bound was infinite
    (no placement allowed) and the seed was skipped."""
    spec = SPECS["llama"].replace("vocab_size=128", "vocab_size=130")
    graph = trace(*build_model(spec, batch=BATCH, device="meta"))
    cluster = Cluster.from_spec("1x4xA100-80GB")
    layers = [(0, len(graph.ops) - 1)]
    layer_of = bd.layer_of_nodes(graph, layers)
    profiles = stage_solves.profiles_for(
        graph,
        LogicalMesh(cluster, (1, 4), (1, 4)),
        layer_of,
        bd.boundary_values(graph, layer_of, 1),
        1,
        num_microbatches=1,
        budget=cluster.device.memory_bytes,
        optimizer="adam_mixed",
        seeds=[Seed(axes_filter(1, None), ())],
        seeds_only=True,
    )
    assert len(profiles) == 1
    got = {p: pl[1] for p, pl in profiles[0].solution.param_placements.items()}
    assert got["model.embed_tokens.weight"] == got["lm_head.weight"] == "R"
    assert got["model.layers.0.self_attn.o_proj.weight"] == "S(1)"


@functools.cache
def _plans(name: str) -> dict[str, Any]:
    """The model's manual plans (`MANUAL`: tp4, dp4, pp2 x dp2) and its automatic plan for 4
    CPU processes; for `A100_CHECKED`, the automatic plan for 4 A100s is checked to be a valid
    plan of the model."""
    spec = SPECS[name]
    kw = {"global_batch": BATCH, "dtype": "float32", "allow_oom": True}
    one = "1x4xA100-80GB"
    # one micro-batch size (4 rows): the search over sizes is tested elsewhere (tests/test_plan.py)
    auto = {"global_batch": BATCH, "dtype": "float32", "microbatch_size": 4}
    if name in A100_CHECKED:
        plan(spec, one, **auto).check_model(_fingerprint(spec), spec)
    # two micro-batches of 4 rows each, as the automatic plan's: a rank traces each model once
    # (`single_device.trainer` shares a trace per micro-batch shape; a trace of a transformers
    # model in every rank was a third of this launch's samples)
    grids = {"tp4": (1, 4, 1, 2), "dp4": (4, 1, 1, 2), "pp2_dp2": (2, 1, 2, 2)}
    out = {}
    for m in MANUAL[name]:
        dp, tp, pp, mb = grids[m]
        out[m] = manual_plan(spec, one, dp=dp, tp=tp, pp=pp, num_microbatches=mb, **kw)
    return out | {"auto_cpu": plan(spec, cpu_cluster(4), **auto)}


def _fingerprint(spec: str) -> str:
    model, batch = build_model(spec, batch=1, device="meta")
    return trace(model, batch).fingerprint()


def _model_and_batches(spec: str) -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    model, b = build_model(spec, batch=BATCH, device="cpu")
    return model, _random_batches(tuple(b), STEPS, seed=1)


def _train(plans: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Body of every rank: per model, each plan's losses and full parameters after `STEPS` SGD
    steps (one launch for every model: a launch costs several seconds)."""
    import logging

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    for spec, by_name in plans.items():
        for name, p in by_name.items():
            model, batches = _model_and_batches(spec)
            # the automatic plan compiled (`COMPILED`), the others eager
            # (`single_device.train_plan`)
            compiled = name == "auto_cpu" and spec in {SPECS[m] for m in COMPILED}
            out[spec, name] = single_device.train_plan(
                p, model, batches, LR, spec, compile=compiled
            )
    return out


@pytest.mark.slow
def test_trains_like_one_device() -> None:
    """Every model of `SPECS` under its manual plans (`MANUAL`: tensor-parallel tp4,
    data-parallel dp4, two pipeline stages of dp2) and the automatic plan for 4 CPU processes
    (compiled for `COMPILED`), and `WIDE_MIXTRAL`'s plan for 4 A100s, which shards its experts,
    on 4 gloo processes: 3 SGD steps give one device's losses and parameters within 1e-5."""
    plans = {SPECS[m]: _plans(m) for m in SPECS}
    wide = plan(
        WIDE_MIXTRAL,
        "1x4xA100-80GB",
        global_batch=BATCH,
        dtype="float32",
        microbatch_size=BATCH,
    )
    weights = [
        s["inputs"][1]
        for stage in wide.stages
        for n, s in stage.node_strategies.items()
        if n.startswith("grouped_mm_fallback")
    ]
    assert any(p != "R" for w in weights for p in w), weights
    plans[WIDE_MIXTRAL] = {"auto_a100": wide}
    ranks = launch(_train, 4, args=(plans,), timeout_s=900)
    for model_name, spec in [*SPECS.items(), ("wide_mixtral", WIDE_MIXTRAL)]:
        model, batches = _model_and_batches(spec)
        ref_losses, ref_params = single_device.train(
            model,
            batches,
            torch.optim.SGD(model.parameters(), lr=LR),
            lambda m, b: m(input_ids=b[0], labels=b[1]).loss,  # transformers' own call
        )
        for name in plans[spec]:
            params = {}
            for r in ranks:
                got = r[spec, name]["losses"]
                assert got == pytest.approx(ref_losses, rel=1e-5), (model_name, name)
                compiled = name == "auto_cpu" and model_name in COMPILED
                assert r[spec, name]["compiled"] == compiled, (model_name, name)
                params |= {
                    k: torch.from_numpy(v) for k, v in r[spec, name]["params"].items()
                }
            single_device.assert_same_parameters(params, ref_params)
