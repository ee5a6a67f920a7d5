"""Tiny random gpt-oss checkpoints in the real on-disk layout (openai/gpt-oss-* on the Hub).

transformers builds the model and saves it; the file is then rewritten as the published checkpoints
ship: experts as MXFP4 `*_blocks` uint8 [E, out, K/32, 16] / `*_scales` uint8 [E, out, K/32] with
interleaved gate/up rows (transformers' in-memory gate_up_proj is [E, H, 2I], x @ W, so it is
transposed before quantizing), every other tensor bf16, and config.json carrying the real
`quantization_config` and the legacy `rope_scaling` / `rope_theta` keys. transformers dequantizes
such a file on load on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dayzero.formats import mxfp4

QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
}
TINY = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=256, sliding_window=8,
            max_position_embeddings=131072)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Fresh values of realistic scale everywhere: transformers' init leaves biases at 0, norms at 1
    and router/sinks tiny. Expert pre-activations reach past the SwiGLU clamp (|x| > 7)."""
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                value = 1 + 0.2 * torch.randn(p.shape, generator=g)
            elif name.endswith("sinks"):
                value = torch.randn(p.shape, generator=g)
            elif name.endswith("experts.gate_up_proj"):
                value = torch.randn(p.shape, generator=g) * (5.0 / hidden ** 0.5)
            elif "bias" in name:
                value = 0.3 * torch.randn(p.shape, generator=g)
            else:
                value = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            p.copy_(value)


def build_gpt_oss_checkpoint(tmp_dir, *, expert_format: str = "mxfp4", seed: int = 0, legacy_config: bool = True,
                             **config_overrides) -> Path:
    """Write a tiny gpt-oss checkpoint to `tmp_dir` and return the directory.

    expert_format "mxfp4" (the published layout) or "bf16" (transformers' own unquantized save,
    float32 as saved). legacy_config: write rope as `rope_scaling` + `rope_theta` like the Hub's
    config.json (transformers 5 writes `rope_parameters`). config_overrides replace TINY's values."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(tmp_dir)
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("gpt_oss", **{**TINY, **config_overrides})
    model = AutoModelForCausalLM.from_config(cfg)
    _randomize(model, seed)
    model.save_pretrained(path)

    config = json.loads((path / "config.json").read_text())
    if legacy_config and "rope_parameters" in config:
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope
    if expert_format == "mxfp4":
        tensors = {}
        for name, tensor in load_file(path / "model.safetensors").items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = mxfp4.quantize(tensor.transpose(1, 2).contiguous())  # [E, out, K]
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            else:
                tensors[name] = tensor.to(torch.bfloat16)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        config["quantization_config"] = QUANTIZATION_CONFIG
    elif expert_format != "bf16":
        raise ValueError(f"expert_format must be 'mxfp4' or 'bf16', got {expert_format!r}")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
