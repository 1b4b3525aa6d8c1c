"""runtime.dropout: plain-PyTorch models with dropout, and with in-place ops, train under plans to
the losses and parameters of one device.

Ground truth: one device, ``torch.manual_seed(SEED)`` then 3 SGD steps of ``model(*batch)``
(`single_device.train`), every dropout drawing its mask from the default generator at the whole
batch's shape. Two plain-PyTorch models (module names follow GPT's, so Megatron's placements
apply to them):

* `DropoutGPT`: embedding, two pre-norm blocks, ``nn.Dropout(0.1)`` after the embedding and
  after each attention and MLP, and attention dropout
  (``F.scaled_dot_product_attention(dropout_p=0.1)``, PyTorch's math path on the CPU);
* `InplaceNet`: ``nn.ReLU(inplace=True)``, ``nn.Dropout(0.1, inplace=True)``, residuals as
  ``h += x`` and ``x.masked_fill_(...)`` over padding tokens.

Plans, all on 4 gloo processes in one launch: data parallel (dp4), tensor x data parallel
(tp2 x dp2), two pipeline stages of dp2 with 2 micro-batches (torch.distributed.pipelining), the
same with per-block recomputation on our own runner (the recomputed forward must reuse the
masks), and the automatic plan for a CPU cluster. Control: dp4 with every rank drawing its own
masks (the runtime before `runtime.dropout`) does not match, so the comparison can fail.
One case per model runs compiled (AOTAutograd, the masks as graph inputs: `COMPILED`), the
recomputed one asks for compilation and runs eagerly (the masks as checkpoint inputs), the others
run eagerly (the same arithmetic; AOTAutograd's tracing was most of this launch's time).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import single_device
import torch
import torch.nn.functional as F
from profiles import cpu_cluster
from torch import nn

from cost_models.errors import MeshplanError
from planner import plan, trace
from planner.plans.manual import manual_plan
from runtime.dropout import DropoutMasks, fused_dropout, random_sites
from runtime.launch import launch
from runtime.train import _random_batches

V, H, S, BATCH = 64, 32, 8, 8
LR, STEPS, SEED = 0.1, 3, 5
P = 0.1
#: the cases run compiled: the pipeline (masks per micro-batch and stage as graph inputs) and
#: tensor x data parallel over the in-place ops (functionalised by AOTAutograd)
COMPILED = {("dropout_gpt", "pp2_dp2"), ("inplace", "tp2_dp2")}


class Block(nn.Module):
    """A pre-norm transformer block of plain PyTorch modules with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn, self.mlp = nn.Module(), nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.mlp.fc, self.mlp.proj = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.drop = nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.attn.qkv(self.ln1(x)).view(B, T, 3, 4, H // 4)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        p = P if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.attn.proj(a.transpose(1, 2).reshape(B, T, H)))
        return x + self.drop(self.mlp.proj(F.gelu(self.mlp.fc(self.ln2(x)))))


class DropoutGPT(nn.Module):
    """Embedding, two `Block`s, final norm, LM head, cross-entropy loss."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.drop = nn.Dropout(P)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class InplaceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.mlp = nn.Module()
        self.mlp.fc, self.mlp.proj = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(P, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.mlp.proj(self.act(self.mlp.fc(self.ln(x)))))
        h += x
        return h


class InplaceNet(nn.Module):
    """In-place ReLU, dropout, residual (``h += x``) and ``masked_fill_`` of padding positions."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([InplaceBlock(), InplaceBlock()])
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        x.masked_fill_((idx < 4).unsqueeze(-1), 0.0)
        return F.cross_entropy(self.lm_head(x).flatten(0, 1), targets.flatten())


MODELS = {"dropout_gpt": DropoutGPT, "inplace": InplaceNet}


def _model_and_batches(name: str) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    model = MODELS[name]()
    example = (torch.randint(0, V, (BATCH, S)), torch.randint(0, V, (BATCH, S)))
    return model, _random_batches(example, STEPS, seed=1)


@functools.cache
def _plans() -> dict[str, dict[str, tuple[Any, dict]]]:
    """model -> case -> (plan, Trainer keywords); ``own_draws``: every rank draws its own."""
    kw = {"global_batch": BATCH, "dtype": "float32", "allow_oom": True}
    one = "1x4xA100-80GB"
    out: dict[str, dict[str, tuple[Any, dict]]] = {}
    for name in MODELS:
        model, batches = _model_and_batches(name)
        ex = batches[0]

        def manual(**k: Any) -> Any:
            return manual_plan(model, one, ex, **(kw | k))  # noqa: B023

        cases = {
            "dp4": (manual(dp=4, tp=1, pp=1, num_microbatches=1), {}),
            "tp2_dp2": (manual(dp=2, tp=2, pp=1, num_microbatches=1), {}),
            "pp2_dp2": (manual(dp=2, tp=1, pp=2, num_microbatches=2), {}),
            "auto": (
                plan(model, cpu_cluster(4), ex, global_batch=BATCH, dtype="float32"),
                {"seed": None},
            ),
        }
        if name == "dropout_gpt":
            cases["pp2_recompute_ours"] = (
                manual(dp=2, tp=1, pp=2, num_microbatches=2, recompute=True),
                {"pipeline": "ours"},
            )
            cases["dp4_own_draws"] = (cases["dp4"][0], {"own_draws": True})
        out[name] = cases
    return out


def _train(plans: dict[str, dict[str, tuple[Any, dict]]]) -> dict[str, Any]:
    """Body of every rank: per model and case, the losses and full parameters after `STEPS` SGD
    steps; with ``seed=None`` the default generator is seeded with `SEED` just before."""
    import logging

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    for name, cases in plans.items():
        for case, (p, kw) in cases.items():
            model, batches = _model_and_batches(name)
            kw = dict(kw)
            own = kw.pop("own_draws", False)
            if kw.get("seed", SEED) is None:
                torch.manual_seed(SEED)
            # compiled: `COMPILED`, and the recomputed case, whose stages must still run eagerly
            kw["compile"] = (name, case) in COMPILED or "recompute" in case
            tr = single_device.trainer(
                p, model, batches[0], name, lr=LR, **({"seed": SEED} | kw)
            )
            if own:
                for ex in tr.runner.executors.values():
                    ex.masks = None
                tr.masks = None
            losses = [tr.step(b) for b in batches]
            params = {k: v.numpy().copy() for k, v in tr.full_params().items()}
            compiled = [ex.last_run_compiled for ex in tr.runner.executors.values()]
            out[name, case] = {"losses": losses, "params": params, "compiled": compiled}
    return out


@functools.cache
def _runs() -> list[dict[str, Any]]:
    return launch(_train, 4, args=(_plans(),), timeout_s=900)


def _reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, batches = _model_and_batches(name)
    torch.manual_seed(SEED)
    return single_device.train(
        model, batches, torch.optim.SGD(model.parameters(), lr=LR)
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_plans_train_like_one_device(name: str) -> None:
    """Every plan: 3 steps' losses within 1e-5 (relative) and parameters within 1e-5 of one
    device; the control (own draws) differs."""
    ref_losses, ref_params = _reference(name)
    ranks = _runs()
    for case in _plans()[name]:
        got = [r[name, case] for r in ranks]
        if case == "dp4_own_draws":
            assert got[0]["losses"][0] != pytest.approx(ref_losses[0], rel=1e-5)
            continue
        params: dict[str, torch.Tensor] = {}
        for r in got:  # a pipeline stage's ranks hold that stage's parameters
            assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), case
            # the AOTAutograd graphs ran where compiled (recomputed stages run eagerly)
            assert all(r["compiled"]) == ((name, case) in COMPILED), case
            params |= {k: torch.from_numpy(v) for k, v in r["params"].items()}
        single_device.assert_same_parameters(params, ref_params)


# ---------------------------------------------------------------------- no processes


class _Masks(nn.Module):
    """Dropout on a (B, S, H) tensor and on a transposed (S, B, H) one; forward hooks record
    each dropout's kept positions."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Dropout(P), nn.Dropout(P)
        self.seen: list[torch.Tensor] = []
        for d in (self.a, self.b):
            d.register_forward_hook(lambda m, i, o: self.seen.append(o != 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x.exp())
        return self.b(h.transpose(0, 1).exp()).sum()


def test_global_samples_are_the_masks_one_device_draws() -> None:
    """Two steps of the samples `DropoutMasks` draws (at the global batch of 4 micro-batches) are
    the masks eager ``nn.Dropout`` draws after ``torch.manual_seed(SEED)``, the transposed input
    included (drawn in memory order); each site's batch dimension is found (0, then 1)."""
    model, x = _Masks(), torch.randn(8, 6, 5)
    micro, whole = trace(model, (x[:2],)), trace(model, (x,))
    masks = DropoutMasks(micro, whole, 4, seed=SEED)
    assert [s.batch_dim for s in masks.sites] == [0, 1]
    torch.manual_seed(SEED)
    for _ in range(2):
        model.seen.clear()
        model(x)
        got = [sample != 0 for _, sample in masks.global_samples()]
        assert len(got) == 2
        for mine, eager in zip(got, model.seen):
            assert torch.equal(mine, eager)
    # a contiguous draw at the transposed site's shape is not the same mask
    gen = torch.Generator().manual_seed(SEED)
    torch.empty(8, 6, 5).bernoulli_(1 - P, generator=gen)
    flat = torch.empty(6, 8, 5).bernoulli_(1 - P, generator=gen) != 0
    torch.manual_seed(SEED)
    model.seen.clear()
    model(x)
    assert not torch.equal(flat, model.seen[1])


class _Samplers(nn.Module):
    """The in-place samplers of PhiMoE's sparse mixer (``exponential_`` on an ``empty_like``,
    ``rand_like``) and the other elementwise ones torch has; hooks keep what eager drew."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = [
            torch.empty_like(x).exponential_(),
            torch.rand_like(x),
            torch.empty_like(x).cauchy_(),
            torch.empty_like(x).log_normal_(),
            torch.empty_like(x).geometric_(0.5),
        ]
        return sum((x * s).sum() for s in self.seen)


def test_every_elementwise_sampler_is_a_site() -> None:
    """Each sampler of `_Samplers` is a random site (so a plan replays one device's draws
    instead of each rank drawing its own, or failing for want of a DTensor rule: PhiMoE) and
    its global sample is eager's after ``torch.manual_seed(SEED)``."""
    model, x = _Samplers(), torch.randn(8, 5)
    masks = DropoutMasks(trace(model, (x[:2],)), trace(model, (x,)), 4, seed=SEED)
    assert [s.target._opname for s in masks.sites] == [
        "exponential",
        "rand_like",
        "cauchy",
        "log_normal",
        "geometric",
    ]
    assert all(s.drawable and s.batch_dim == 0 for s in masks.sites)
    torch.manual_seed(SEED)
    model(x)
    got = [sample for _, sample in masks.global_samples()]
    for mine, eager in zip(got, model.seen, strict=True):
        assert torch.equal(mine, eager)


def test_sites_need_one_batch_dimension() -> None:
    """A sample not shaped by the batch is every micro-batch's (no batch dimension); traces
    whose random ops differ are refused."""

    class Fixed(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ torch.rand(5, 5)).sum()

    x = torch.randn(4, 5)
    sites = random_sites(trace(Fixed(), (x[:2],)), trace(Fixed(), (x,)), 2)
    assert [(s.batch_dim, s.shape) for s in sites] == [(None, (5, 5))]
    with pytest.raises(MeshplanError, match="random ops differ"):
        random_sites(trace(Fixed(), (x,)), trace(_Masks(), (torch.randn(2, 3, 5),)), 2)


def test_dropout_is_priced_as_memory_traffic() -> None:
    """The mask costs no FLOPs; backward keeps it (the scaled mask the product saves) and the
    dropped activation (saved by the next linear): training saves two more B x F float32
    tensors than evaluation."""

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.drop, self.out = (
                nn.Linear(8, 16),
                nn.Dropout(P),
                nn.Linear(16, 4),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.drop(torch.relu(self.fc(x)))).square().mean()

    model, x = Mlp(), torch.randn(4, 8)
    train = trace(model, (x,))
    masks = [n for n in train.nodes if n.target == "aten.bernoulli.p"]
    assert len(masks) == 1 and masks[0].fwd_flops == masks[0].bwd_flops == 0
    assert masks[0].bytes_written == 4 * 16 * 4
    evaluation = trace(model.eval(), (x,))
    extra = train.saved_activation_bytes() - evaluation.saved_activation_bytes()
    assert extra == 2 * 4 * 16 * 4


def test_kernels_drawing_inside_warn_once() -> None:
    """``native_dropout`` and a fused attention kernel with dropout_p > 0 are named, once."""

    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.fc(x).view(2, 4, 2, 4).transpose(1, 2).contiguous()
            sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            o = sdpa(q, q, q, 0.1)[0]
            return o.sum() + torch.native_dropout(x, 0.1, True)[0].sum()

    graph = trace(Fused(), (torch.randn(2, 4, 8),))
    assert fused_dropout(graph) == [
        "_scaled_dot_product_flash_attention_for_cpu",
        "native_dropout",
    ]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        DropoutMasks(graph, graph, 1, seed=0)
        DropoutMasks(graph, graph, 1, seed=0)
    assert len([w for w in seen if "inside their kernels" in str(w.message)]) == 1
    # F.scaled_dot_product_attention with dropout on the CPU is PyTorch's math path: reproducible
    gpt = trace(DropoutGPT(), _model_and_batches("dropout_gpt")[1][0])
    assert not fused_dropout(gpt)
    assert len(random_sites(gpt, gpt, 1)) == 1 + 2 * 3
