"""Tiny DeepSeek-V4 checkpoints in the real on-disk layout, for the model and verify tests.

Built like the demo checkpoint (dayzero.demo.checkpoint draws every tensor at a realistic scale in
DeepSeek's original names and formats: FP8 e4m3 dense weights with 128x128 UE8M0 scales, FP4
experts as int8 pairs with UE8M0 scales per 32, float32 hyper-connection weights, sinks, APE and
correction biases) with a smaller vocabulary, five layers covering window-only, CSA and HCA, a short
sliding window, and enough indexer heads that exact score ties are unlikely.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from dayzero.demo.checkpoint import DEMO_CONFIG, demo_state_dict
from dayzero.formats import fp8, mxfp4

TINY_V4 = dict(
    DEMO_CONFIG,
    vocab_size=256,
    num_hidden_layers=5,
    compress_ratios=[0, 4, 128, 4, 128],  # window only, CSA, HCA, CSA, HCA
    num_hash_layers=2,
    sliding_window=16,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=8,
)


def tiny_v4_config(**overrides) -> dict:
    config = dict(TINY_V4, **overrides)
    config["compress_ratios"] = list(config["compress_ratios"])[: config["num_hidden_layers"]]
    return config


def build_deepseek_v4_checkpoint(tmp_dir: str | os.PathLike, *, mtp: bool = False, quantized: bool = True,
                                 **overrides) -> Path:
    """Write config.json and model.safetensors of a tiny random DeepSeek-V4 into `tmp_dir`.

    overrides: config.json fields (e.g. sliding_window, index_topk, compress_ratios, num_hidden_layers).
    Dims stay <= 128 or multiples of 128 (FP8 blocks) and multiples of 32 (FP4 blocks).
    mtp: also ship one MTP layer as the real checkpoint does (`mtp.0.*` tensors, here a copy of the
    last layer's, `num_nextn_predict_layers: 1` and a trailing `compress_ratios` entry).
    expert_dtype="fp8" (an override): routed experts as FP8 with 128x128 UE8M0 block scales, like
    the dense weights (moe_intermediate_size must then be a multiple of 128).
    quantized=False: every weight in bf16 and no quantization_config (an unquantized export)."""
    out = Path(tmp_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_v4_config(**overrides)
    state = {name: t.contiguous() for name, t in demo_state_dict(config).items()}
    if config.get("expert_dtype") == "fp8":
        state = _fp8_experts(state)
    if not quantized:
        state = _dequantized(state)
        del config["quantization_config"], config["expert_dtype"]
    if mtp:
        last = f"layers.{config['num_hidden_layers'] - 1}."
        state.update({"mtp.0." + n[len(last):]: t.clone() for n, t in state.items() if n.startswith(last)})
        config.update(num_nextn_predict_layers=1, compress_ratios=config["compress_ratios"] + [0])
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def load_reference(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """transformers' DeepseekV4ForCausalLM on the checkpoint (on CPU it dequantizes FP8 / FP4 on load),
    its indexer's top-k ranking equal scores by entry index as dayzero does (dayzero.verify)."""
    from transformers import AutoModelForCausalLM

    from dayzero.verify import rank_reference_ties

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    rank_reference_ties(model, "deepseek_v4")
    model.generation_config.eos_token_id = None  # generate exactly the requested number of tokens
    return model.eval()


def _is_expert(name: str) -> bool:
    return ".experts." in name and ".shared_experts." not in name


def _fp8_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP4 experts (int8 pairs + E8M0 per 32) -> FP8 e4m3 with one UE8M0 scale per 128x128 block."""
    out = {}
    for name, t in state.items():
        if _is_expert(name) and name.endswith(".weight"):
            dense = mxfp4.dequantize_deepseek_v4(t, state[name[: -len("weight")] + "scale"], dtype=torch.float32)
            out[name], out[name[: -len("weight")] + "scale"] = fp8.quantize_weight_blocks(
                dense, block=(128, 128), scale_format="ue8m0", scale_dtype=torch.float8_e8m0fnu)
        elif not (_is_expert(name) and name.endswith(".scale")):
            out[name] = t
    return out


def _dequantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every FP8 / FP4 weight dequantized to bf16, scales dropped."""
    out = {}
    for name, t in state.items():
        if name.endswith(".scale"):
            continue
        scale = state.get(name[: -len("weight")] + "scale") if name.endswith(".weight") else None
        if scale is not None and t.dtype == torch.int8:
            t = mxfp4.dequantize_deepseek_v4(t, scale, dtype=torch.bfloat16)
        elif scale is not None:
            t = fp8.dequantize_weight_blocks(t, scale, dtype=torch.bfloat16)
        out[name] = t
    return out
