"""Hugging Face model types as a new user runs them from the command line (issue 20).

For each small config below: ``meshplan plan hf:... --cluster 1x4xA100-80GB --batch 8 --dtype
float32 --json FILE`` in a fresh process, then ``meshplan run hf:... --plan FILE --steps 3`` on 4
local gloo processes, and the same 3 SGD steps of the same model on the same batches on one device
(`runtime.train.seeded_model_and_batches`, the loss as transformers computes it). A model passes
when both commands succeed and every loss is within 1e-5 (relative) of one device's. The tests
train a few of these under fixed plans (`tests/test_hf.py`); this walks more model types, each
under the plan the planner picks for it.

    python -m benchmarks.hf_zoo [--only TYPE ...] [--json FILE]

Results go to ``benchmarks/results/hf-zoo.json`` with the date and the versions of torch and
transformers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.records import RESULTS

_D = "hidden_size=64,intermediate_size=96,num_hidden_layers=2,num_attention_heads=4"
_KV = "num_key_value_heads=2"
_V = "vocab_size=128,seq=16"
#: model type -> its small config (the keys beyond `_D` are what the type needs to build small)
MODELS = {
    "llama": f"{_D},{_KV},{_V}",
    "mistral": f"{_D},{_KV},{_V}",
    "qwen2": f"{_D},{_KV},{_V}",
    "qwen3": f"{_D},{_KV},head_dim=16,{_V}",
    "gemma": f"{_D},{_KV},head_dim=16,{_V}",
    "gemma3_text": f"{_D},{_KV},head_dim=16,{_V},attn=eager",
    "phi": f"{_D},{_V}",
    "phi3": f"{_D},{_KV},{_V},pad_token_id=0",
    "olmo2": f"{_D},{_KV},{_V}",
    "stablelm": f"{_D},{_KV},{_V}",
    "cohere": f"{_D},{_KV},{_V}",
    "gpt_neox": f"{_D},{_V}",
    "gpt2": f"n_embd=64,n_layer=2,n_head=4,n_positions=16,{_V}",
    "gpt_bigcode": f"n_embd=64,n_layer=2,n_head=4,n_positions=16,{_V}",
    "opt": f"hidden_size=64,ffn_dim=96,num_hidden_layers=2,num_attention_heads=4,{_V},"
    "word_embed_proj_dim=64",
    "falcon": f"hidden_size=64,num_hidden_layers=2,num_attention_heads=4,{_V}",
    "bert": f"{_D},{_V},task=masked-lm",
    "roberta": f"{_D},{_V},task=masked-lm,pad_token_id=1",
    "mixtral": f"{_D},{_KV},{_V},num_local_experts=4",
    "qwen2_moe": f"{_D},{_KV},{_V},moe_intermediate_size=32,"
    "shared_expert_intermediate_size=64,num_experts=4,num_experts_per_tok=2",
    "qwen3_moe": f"{_D},{_KV},{_V},moe_intermediate_size=32,num_experts=4,"
    "num_experts_per_tok=2",
    "granitemoe": f"{_D},{_KV},{_V},num_local_experts=4,num_experts_per_tok=2",
    "deepseek_v3": f"{_D},{_KV},{_V},moe_intermediate_size=32,n_routed_experts=4,"
    "num_experts_per_tok=2,n_shared_experts=1,first_k_dense_replace=1,kv_lora_rank=16,"
    "q_lora_rank=16,qk_rope_head_dim=8,qk_nope_head_dim=8,v_head_dim=16,n_group=1,topk_group=1",
}
CLUSTER, BATCH, STEPS, LR, REL = "1x4xA100-80GB", 8, 3, 0.1, 1e-5


def one_device_losses(spec: str) -> list[float]:
    """The losses of `meshplan run`'s training (same model, batches and SGD) on one device."""
    from planner.tracing.calls import call_for_loss
    from runtime.train import seeded_model_and_batches

    model, batches = seeded_model_and_batches(spec, BATCH, STEPS)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for b in batches:
        loss = call_for_loss(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "runtime.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return proc, time.perf_counter() - t0


def _last_error(proc: subprocess.CompletedProcess) -> str:
    lines = [
        ln for ln in proc.stderr.splitlines() if not ln.startswith("[transformers]")
    ]
    return (lines or ["(no output)"])[-1][:300]


def run_model(kind: str) -> dict[str, Any]:
    """Plan, run and compare one model type (module docstring)."""
    spec = f"hf:{kind}:{MODELS[kind]}"
    out: dict[str, Any] = {"model": kind, "spec": spec, "ok": False}
    with tempfile.TemporaryDirectory() as tmp:
        plan_file, losses_file = Path(tmp) / "plan.json", Path(tmp) / "losses.json"
        proc, out["plan_s"] = _cli(
            "plan", spec, "--cluster", CLUSTER, "--batch", str(BATCH),
            "--dtype", "float32", "--quiet", "--json", str(plan_file),
        )  # fmt: skip
        if proc.returncode != 0:
            return out | {"error": f"plan: {_last_error(proc)}"}
        plan = json.loads(plan_file.read_text())
        out["plan"] = [
            f"{s['submesh']} {s['logical_mesh']} {s.get('dp_tp')}"
            for s in plan["stages"]
        ]
        proc, out["run_s"] = _cli(
            "run", spec, "--plan", str(plan_file), "--steps", str(STEPS),
            "--json", str(losses_file),
        )  # fmt: skip
        if proc.returncode != 0:
            return out | {"error": f"run: {_last_error(proc)}"}
        got = json.loads(losses_file.read_text())["losses"]
    ref = one_device_losses(spec)
    err = max(abs(g - r) / abs(r) for g, r in zip(got, ref))
    return out | {
        "losses": got,
        "one_device": ref,
        "max_rel_err": err,
        "ok": err <= REL,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=list(MODELS), metavar="TYPE")
    ap.add_argument("--json", default=str(RESULTS / "hf-zoo.json"))
    args = ap.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()  # the small vocabularies' token-id notices
    rows = []
    for kind in args.only or list(MODELS):
        r = run_model(kind)
        rows.append(r)
        err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else "-"
        print(
            f"{kind:<12} {'ok' if r['ok'] else 'FAILED':<6} rel err {err:<8} "
            f"plan {r.get('plan_s', 0):5.1f} s  run {r.get('run_s', 0):5.1f} s  "
            f"{r.get('error', '')}",
            flush=True,
        )
    passed = sum(r["ok"] for r in rows)
    print(f"{passed} of {len(rows)} model types trained to one device's losses")
    record = {
        "benchmark": "hf_zoo",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cluster": CLUSTER,
        "global_batch": BATCH,
        "steps": STEPS,
        "rel_tolerance": REL,
        "models": rows,
    }
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
