"""Tiny Kimi Linear checkpoints in the released on-disk layout.

transformers builds a random tiny model and saves it under the released names (it writes
`q_conv1d` / `k_conv1d` / `v_conv1d`, `f_a_proj` ... directly under self_attn, routed experts per
expert as `block_sparse_moe.experts.{j}.w1/w2/w3`); the weights are then re-drawn at realistic
scales and stored as moonshotai/Kimi-Linear-48B-A3B ships them: bf16, except the router weight,
its correction bias and dt_bias in float32 (A_log stays float32 too). transformers' save also names
the dense layers' MLP `block_sparse_moe.{gate,up,down}_proj`; the released checkpoint (and the
remote code) name it `mlp.*`, which is what is written here. config.json gets the released fields
(`mla_use_nope`, `moe_router_activation_func`, `use_grouped_topk`, ...).

Layers (1-based in linear_attn_config): 1 KDA (dense MLP), 2 MLA, 3 KDA, 4 MLA (q-LoRA variant
optional), so both kinds see both MLP kinds.

    build_kimi_linear_checkpoint(tmp_dir, **overrides) -> Path
    load_reference(path, dtype) -> transformers model
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.models.helpers import GENERATE, greedy, positions, random_prompt, rel_err  # noqa: F401  (re-exported)

KDA_HEADS, KDA_HEAD_DIM = 2, 16
DIMS = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_token=3, num_shared_experts=1,
    num_expert_group=4, topk_group=2, routed_scaling_factor=2.446, moe_renormalize=True, first_k_dense_replace=1,
    rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
LINEAR_ATTN = dict(full_attn_layers=[2, 4], kda_layers=[1, 3], num_heads=KDA_HEADS, head_dim=KDA_HEAD_DIM,
                   short_conv_kernel_size=4)
# the fields Kimi-Linear-48B-A3B's config.json carries beyond transformers' own
RELEASED_FIELDS = dict(mla_use_nope=True, moe_router_activation_func="sigmoid", use_grouped_topk=True, moe_layer_freq=1)

_FLOAT32 = ("gate.weight", "e_score_correction_bias", "dt_bias", "A_log")


def _redraw(state: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Fresh values at realistic scales: matrices ~ N(0, 1/fan_in), conv taps N(0, 1/K), embeddings
    N(0, 1), norm weights 1 + N(0, 0.1^2), correction biases U(0, 0.2); A_log = log U(1, 16) and
    dt_bias = inverse softplus of U(1e-3, 1e-1) as FLA initialises them (decays from ~0.9 to 1)."""
    out = {}
    for name, t in state.items():
        shape = t.shape
        if name.endswith("e_score_correction_bias"):
            v = torch.rand(shape, generator=generator) * 0.2
        elif name.endswith("A_log"):
            v = (1 + 15 * torch.rand(shape, generator=generator)).log()
        elif name.endswith("dt_bias"):
            dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(shape, generator=generator))
            v = dt + torch.log(-torch.expm1(-dt))
        elif "norm" in name and name.endswith(".weight"):
            v = 1 + 0.1 * torch.randn(shape, generator=generator)
        elif "embed_tokens" in name:
            v = torch.randn(shape, generator=generator)
        elif "conv1d" in name:
            v = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        else:
            v = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        out[name] = v.float()
    return out


def _released_layout(state: dict[str, torch.Tensor], first_dense: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        for i in range(first_dense):  # dense layers' MLP: `mlp.*` in the released checkpoint
            name = name.replace(f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp.")
        out[name] = t.float() if name.endswith(_FLOAT32) else t.to(torch.bfloat16)
    return out


def build_kimi_linear_checkpoint(tmp_dir, *, seed: int = 0, **overrides) -> Path:
    """A tiny Kimi Linear checkpoint at tmp_dir/kimi_linear[-overrides]. overrides: config fields
    over DIMS (e.g. q_lora_rank=24, tie_word_embeddings=True)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = {**DIMS, **overrides}
    tag = "-".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    out = Path(tmp_dir) / f"kimi_linear{'-' + tag if tag else ''}"
    cfg = AutoConfig.for_model("kimi_linear", linear_attn_config=dict(LINEAR_ATTN), **dims)
    with torch.random.fork_rng():  # transformers' init draws from the global generator; every value is redrawn below
        AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    state = _redraw(load_file(out / "model.safetensors"), torch.Generator().manual_seed(seed))
    save_file(_released_layout(state, dims["first_k_dense_replace"]), out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.update(RELEASED_FIELDS)
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def load_reference(path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


# -- helpers shared by the Kimi model tests ------------------------------------------------------


def prompt(batch, length, seed=0, vocab=DIMS["vocab_size"]):
    return random_prompt(batch, length, vocab, seed + length)
