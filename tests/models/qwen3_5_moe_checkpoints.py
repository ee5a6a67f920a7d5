"""Tiny Qwen3.5-MoE checkpoints on seeded random configs, in the layouts users have.

transformers builds a random tiny Qwen3_5MoeForConditionalGeneration (a one-block vision tower beside the
text tower) or, model_type="qwen3_5_moe_text", the text model alone; the weights are re-drawn at
realistic scales (matrices N(0, 1/fan_in), the zero-centred norms' offsets N(0, 0.1^2), the gated norm
1 + N(0, 0.1^2), A_log = log U(1, 16), dt_bias the inverse softplus of U(1e-3, 1e-1), as fla initialises
them) and saved bf16 with A_log and dt_bias float32, plus a multi-token-prediction layer `mtp.*` the model
must skip. layout "release": the routed experts stacked, `mlp.experts.gate_up_proj` [E, 2I, H] /
`down_proj` [E, H, I] (Qwen/Qwen3.5-*-A*B, and transformers' in-memory names); "transformers": what
transformers 5.25's save_pretrained writes, one tensor per expert (`mlp.experts.{j}.gate_proj.weight`).

    random_dims(seed) -> text config fields (value heads grouped 1-3 over key heads, partial rotary,
        conv taps, experts and top-k, the order of linear and full attention layers)
    build_qwen3_5_moe_checkpoint(tmp_dir, seed=0, layout="release", model_type="qwen3_5_moe", **overrides) -> Path
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

from tests.models.deepseek_checkpoints import redraw
from tests.models.helpers import save_bf16

LAYOUTS = ("release", "transformers")
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=4, num_position_embeddings=16)
_FLOAT32 = ("A_log", "dt_bias")


def random_dims(seed: int) -> dict:
    r = random.Random(seed)
    heads, qk_heads = r.choice((4, 8)), r.choice((1, 2))
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    r.shuffle(layer_types)
    experts = r.choice((4, 8))
    return dict(
        vocab_size=256, hidden_size=r.choice((32, 48, 64)), num_hidden_layers=4, layer_types=layer_types,
        num_attention_heads=heads, num_key_value_heads=r.choice([k for k in (1, 2, 4) if heads % k == 0]),
        head_dim=r.choice((16, 32)), rope_parameters=dict(rope_type="default", rope_theta=r.choice((1e4, 1e7)),
                                                          partial_rotary_factor=r.choice((0.25, 0.5))),
        attention_bias=r.random() < 0.3, linear_num_key_heads=qk_heads, linear_num_value_heads=qk_heads * r.randint(1, 3),
        linear_key_head_dim=r.choice((8, 16)), linear_value_head_dim=r.choice((8, 16)),
        linear_conv_kernel_dim=r.choice((2, 4)), num_experts=experts, num_experts_per_tok=r.randint(1, min(4, experts)),
        moe_intermediate_size=r.choice((16, 32)), shared_expert_intermediate_size=r.choice((24, 32)), rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    )


def _realistic(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = redraw(state, gen)
    for name, t in state.items():
        if name.endswith("A_log"):
            out[name] = (1 + 15 * torch.rand(t.shape, generator=gen)).log()
        elif name.endswith("dt_bias"):
            dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(t.shape, generator=gen))
            out[name] = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name.endswith("model.norm.weight") \
                or name.endswith("language_model.norm.weight"):  # zero-centred: the weight is the offset from 1
            out[name] = 0.1 * torch.randn(t.shape, generator=gen)
    return out


def _mtp(hidden: int) -> dict[str, torch.Tensor]:
    """A stand-in for the released multi-token-prediction layer (its names; the model skips them)."""
    return {"mtp.fc.weight": torch.zeros(hidden, 2 * hidden, dtype=torch.bfloat16),
            "mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(8, hidden, dtype=torch.bfloat16),
            "mtp.norm.weight": torch.zeros(hidden, dtype=torch.bfloat16)}


def build_qwen3_5_moe_checkpoint(tmp_dir, *, seed: int = 0, layout: str = "release", model_type: str = "qwen3_5_moe",
                                 mtp: bool = True, **overrides) -> Path:
    """A tiny checkpoint at tmp_dir/<model_type>-<seed>-<layout>: random_dims(seed) with overrides."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    dims = {**random_dims(seed), **overrides}
    tag = "-".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    out = Path(tmp_dir) / f"{model_type}-{seed}-{layout}{'-' + tag if tag else ''}"
    if model_type == "qwen3_5_moe":
        cfg = AutoConfig.for_model("qwen3_5_moe", text_config=dims,
                                   vision_config=dict(VISION, out_hidden_size=dims["hidden_size"]))
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **dims))
    save_bf16(model, out, _realistic(model.state_dict(), seed), original_format=layout == "transformers",
              float32=_FLOAT32, extra=(lambda _: _mtp(dims["hidden_size"])) if mtp else None)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out
