"""A deep stack traced three units deep and repeated (`planner.tracing.repeat`) equals the full
trace node for node, and a model whose short trace does not repeat keeps the full trace."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.fx.node import map_arg

from planner import trace
from planner.models import build_model
from planner.tracing import repeat

MIXTRAL = "mixtral:hidden=8,layers=5,heads=2,kv_heads=1,ffn=8,experts=2,seq=4,vocab=16,group_size=4"
DEEPSEEK = (
    "deepseek-moe:hidden=16,layers=6,heads=2,kv_heads=1,ffn=16,experts=4,shared=1,top_k=2,"
    "expert_ffn=8,dense_layers=2,seq=8,vocab=32"
)
#: (spec, rows of the example batch: one row, where an op can vanish, and two; readings of the
#: stack traced short, `repeated_trace`: 2 where the first does not repeat)
REPEATING = [
    ("gpt:hidden=8,layers=5,heads=2,seq=4,vocab=16", 1, 1),
    # dropout: random ops, and the graph functionalized (placeholders arg0_1, ...)
    (
        "gpt:hidden=8,layers=6,heads=2,seq=4,vocab=16,attn=explicit,attn_dropout=0.1",
        2,
        1,
    ),
    ("llama:hidden=8,layers=4,heads=2,kv_heads=1,ffn=8,seq=4,vocab=16", 2, 1),
    # the blocks' auxiliary losses stacked after the stack: one per unit of the whole model
    (MIXTRAL, 1, 1),
    # two dense blocks, then mixtures: the stack repeats from block 2
    (DEEPSEEK, 2, 1),
    # mixture and dense blocks alternate (period 2); an odd count starts the stack at block 1
    ("moe:hidden=8,layers=9,heads=2,seq=4,vocab=16,experts=2", 1, 1),
    # an even count: the first unit's mixture starts the auxiliary losses' running sum, which
    # the next unit reads as it does not read its own (as in every model of the MoE suite):
    # the stack starts a unit later
    ("moe:hidden=8,layers=10,heads=2,seq=4,vocab=16,experts=2", 2, 2),
]
_HF = "hidden_size=16,intermediate_size=24,num_attention_heads=2,vocab_size=32,seq=4"
_QWEN2_MOE = "num_experts=2,num_experts_per_tok=1,moe_intermediate_size=8"
_SLIDING = "use_sliding_window=True,max_window_layers=2,sliding_window=2"
#: Hugging Face models (their longest ModuleList is the stack), with the stack expected
HF_REPEATING = [
    # dropout on by default: functionalized; the stack is transformer.h
    (
        "hf:gpt2:n_embd=16,n_layer=5,n_head=2,vocab_size=32,n_positions=8,seq=4",
        1,
        ("transformer.h", 0, 1, 5),
    ),
    (
        f"hf:llama:{_HF},num_hidden_layers=5,num_key_value_heads=1",
        2,
        ("model.layers", 0, 1, 5),
    ),
    (
        f"hf:bert:{_HF},num_hidden_layers=4,task=masked-lm",
        2,
        ("bert.encoder.layer", 0, 1, 4),
    ),
    (
        f"hf:qwen2_moe:{_HF},num_hidden_layers=4,num_key_value_heads=1,{_QWEN2_MOE},"
        + "shared_expert_intermediate_size=8",
        1,
        ("model.layers", 0, 1, 4),
    ),
    # full attention in the first two layers, a sliding window after: the stack starts at 2
    (
        f"hf:qwen2:{_HF},num_hidden_layers=6,num_key_value_heads=1,{_SLIDING}",
        2,
        ("model.layers", 2, 1, 4),
    ),
    # sliding and full attention alternate: period 2
    (
        f"hf:gemma2:{_HF},num_hidden_layers=8,num_key_value_heads=1,head_dim=8,sliding_window=2,"
        + "attn=eager",
        1,
        ("model.layers", 0, 2, 4),
    ),
]


def _fx(gm: torch.fx.GraphModule) -> list[tuple]:
    out = []
    for n in gm.graph.nodes:
        meta = n.meta.get("tensor_meta")
        out.append(
            (
                n.name,
                n.op,
                str(n.target),
                repr(map_arg((n.args, n.kwargs), lambda x: x.name)),
                n.meta.get("custom"),
                repeat._outputs(n),
                None if meta is None else (meta.shape, meta.dtype, meta.stride),
            )
        )
    return out


def _full_and_repeated(model: nn.Module, batch, monkeypatch) -> tuple:
    made = []
    expand = repeat.expand
    monkeypatch.setattr(
        repeat, "expand", lambda *a: made.append(expand(*a)) or made[-1]
    )
    repeated = trace(model, batch)
    monkeypatch.setattr(repeat, "block_pattern", lambda m: None)
    full = trace(model, batch)
    return repeated, full, made


@pytest.mark.parametrize(("spec", "batch", "tries"), REPEATING)
def test_repeated_trace_equals_full_trace(
    spec: str, batch: int, tries: int, monkeypatch
) -> None:
    monkeypatch.setattr(repeat, "_READ_LATER", set())
    model, example = build_model(spec, batch=batch, device="meta")
    repeated, full, made = _full_and_repeated(model, example, monkeypatch)
    # the short trace was repeated, at the reading the table expects
    assert made[-1] is not None and len(made) == tries
    assert _fx(repeated.gm) == _fx(full.gm)
    assert repeated.gm.code == full.gm.code
    assert [dataclasses.asdict(n) for n in repeated.nodes] == [
        dataclasses.asdict(n) for n in full.nodes
    ]
    assert repeated.params == full.params and repeated.buffers == full.buffers
    assert repeated.fingerprint() == full.fingerprint()


def _same_as_full(spec: str, batch: int, memo: set, monkeypatch) -> list[int]:
    """Trace `spec` with `memo` as the readings remembered; assert the graph is the full trace's;
    the first block of each reading tried."""
    model, example = build_model(spec, batch=batch, device="meta")
    tried = []
    short = repeat._short_and_expanded
    with monkeypatch.context() as m:
        m.setattr(repeat, "_READ_LATER", memo)
        m.setattr(
            repeat,
            "_short_and_expanded",
            lambda *a: tried.append(a[-1].start) or short(*a),
        )
        repeated, full, made = _full_and_repeated(model, example, m)
    assert made[-1] is not None and len(made) == len(tried)
    assert _fx(repeated.gm) == _fx(full.gm)
    assert [dataclasses.asdict(n) for n in repeated.nodes] == [
        dataclasses.asdict(n) for n in full.nodes
    ]
    return tried


def test_a_model_read_later_before_is_read_later_first(monkeypatch) -> None:
    """The MoE whose stack repeats a unit later, traced at one batch, is read that way first at
    the next (one short trace, not two), with the full trace's graph. A model whose first
    reading repeats, remembered as read later: read later, the same graph (each reading that
    repeats gives the full trace)."""
    memo: set = set()
    moe = REPEATING[-1][0]  # period 2 from block 0; read from block 2
    assert _same_as_full(moe, 2, memo, monkeypatch) == [0, 2]
    assert _same_as_full(moe, 3, memo, monkeypatch) == [2]
    llama = "llama:hidden=8,layers=6,heads=2,kv_heads=1,ffn=8,seq=4,vocab=16"
    model, _ = build_model(llama, batch=2, device="meta")
    assert _same_as_full(llama, 2, memo, monkeypatch) == [0]
    memo.add((type(model), repeat.block_pattern(model)))
    assert _same_as_full(llama, 3, memo, monkeypatch) == [1]


@pytest.mark.parametrize(("spec", "batch", "stack"), HF_REPEATING)
def test_hf_repeated_trace_equals_full_trace(spec, batch, stack, monkeypatch) -> None:
    """What the layers' attributes say differs (sliding or full attention) ends or breaks the
    repeated stack, and the repeated trace equals the full trace."""
    pytest.importorskip("transformers")
    model, _ = build_model(spec, batch=1, device="meta")
    assert repeat.block_pattern(model) == stack
    test_repeated_trace_equals_full_trace(spec, batch, 1, monkeypatch)


def test_block_pattern() -> None:
    def pattern(spec: str):
        return repeat.block_pattern(build_model(spec, batch=1, device="meta")[0])

    assert pattern(REPEATING[0][0]) == ("blocks", 0, 1, 5)
    assert pattern(REPEATING[4][0]) == ("blocks", 2, 1, 4)
    assert pattern(REPEATING[5][0]) == ("blocks", 1, 2, 4)
    # three units or fewer: the short trace would be the whole one
    assert pattern("gpt:hidden=8,layers=3,heads=2,seq=4,vocab=16") is None
    # a model that does not declare its blocks index-free is traced whole
    assert pattern("wresnet-tiny") is None


class _Skip(nn.Module):
    """Each block also adds the output of the block two back: not one unit's reference."""

    repeats_blocks = True

    def __init__(self, layers: int, keep: slice | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(layers))
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [x, x]
        for block in self.blocks:
            outs.append(block(outs[-1]) + (outs[-2] if self.keep is None else 0))
        if self.keep is not None:  # a list of some units' values, not one per unit
            return torch.stack(outs[2:][self.keep]).sum()
        return outs[-1].sum()


@pytest.mark.parametrize("keep", [None, slice(1, None)])
def test_stack_that_does_not_repeat_keeps_full_trace(keep, monkeypatch) -> None:
    model = _Skip(6, keep)
    repeated, full, made = _full_and_repeated(model, (torch.randn(2, 4),), monkeypatch)
    # the stack does not repeat from block 0; a unit later it repeats where only the list
    # of values from block 1 on made it differ (then one per unit of that stack)
    assert made[0] is None and len(made) == 2 and (made[1] is None) == (keep is None)
    assert _fx(repeated.gm) == _fx(full.gm)
    assert len([n for n in repeated.ops if n.target == "aten.addmm.default"]) == 6
