"""Ground truth for the runtime tests: the same training on one device, and the comparison."""

from __future__ import annotations

from typing import Any

import torch


def train(
    model: torch.nn.Module,
    batches: list,
    optimizer: torch.optim.Optimizer,
    loss_of=lambda model, batch: model(*batch),
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step losses and the parameters after training `model` on `batches` on one device
    (``loss_of(model, batch)`` is the step's loss)."""
    losses = []
    for b in batches:
        loss = loss_of(model, b)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}


def assert_same_parameters(
    got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rel: float = 1e-5
) -> None:
    """Every parameter present, each within `rel` relative (Frobenius) error of the reference
    (absolute `rel * 1e-3` for a reference of norm below 1e-3)."""
    assert set(got) == set(ref)
    for k, p in ref.items():
        # A parameter whose gradient is zero in exact arithmetic (attention's key bias) stays
        # at a norm of rounding noise: measure it against 1e-3, not against that noise.
        err = (got[k] - p).norm() / p.norm().clamp_min(1e-3)
        assert err < rel, (k, err.item())


#: this process's traces, per (model key, micro-batch shapes): `trainer`
_GRAPHS: dict[tuple, Any] = {}


def trainer(plan, model: torch.nn.Module, batch: Any, key: str, **kw: Any) -> Any:
    """`runtime.train.Trainer` of `model` under `plan`, given the model's trace when a trainer of
    this process already traced the model `key` names (its spec) at the plan's micro-batch: a
    launch that trains one model under several plans traces it once per micro-batch size, not
    once per plan (the trace is a second or more of a small model's time in each rank)."""
    from runtime.train import Trainer, split_batch

    micro = split_batch(batch, plan.num_microbatches)[0]
    k = (key, tuple(tuple(t.shape) for t in micro))
    tr = Trainer(plan, model, batch, graph=_GRAPHS.get(k), **kw)
    _GRAPHS[k] = tr.graph
    return tr


def train_plan(
    plan,
    model: torch.nn.Module,
    batches: list,
    lr: float,
    key: str,
    compile: bool = True,
) -> dict:
    """In a rank of a launched group: the losses of SGD steps on `batches` under `plan`, this
    rank's full parameters afterwards (numpy arrays, for the launcher to send back) and whether
    every stage's last run was compiled.
    ``compile=False``: the stages run eagerly (the same arithmetic, `runtime.train.Trainer`);
    the model-zoo launches compile one plan per model (`tests/test_hf.py`: per model family)
    and run the others eagerly, since AOTAutograd's tracing is about three quarters of a small
    model's time in a launch. `key`: the model's spec, to share its traces (`trainer`)."""
    tr = trainer(plan, model, batches[0], key, lr=lr, compile=compile)
    losses = [tr.step(b) for b in batches]
    return {
        "losses": losses,
        "params": {k: v.numpy().copy() for k, v in tr.full_params().items()},
        "compiled": all(ex.last_run_compiled for ex in tr.runner.executors.values()),
    }


def held_state_bytes(
    params: dict[str, Any], state: dict[Any, dict[str, Any]]
) -> dict[str, tuple[int, int, int]]:
    """Per parameter, the bytes this rank holds of its weights, its gradient and its optimizer
    state (the step counter aside): the local shards of DTensors, plain tensors whole."""

    def local(t: Any) -> int:
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        return t.numel() * t.element_size()

    return {
        k: (
            local(p),
            local(p.grad),
            sum(local(v) for n, v in state[p].items() if n != "step"),
        )
        for k, p in params.items()
    }


def counted_adam_steps(
    plan,
    model: torch.nn.Module,
    batches: list,
    key: str,
    lr: float,
    compile: bool = True,
) -> dict[str, Any]:
    """In a rank of a launched group: three Adam steps under `plan` (the second under a
    `runtime.comm_count.CommCounter`), then a fourth forward and backward and the bytes this
    rank holds after it (`held_state_bytes`). Losses, full parameters, the counted
    collectives, the held bytes, whether every stage ran compiled, and the executors'
    mismatches (values whose placement differed from the plan). ``compile``: as in
    `train_plan`."""
    from runtime.comm_count import CommCounter
    from runtime.train import split_batch

    tr = trainer(plan, model, batches[0], key, optimizer="adam", lr=lr, compile=compile)
    losses = [tr.step(batches[0])]
    with CommCounter() as counter:
        losses.append(tr.step(batches[1]))
    losses.append(tr.step(batches[2]))
    tr.runner.step(
        tr.params, split_batch(batches[0], plan.num_microbatches), tr.buffers
    )
    held = held_state_bytes(tr.params, tr.optimizer.state)
    tr.optimizer.zero_grad(set_to_none=True)
    executors = list(tr.runner.executors.values())
    return {
        "losses": losses,
        "params": {k: v.numpy().copy() for k, v in tr.full_params().items()},
        "records": counter.records,
        "held": held,
        "compiled": all(ex.last_run_compiled for ex in executors),
        "mismatches": [m for ex in executors for m in ex.mismatches],
    }


def assert_holds_priced_bytes(
    held: dict[str, tuple[int, int, int]], plan, graph, cluster: str
) -> None:
    """Per parameter of `plan`'s first stage, weights + gradients + optimizer state (`plan`'s
    optimizer) that one rank `held` against `planner.intra.fsdp_prices.param_state_bytes` of
    its planned placement (FSDP-sharded where the stage says so)."""
    from cost_models.cluster import Cluster
    from cost_models.communication import LogicalMesh
    from planner.intra import fsdp_prices as fp
    from planner.intra.prices import Option, StageSettings
    from planner.vocab.strategy import Strategy

    sp = plan.stages[0]
    s = StageSettings(
        LogicalMesh(
            Cluster.from_spec(cluster), tuple(sp.submesh), tuple(sp.logical_mesh)
        ),
        plan.num_microbatches,
        optimizer=plan.optimizer,
    )
    names = {p: n for n, p in graph.placeholder_paths.items()}
    for path, (param, grad, state) in held.items():
        meta = graph.node(names[path]).outputs[0]
        strategy = Strategy((tuple(sp.param_placements[path]),), (), "param")
        option = Option(strategy, zero=3 if path in sp.fsdp_params else 0)
        assert param + grad + state == fp.param_state_bytes(meta, option, s), path
