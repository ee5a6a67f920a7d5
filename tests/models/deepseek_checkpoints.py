"""Tiny DeepSeek-V3 / Kimi-K2 / DeepSeek-V3.2 checkpoints in the real on-disk layout.

transformers builds a random tiny model and saves it (it already writes routed experts per expert,
`mlp.experts.{j}.{gate,up,down}_proj.weight`, like the real checkpoints); the weights are then
re-drawn at realistic scales and rewritten as the real checkpoints ship them: every Linear of the
layers (attention incl. the DSA indexer's wq_b / wk, dense MLP, shared and routed experts) FP8
E4M3 with a float32 `weight_scale_inv` per 128x128 block; embeddings, norms, lm_head and the
indexer's weights_proj bf16; the router weight bf16 and its correction bias float32. config.json
gets the real fields (`rope_scaling` + `rope_theta`, `quantization_config`, `scoring_func`, ...)
and optionally one multi-token-prediction layer, model.layers.{n}, that the model must skip.

    build_deepseek_v3_checkpoint(tmp_dir, model_type="deepseek_v3" | "kimi_k2", **options) -> Path
    build_deepseek_v32_checkpoint(tmp_dir, **options) -> Path
    load_reference(path, dtype) -> transformers model (kimi_k2 loads as deepseek_v3, as its
        `architectures` says)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dayzero.formats.fp8 import quantize_weight_blocks
from tests.models.helpers import GENERATE, greedy, positions, random_prompt, rel_err  # noqa: F401  (re-exported)

QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}

V3_DIMS = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=128, rms_norm_eps=1e-6,
)
# DeepSeek-V3's yarn (factor 40 over 4096) scaled down: positions past 32 are interpolated
V3_ROPE = dict(type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1,
               mscale=1.0, mscale_all_dim=1.0)
# Kimi-K2: one expert group, rope_theta 50000, yarn with beta_fast = beta_slow = 1
KIMI_DIMS = dict(n_group=1, topk_group=1, routed_scaling_factor=2.827)
KIMI_ROPE = dict(type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=1.0, beta_slow=1.0,
                 mscale=1.0, mscale_all_dim=1.0)
V32_DIMS = dict(index_n_heads=8, index_head_dim=64, index_topk=8)

# Linear weights that stay bf16 in the real checkpoints (everything else named *.weight of 2 dims is FP8)
_NOT_QUANTIZED = re.compile(r"(embed_tokens|lm_head|mlp\.gate\.weight|indexer\.weights_proj|norm)")


def redraw(state: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Fresh values at realistic scales: matrices ~ N(0, 1/fan_in), embeddings N(0, 1), norm weights
    1 + N(0, 0.1^2), biases N(0, 0.1^2), router correction biases U(0, 0.2)."""
    out = {}
    for name, t in state.items():
        shape = t.shape
        if name.endswith("e_score_correction_bias"):
            v = torch.rand(shape, generator=generator) * 0.2
        elif "norm" in name and name.endswith(".weight"):
            v = 1 + 0.1 * torch.randn(shape, generator=generator)
        elif name.endswith(".bias"):
            v = 0.1 * torch.randn(shape, generator=generator)
        elif "embed_tokens" in name:
            v = torch.randn(shape, generator=generator)
        else:
            v = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        out[name] = v.float()
    return out


def _real_layout(state: dict[str, torch.Tensor], fp8: bool, scale_format: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if fp8 and name.endswith(".weight") and t.dim() == 2 and not _NOT_QUANTIZED.search(name):
            q, s = quantize_weight_blocks(t, (128, 128), scale_format=scale_format)
            out[name], out[name + "_scale_inv"] = q, s
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.float()
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def mtp_layer(state: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """A stand-in for the real multi-token-prediction layer model.layers.{n}: a copy of the last layer
    plus its extra heads (enorm, hnorm, eh_proj, shared_head)."""
    last = f"model.layers.{n - 1}."
    mtp = {name.replace(last, f"model.layers.{n}."): t.clone() for name, t in state.items() if name.startswith(last)}
    hidden = state["model.norm.weight"].shape[0]
    mtp[f"model.layers.{n}.enorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    mtp[f"model.layers.{n}.hnorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(hidden, 2 * hidden, dtype=torch.bfloat16)
    mtp[f"model.layers.{n}.shared_head.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    mtp[f"model.layers.{n}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    return mtp


def _build(out_dir: Path, hf_type: str, dims: dict, rope: dict, rope_theta: float, *, model_type: str, fp8: bool,
           scale_fmt: str | None, mtp: bool, seed: int, extra_config: dict) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    cfg = AutoConfig.for_model(hf_type, rope_scaling=dict(rope), rope_theta=rope_theta, **dims)
    with torch.random.fork_rng():  # transformers' init draws from the global generator; every value is redrawn below
        AutoModelForCausalLM.from_config(cfg).save_pretrained(out_dir)
    state = redraw(load_file(out_dir / "model.safetensors"), torch.Generator().manual_seed(seed))
    if fp8:
        state = _real_layout(state, fp8, "ue8m0" if scale_fmt == "ue8m0" else "float32")
    else:
        state = {k: (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)) for k, v in state.items()}
    n = dims["num_hidden_layers"]
    if mtp:
        state.update(mtp_layer(state, n))
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})

    config = json.loads((out_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(model_type=model_type, rope_scaling=dict(rope), rope_theta=rope_theta, scoring_func="sigmoid",
                  topk_method="noaux_tc", moe_layer_freq=1, num_nextn_predict_layers=1 if mtp else 0, **extra_config)
    if fp8:
        config["quantization_config"] = dict(QUANTIZATION_CONFIG, **({"scale_fmt": scale_fmt} if scale_fmt else {}))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out_dir


def build_deepseek_v3_checkpoint(tmp_dir, *, model_type: str = "deepseek_v3", fp8: bool = True, mtp: bool = True,
                                 seed: int = 0, **overrides) -> Path:
    """A tiny DeepSeek-V3 (or, model_type="kimi_k2", Kimi-K2) checkpoint at tmp_dir/<model_type>.
    overrides: config fields over V3_DIMS (e.g. q_lora_rank=None, attention_bias=True)."""
    if model_type not in ("deepseek_v3", "kimi_k2"):
        raise ValueError(f"model_type must be deepseek_v3 or kimi_k2, got {model_type!r}")
    kimi = model_type == "kimi_k2"
    dims = {**V3_DIMS, **(KIMI_DIMS if kimi else {}), **overrides}
    rope = KIMI_ROPE if kimi else V3_ROPE
    tag = "-".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    out = Path(tmp_dir) / f"{model_type}{'-' + tag if tag else ''}{'' if fp8 else '-bf16'}"
    return _build(out, "deepseek_v3", dims, rope, 50000.0 if kimi else 10000.0, model_type=model_type, fp8=fp8,
                  scale_fmt=None, mtp=mtp, seed=seed, extra_config={})


def build_deepseek_v32_checkpoint(tmp_dir, *, fp8: bool = True, mtp: bool = True, seed: int = 0, **overrides) -> Path:
    """A tiny DeepSeek-V3.2 checkpoint (ue8m0 FP8 scales, stored float32, as V3.2 ships them).
    overrides: config fields over V3_DIMS + V32_DIMS (e.g. index_topk=64)."""
    dims = {**V3_DIMS, **V32_DIMS, **overrides}
    tag = "-".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    out = Path(tmp_dir) / f"deepseek_v32{'-' + tag if tag else ''}{'' if fp8 else '-bf16'}"
    return _build(out, "deepseek_v32", dims, V3_ROPE, 10000.0, model_type="deepseek_v32", fp8=fp8,
                  scale_fmt="ue8m0", mtp=mtp, seed=seed, extra_config={})


def load_reference(path, dtype: torch.dtype = torch.float32):
    """The transformers model of a checkpoint built here (FP8 weights dequantized on load on CPU)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    config = json.loads((Path(path) / "config.json").read_text())
    if config["model_type"] == "kimi_k2":  # not a transformers type: Kimi-K2 is DeepseekV3ForCausalLM
        config["model_type"] = "deepseek_v3"
        cfg = DeepseekV3Config.from_dict(config)
        model = DeepseekV3ForCausalLM.from_pretrained(path, config=cfg, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


# -- helpers shared by the DeepSeek model tests ---------------------------------------------------


def prompt(batch, length, seed=0):
    return random_prompt(batch, length, V3_DIMS["vocab_size"], seed + length)
