"""Tiny random Kimi K3 checkpoints in the published on-disk layout (moonshotai/Kimi-K3).

config.json is the `kimi_k3` wrapper (`KimiK3ForConditionalGeneration`) with the text tower in
`text_config` (`model_type: kimi_linear`) carrying K3's fields and its compressed-tensors
`quantization_config`; no `vision_config` (the vision tower and `mm_projector` are left out, so
this is the text model of a K3 checkpoint). Tensors live under `language_model.`:

- the Kimi Linear names come from transformers' `kimi_linear` model (built and saved, so its
  save-time renaming back to the original names applies: `block_sparse_moe.`, per-expert
  `experts.{j}.w1/w2/w3`, `q/k/v_conv1d`), except the dense layer's MLP, which transformers saves
  under `block_sparse_moe.` but the real checkpoints ship as `mlp.{gate,up,down}_proj` (K3's
  ignore list `re:.*mlp\\.(gate|up|gate_up|down)_proj.*` names it so);
- K3 replaces / adds: KDA full-rank output gate `self_attn.g_proj` [P, D] instead of
  `g_a_proj` / `g_b_proj`; `self_attn.A_log` float32 [head_dim] with entries past num_heads zero
  (published: [128] for 96 heads); MLA output gate `self_attn.g_proj` [heads * v_head_dim, D];
  `self_attention_res_{norm,proj}` and `mlp_res_{norm,proj}` per layer and
  `model.output_attn_res_{norm,proj}` ([D] and [1, D]); latent MoE
  `block_sparse_moe.routed_expert_{down_proj,norm,up_proj}`; routed experts at latent width as
  `weight_packed` uint8 [out, in/2] + `weight_scale` uint8 [out, in/32] (MXFP4, E2M1 + E8M0).
- dtypes as published: bf16, except float32 `A_log`, `dt_bias`, `*_conv1d.weight`, `o_norm.weight`,
  `gate.e_score_correction_bias`.

Values are random at realistic scale (norm weights near 1, projections ~ 1/sqrt(fan_in), attention
residual scores of order 1 so the softmax is neither uniform nor one-hot).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from dayzero.formats import mxfp4

TEXT_PREFIX = "language_model."

# As published (text_config.quantization_config of moonshotai/Kimi-K3).
QUANTIZATION_CONFIG = {
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {"dynamic": False, "group_size": 32, "num_bits": 4, "scale_dtype": "torch.uint8",
                        "symmetric": True, "type": "float"},
        }
    },
    "format": "mxfp4-pack-quantized",
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "quant_method": "compressed-tensors",
}

# Tiny dims with K3's proportions: 6 layers (KDA, KDA, KDA, MLA, KDA, MLA: every 4th and the last
# are MLA as in K3), blocks of 2 layers so three blocks complete, latent = hidden / 2.
TINY_TEXT = {
    "model_type": "kimi_linear",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 160,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 2,
    "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 64,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "attn_res_block_size": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1048576,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "linear_attn_config": {
        "full_attn_layers": [4, 6],
        "kda_layers": [1, 2, 3, 5],
        "num_heads": 4,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
}

_FLOAT32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


def k3_layer_lists(num_layers: int) -> tuple[list[int], list[int]]:
    """(full_attn_layers, kda_layers), 1-based, K3's pattern: every 4th layer and the last are MLA."""
    full = sorted({i for i in range(4, num_layers + 1, 4)} | {num_layers})
    return full, [i for i in range(1, num_layers + 1) if i not in full]


def tiny_k3_text_config(**overrides) -> dict:
    """TINY_TEXT with `overrides`; a new num_hidden_layers gets K3's layer pattern unless
    linear_attn_config is overridden too (a dict there is merged into the default)."""
    text = json.loads(json.dumps(TINY_TEXT))
    lac = overrides.pop("linear_attn_config", None)
    text.update(overrides)
    if "num_hidden_layers" in overrides:
        full, kda = k3_layer_lists(text["num_hidden_layers"])
        text["linear_attn_config"].update(full_attn_layers=full, kda_layers=kda)
    if lac:
        text["linear_attn_config"].update(lac)
    return text


def build_kimi_k3_checkpoint(tmp_dir: str | os.PathLike, *, seed: int = 0, **overrides) -> Path:
    """Write config.json and model.safetensors of a tiny random Kimi K3 into `tmp_dir`.

    overrides replace text_config fields (see tiny_k3_text_config), e.g. attn_res_block_size=3,
    latent_moe_use_norm=False, routed_expert_hidden_size=None (experts at hidden width)."""
    from safetensors.torch import save_file

    out = Path(tmp_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = tiny_k3_text_config(**overrides)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in _k3_text_shapes(text).items():
        state[TEXT_PREFIX + name] = _random_tensor(name, shape, text, gen)
    for name, tensor in _routed_experts(text, gen).items():
        state[TEXT_PREFIX + name] = tensor
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})

    text = {**text, "quantization_config": QUANTIZATION_CONFIG}
    config = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "media_placeholder_token_id": text["vocab_size"] - 1,
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "tie_word_embeddings": False,
        "text_config": text,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _transformers_names(text: dict) -> dict[str, tuple[int, ...]]:
    """Disk names and shapes transformers' kimi_linear writes for the same dims (experts at hidden
    width, SiLU: transformers has neither latent experts nor SiTU)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in text.items() if k not in (
        "model_type", "hidden_act", "activation_situ_beta", "activation_situ_linear_beta", "attn_res_block_size",
        "routed_expert_hidden_size", "latent_moe_use_norm", "mla_use_output_gate", "mla_use_nope", "topk_method",
        "use_grouped_topk", "moe_router_activation_func", "moe_layer_freq", "max_position_embeddings")}
    cfg = AutoConfig.for_model("kimi_linear", **kwargs)
    state = torch.random.get_rng_state()  # transformers' init draws from the global RNG; leave it as it was
    try:
        model = AutoModelForCausalLM.from_config(cfg)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            with safe_open(os.path.join(tmp, "model.safetensors"), "pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    finally:
        torch.random.set_rng_state(state)


def _k3_text_shapes(text: dict) -> dict[str, tuple[int, ...]]:
    """Every non-expert text tensor of the K3 layout: transformers' kimi_linear names, rewritten."""
    d = text["hidden_size"]
    n = text["num_hidden_layers"]
    lac = text["linear_attn_config"]
    kda_heads, kda_dim = lac["num_heads"], lac["head_dim"]
    if kda_heads > kda_dim:
        raise ValueError(f"the builder stores A_log as [head_dim] like K3; needs num_heads <= head_dim, got {kda_heads} > {kda_dim}")
    kda_layers = {i - 1 for i in lac["kda_layers"]}
    dense_layers = set(range(int(text["first_k_dense_replace"])))
    shapes = {}
    for name, shape in _transformers_names(text).items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer is not None and layer in dense_layers and ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")  # dense MLP: `mlp.` on disk
        if ".experts." in name or name.endswith(("g_a_proj.weight", "g_b_proj.weight")):
            continue  # routed experts are written in MXFP4 below; KDA gets the full-rank g_proj
        if name.endswith("self_attn.A_log"):
            shape = (kda_dim,)
        shapes[name] = shape
    latent = text.get("routed_expert_hidden_size")
    for i in range(n):
        p = f"model.layers.{i}."
        if i in kda_layers and lac.get("use_full_rank_gate"):
            shapes[p + "self_attn.g_proj.weight"] = (kda_heads * kda_dim, d)
        if i not in kda_layers and text.get("mla_use_output_gate"):
            shapes[p + "self_attn.g_proj.weight"] = (text["num_attention_heads"] * text["v_head_dim"], d)
        if text.get("attn_res_block_size"):
            for stem in ("self_attention_res", "mlp_res"):
                shapes[p + stem + "_norm.weight"] = (d,)
                shapes[p + stem + "_proj.weight"] = (1, d)
        if i not in dense_layers and latent:
            moe = p + "block_sparse_moe."
            shapes[moe + "routed_expert_down_proj.weight"] = (latent, d)
            if text.get("latent_moe_use_norm"):
                shapes[moe + "routed_expert_norm.weight"] = (latent,)
            shapes[moe + "routed_expert_up_proj.weight"] = (d, latent)
    if text.get("attn_res_block_size"):
        shapes["model.output_attn_res_norm.weight"] = (d,)
        shapes["model.output_attn_res_proj.weight"] = (1, d)
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...], text: dict, gen: torch.Generator) -> torch.Tensor:
    d = text["hidden_size"]
    if name.endswith("norm.weight"):  # layernorms, q/kv_a_layernorm, o_norm, res norms, latent norm
        value = 1 + 0.2 * torch.randn(shape, generator=gen)
    elif name.endswith("_res_proj.weight"):  # scores w . RMSNorm(v) ~ N(0, 1.5^2)
        value = 1.5 * torch.randn(shape, generator=gen) / d ** 0.5
    elif name.endswith("A_log"):
        heads = text["linear_attn_config"]["num_heads"]
        value = torch.zeros(shape)
        value[:heads] = torch.log(torch.empty(heads).uniform_(1, 16, generator=gen))
    elif name.endswith("dt_bias"):
        value = 0.5 * torch.randn(shape, generator=gen)
    elif name.endswith("conv1d.weight"):
        value = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    elif name.endswith("e_score_correction_bias"):
        value = 0.1 * torch.randn(shape, generator=gen)
    elif name.endswith("embed_tokens.weight"):
        value = torch.randn(shape, generator=gen)
    else:  # projections [out, in]
        value = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    dtype = torch.float32 if name.endswith(_FLOAT32_SUFFIXES) else torch.bfloat16
    return value.to(dtype).contiguous()


def _routed_experts(text: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """experts.{j}.{w1,w3} [I, K] and w2 [K, I] (K = latent width, else hidden) as compressed-tensors MXFP4."""
    k = text.get("routed_expert_hidden_size") or text["hidden_size"]
    inter = text["moe_intermediate_size"]
    tensors = {}
    for i in range(int(text["first_k_dense_replace"]), text["num_hidden_layers"]):
        for j in range(text["num_experts"]):
            base = f"model.layers.{i}.block_sparse_moe.experts.{j}."
            for w, (rows, cols) in (("w1", (inter, k)), ("w3", (inter, k)), ("w2", (k, inter))):
                weight = torch.randn(rows, cols, generator=gen) * (2.0 / cols ** 0.5)
                packed, scale = mxfp4.to_compressed_tensors(*mxfp4.quantize(weight))
                tensors[base + w + ".weight_packed"] = packed.contiguous()
                tensors[base + w + ".weight_scale"] = scale.contiguous()
    return tensors
