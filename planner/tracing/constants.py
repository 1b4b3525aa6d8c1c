"""Tensors a model makes from data in its forward (``torch.tensor(0)``, Falcon's and GraniteMoE's
forwards do), written into the traced graph as the factory ops that make them.

make_fx keeps such a tensor as an attribute of the graph module (a ``get_attr`` node, copied by
``aten.lift_fresh_copy``). The planner prices ops and the runtime places their outputs; an
attribute is neither. A tensor whose elements are all one value (or none) is the factory op
``aten.full(shape, value)`` (the runtime creates factory ops' outputs as plain tensors and places
them, `runtime.executor`); any other is an error naming where it was made.
"""

from __future__ import annotations

import torch

from cost_models.errors import MeshplanError

aten = torch.ops.aten


def inline_constants(gm: torch.fx.GraphModule) -> None:
    """Replace every constant tensor of `gm` read through ``aten.lift_fresh_copy`` by an
    ``aten.full`` of its shape, value, dtype and device (module docstring)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        copies = [u for u in node.users if u.target is aten.lift_fresh_copy.default]
        flat = value.detach().flatten()
        uniform = value.numel() == 0 or bool((flat == flat[0]).all())
        if not uniform or len(copies) != len(node.users):
            where = next(iter(node.users), node).meta.get("custom", {})
            raise MeshplanError(
                f"the model makes a tensor from data in its forward ({tuple(value.shape)}, "
                f"{value.dtype}, in module {where.get('module_path') or '<root>'!r}); meshplan "
                "can trace only constants of one value there: register it as a buffer "
                "(module.register_buffer) or build it with torch.full / torch.arange"
            )
        for copy in copies:
            with gm.graph.inserting_before(copy):
                full = gm.graph.call_function(
                    aten.full.default,
                    (list(value.shape), flat[0].item() if value.numel() else 0),
                    {"dtype": value.dtype, "device": value.device, "pin_memory": False},
                )
            full.meta = dict(copy.meta)
            copy.replace_all_uses_with(full)
            gm.graph.erase_node(copy)
        gm.graph.erase_node(node)
        delattr(gm, node.target)
        changed = True
    if changed:
        gm.recompile()
