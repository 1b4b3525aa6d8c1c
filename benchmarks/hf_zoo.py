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
transformers; with ``--only`` the other types' rows already there are kept (each row has its
date) when they were run with the same versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
#: DeepSeek's multi-head latent attention and routed + shared experts, small
_MLA = (
    "moe_intermediate_size=32,n_routed_experts=4,num_experts_per_tok=2,n_shared_experts=1,"
    "first_k_dense_replace=1,kv_lora_rank=16,q_lora_rank=16,qk_rope_head_dim=8,"
    "qk_nope_head_dim=8,v_head_dim=16,n_group=1,topk_group=1"
)
#: an encoder-decoder config's sizes (its decoder is what the causal-LM head trains)
_SEQ2SEQ = (
    "d_model=64,decoder_layers=2,encoder_layers=2,decoder_attention_heads=4,"
    "encoder_attention_heads=4,decoder_ffn_dim=96,encoder_ffn_dim=96"
)
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
    "deepseek_v3": f"{_D},{_KV},{_V},{_MLA}",
    "deepseek_v2": f"{_D},{_KV},{_V},{_MLA}",
    "llama4_text": f"{_D},{_KV},{_V},num_local_experts=4",
    "granite": f"{_D},{_KV},{_V}",
    "gemma2": f"{_D},{_KV},head_dim=16,{_V}",
    "gemma4_text": f"{_D},{_KV},{_V}",
    "qwen3_5_text": f"{_D},{_KV},{_V}",
    "starcoder2": f"{_D},{_KV},{_V}",
    "nemotron": f"{_D},{_KV},{_V}",
    "cohere2": f"{_D},{_KV},{_V}",
    "exaone4": f"{_D},{_KV},{_V}",
    "olmo3": f"{_D},{_KV},{_V}",
    "seed_oss": f"{_D},{_KV},{_V}",
    "glm4": f"{_D},{_KV},{_V},pad_token_id=0",
    "smollm3": f"{_D},{_KV},{_V},pad_token_id=0",
    "gptj": f"n_embd=64,n_layer=2,n_head=4,rotary_dim=8,n_positions=16,{_V}",
    "codegen": f"n_embd=64,n_layer=2,n_head=4,rotary_dim=8,n_positions=16,{_V}",
    "bloom": f"hidden_size=64,n_layer=2,n_head=4,{_V}",
    "mpt": f"d_model=64,n_heads=4,n_layers=2,max_seq_len=16,{_V}",
    "olmoe": f"{_D},{_KV},{_V},num_experts=4,num_experts_per_tok=2",
    "phimoe": f"{_D},{_KV},{_V},num_local_experts=4,num_experts_per_tok=2",
    "ernie4_5_moe": f"{_D},{_KV},{_V},moe_num_experts=4,moe_k=2,moe_intermediate_size=32",
    "gpt_oss": f"{_D},{_KV},head_dim=16,{_V},num_local_experts=4,num_experts_per_tok=2",
    "qwen3_5_moe_text": f"hidden_size=64,num_hidden_layers=2,num_attention_heads=4,{_KV},"
    f"head_dim=16,{_V},num_experts=4,num_experts_per_tok=2,moe_intermediate_size=32,"
    "shared_expert_intermediate_size=64",
    "olmo": f"{_D},{_KV},{_V}",
    "helium": f"{_D},{_KV},head_dim=16,{_V}",
    "internlm3": f"{_D},{_KV},{_V}",
    "arcee": f"{_D},{_KV},{_V}",
    "apertus": f"{_D},{_KV},{_V}",
    "ernie4_5": f"{_D},{_KV},{_V}",
    "exaone": f"{_D},{_KV},{_V}",
    "bitnet": f"{_D},{_KV},{_V}",
    "doge": f"{_D},{_KV},{_V},attn=eager",  # a mask computed from parameters
    "vaultgemma": f"{_D},{_KV},head_dim=16,{_V}",
    "granite_swa": f"{_D},{_KV},{_V}",
    "granitemoeshared": f"{_D},{_KV},{_V},num_local_experts=4,shared_intermediate_size=64",
    "cohere2_moe": f"{_D},{_KV},{_V},num_experts=4",
    "glm4_moe": f"{_D},{_KV},{_V},n_routed_experts=4,num_experts_per_tok=2,"
    "moe_intermediate_size=32",
    "exaone_moe": f"{_D},{_KV},{_V},num_experts=4,num_experts_per_tok=2,"
    "moe_intermediate_size=32",
    "minimax_m2": f"{_D},{_KV},{_V},num_local_experts=4,num_experts_per_tok=2",
    # hybrids: linear attention, state-space or convolution blocks beside attention
    "minimax": f"{_D},{_KV},{_V},num_local_experts=4",
    "bamba": f"{_D},{_KV},{_V},mamba_n_heads=8,mamba_d_head=16,mamba_d_state=16,"
    "mamba_chunk_size=16",
    "qwen3_next": f"{_D},{_KV},head_dim=16,{_V},num_experts=4,num_experts_per_tok=2,"
    "moe_intermediate_size=32,shared_expert_intermediate_size=64",
    "jamba": f"{_D},{_KV},{_V},num_experts=4,num_experts_per_tok=2",
    "falcon_h1": f"{_D},{_KV},{_V}",
    "lfm2": f"{_D},{_KV},{_V}",
    "mamba": f"hidden_size=64,num_hidden_layers=2,state_size=8,{_V}",
    "mamba2": f"hidden_size=64,num_hidden_layers=2,num_heads=8,head_dim=16,state_size=16,"
    f"n_groups=1,{_V}",
    "falcon_mamba": f"hidden_size=64,num_hidden_layers=2,state_size=8,intermediate_size=128,{_V}",
    "recurrent_gemma": f"{_D},{_KV},head_dim=16,{_V},attention_window_size=16",
    # dense decoders
    "xglm": f"d_model=64,ffn_dim=96,num_layers=2,attention_heads=4,{_V}",
    "persimmon": f"{_D},{_V}",
    "glm": f"{_D},{_KV},head_dim=16,{_V},pad_token_id=0",
    "hunyuan_v1_dense": f"{_D},{_KV},head_dim=16,{_V}",
    "ministral": f"{_D},{_KV},head_dim=16,{_V}",
    "openai-gpt": f"n_embd=64,n_layer=2,n_head=4,n_positions=16,{_V}",
    "ctrl": f"n_embd=64,n_layer=2,n_head=4,n_positions=16,dff=96,{_V}",
    "modernbert-decoder": f"{_D},{_V},pad_token_id=0",
    "nanochat": f"{_D},{_KV},{_V}",
    "diffllama": f"{_D},{_KV},{_V}",
    "minicpm3": f"{_D},{_KV},{_V},q_lora_rank=16,kv_lora_rank=16,qk_nope_head_dim=8,"
    "qk_rope_head_dim=8,v_head_dim=16",
    "jais2": f"{_D},{_KV},head_dim=16,{_V}",
    "cwm": f"{_D},{_KV},head_dim=16,{_V}",
    "youtu": f"{_D},{_KV},{_V},kv_lora_rank=16,q_lora_rank=16,qk_rope_head_dim=8,"
    "qk_nope_head_dim=8,v_head_dim=16",
    "iquestcoder": f"{_D},{_KV},head_dim=16,{_V}",
    # models that make their own mask of ones when called without one
    "biogpt": f"{_D},{_V}",
    "megatron-bert": f"{_D},{_V},task=masked-lm",
    "roformer": f"{_D},embedding_size=64,{_V},task=masked-lm",
    "rembert": f"{_D},input_embedding_size=64,output_embedding_size=64,{_V},task=masked-lm",
    # encoders (masked LM)
    "electra": f"{_D},embedding_size=64,{_V},task=masked-lm",
    "xlm-roberta": f"{_D},{_V},task=masked-lm,pad_token_id=1",
    "camembert": f"{_D},{_V},task=masked-lm,pad_token_id=1",
    "data2vec-text": f"{_D},{_V},task=masked-lm,pad_token_id=1",
    "ernie": f"{_D},{_V},task=masked-lm",
    # mixtures of experts
    "hunyuan_v1_moe": f"{_D},{_KV},head_dim=16,{_V},num_experts=4,moe_topk=2",
    "dots1": f"{_D},{_KV},{_V},moe_intermediate_size=32,n_routed_experts=4,"
    "num_experts_per_tok=2,n_shared_experts=1,first_k_dense_replace=1",
    "flex_olmo": f"{_D},{_KV},{_V},pad_token_id=0,num_experts=4,num_experts_per_tok=2",
    "afmoe": f"{_D},{_KV},head_dim=16,{_V},moe_intermediate_size=32,num_experts=4,"
    "num_experts_per_tok=2,num_shared_experts=1,num_dense_layers=1",
    "solar_open": f"hidden_size=64,num_hidden_layers=2,num_attention_heads=4,{_KV},{_V},"
    "moe_intermediate_size=32,n_routed_experts=4,num_experts_per_tok=2,n_shared_experts=1",
    "glm4_moe_lite": f"{_D},{_KV},{_V},moe_intermediate_size=32,n_routed_experts=4,"
    "num_experts_per_tok=2,n_shared_experts=1,kv_lora_rank=16,q_lora_rank=16,"
    "qk_rope_head_dim=8,qk_nope_head_dim=8,v_head_dim=16,n_group=1,topk_group=1",
    "sarvam_moe": f"{_D},{_KV},{_V},moe_intermediate_size=32,n_routed_experts=4,"
    "num_experts_per_tok=2,n_shared_experts=1",
    "laguna": f"{_D},{_KV},{_V},moe_intermediate_size=32,shared_expert_intermediate_size=32,"
    "num_experts=4,num_experts_per_tok=2",
    "mellum": f"{_D},{_KV},{_V},moe_intermediate_size=32,num_local_experts=4,"
    "num_experts_per_tok=2",
    "hy_v3": f"{_D},{_KV},head_dim=16,{_V},num_experts=4,num_experts_per_tok=2",
    "mimo_v2_flash": f"{_D},{_KV},{_V},moe_intermediate_size=32,n_routed_experts=4,"
    "num_experts_per_tok=2",
    "deepseek_v32": f"{_D},num_key_value_heads=4,{_V},{_MLA}",
    "lfm2_moe": f"{_D},{_KV},{_V},moe_intermediate_size=32,num_experts=4,"
    'num_experts_per_tok=2,num_dense_layers=1,layer_types=["conv","full_attention"]',
    # hybrids given their layer types as a list (commas inside the brackets)
    "olmo_hybrid": f"{_D},{_KV},{_V},pad_token_id=0,linear_num_key_heads=4,"
    'linear_num_value_heads=4,layer_types=["linear_attention","full_attention"]',
    "zamba2": f'{_D},{_KV},{_V},mamba_d_state=16,n_mamba_heads=2,layers_block_type=["mamba","hybrid"]',
    # mLSTM blocks: LogSigmoid gates, whose backward DTensor runs by `ELEMENTWISE_BACKWARD`'s rules
    "xlstm": f"hidden_size=64,num_hidden_layers=2,num_heads=4,{_V},chunk_size=8",
    # more decoders and encoders
    "gpt_neo": "hidden_size=64,num_layers=2,num_heads=4,max_position_embeddings=16,"
    f'attention_types=[[["global","local"],1]],{_V}',
    "gpt-sw3": f"n_embd=64,n_layer=2,n_head=4,n_positions=16,{_V},pad_token_id=0,"
    "bos_token_id=0,eos_token_id=0",
    "gpt_neox_japanese": "hidden_size=64,num_hidden_layers=2,num_attention_heads=4,"
    f"intermediate_multiple_size=2,{_V}",
    "xlm-roberta-xl": f"{_D},{_V},task=masked-lm,pad_token_id=1",
    "roberta-prelayernorm": f"{_D},{_V},task=masked-lm,pad_token_id=1",
    # the decoders of encoder-decoder models (their causal-LM heads)
    "bart": f"{_SEQ2SEQ},{_V},pad_token_id=1",
    "mbart": f"{_SEQ2SEQ},{_V},pad_token_id=1",
    "marian": f"{_SEQ2SEQ},{_V},pad_token_id=1,decoder_start_token_id=0",
    "pegasus": f"{_SEQ2SEQ},{_V},pad_token_id=0",
    "blenderbot": f"{_SEQ2SEQ},{_V},pad_token_id=0",
    "plbart": f"{_SEQ2SEQ},{_V},pad_token_id=1",
    "trocr": f"d_model=64,decoder_layers=2,decoder_attention_heads=4,decoder_ffn_dim=96,{_V},"
    "pad_token_id=1",
}
#: types whose forward iterates over a set of strings (MiMoV2Flash builds its masks in the order
#: of ``set(config.layer_types)``): their op order follows each process's string hashing, so
#: they are planned and run with PYTHONHASHSEED=0, as `ParallelPlan.check_model`'s refusal says
HASH_SEEDED = ("mimo_v2_flash",)
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


def _cli(
    *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "runtime.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    return proc, time.perf_counter() - t0


def _last_error(proc: subprocess.CompletedProcess) -> str:
    """meshplan's error line, else the last line that is not a notice or a warning."""
    lines = proc.stderr.splitlines()
    ours = [ln for ln in lines if ln.startswith("meshplan: error:")]
    rest = [
        ln
        for ln in lines
        if not ln.startswith(("[transformers]", " ")) and "Warning" not in ln
    ]
    return (ours or rest or ["(no output)"])[-1][:300]


def run_model(kind: str) -> dict[str, Any]:
    """Plan, run and compare one model type (module docstring)."""
    spec = f"hf:{kind}:{MODELS[kind]}"
    out: dict[str, Any] = {"model": kind, "spec": spec, "ok": False}
    env = None
    if kind in HASH_SEEDED:
        env = os.environ | {"PYTHONHASHSEED": "0"}
        out["env"] = "PYTHONHASHSEED=0"
    with tempfile.TemporaryDirectory() as tmp:
        plan_file, losses_file = Path(tmp) / "plan.json", Path(tmp) / "losses.json"
        proc, out["plan_s"] = _cli(
            "plan", spec, "--cluster", CLUSTER, "--batch", str(BATCH),
            "--dtype", "float32", "--quiet", "--json", str(plan_file), env=env,
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
            "--json", str(losses_file), env=env,
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
        r = run_model(kind) | {"date": datetime.date.today().isoformat()}
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
        "models": _merged(Path(args.json), rows) if args.only else rows,
    }
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0 if passed == len(rows) else 1


def _merged(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the results in `path`, those of the types just run replaced by `rows`
    (each row keeps the date it was run), in `MODELS`' order; `rows` alone where the file
    was written by other versions of torch or transformers (its figures would mix them)."""
    import transformers

    if not path.exists():
        return rows
    old = json.loads(path.read_text())
    if (old.get("torch"), old.get("transformers")) != (
        torch.__version__,
        transformers.__version__,
    ):
        return rows
    by_type = {r["model"]: {"date": old["date"]} | r for r in old["models"]} | {
        r["model"]: r for r in rows
    }
    return [by_type[k] for k in MODELS if k in by_type]


if __name__ == "__main__":
    sys.exit(main())
