"""Tiny GLM-4.x MoE checkpoints (`glm4_moe`) on seeded random configs, in the layouts users have.

transformers builds a random tiny model and saves it; the weights are re-drawn at realistic scales
(tests.models.deepseek_checkpoints.redraw) and written as zai-org/GLM-4.5 ships them: bf16, the router
weight and its correction bias float32, routed experts per expert (`mlp.experts.{j}.gate_proj.weight`,
which is also what transformers' save_pretrained writes), one multi-token-prediction layer
`model.layers.{n}` the model must skip, and config.json with the released rope fields (top-level
`rope_theta`, `partial_rotary_factor`, `head_dim`, `rope_scaling: null`). layout="in-memory" writes
transformers' in-memory names instead (save_pretrained(save_original_format=False): stacked
`mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]).

    random_dims(seed) -> config fields of a random tiny GLM-4.x (heads, KV heads, head_dim, partial
        rotary, QK norm, q/k/v biases, expert groups, top-k, dense first layers, shared experts)
    build_glm4_moe_checkpoint(tmp_dir, seed=0, layout="release", **overrides) -> Path
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from tests.models.deepseek_checkpoints import mtp_layer, redraw
from tests.models.helpers import save_bf16

LAYOUTS = ("release", "in-memory")
_FLOAT32 = ("mlp.gate.weight", "e_score_correction_bias")


def random_dims(seed: int) -> dict:
    r = random.Random(seed)
    heads = r.choice((4, 8))
    head_dim = r.choice((16, 24, 32))
    experts = r.choice((8, 16))
    n_group = r.choice((1, 2, 4))
    topk_group = r.randint(1, n_group)
    return dict(
        vocab_size=256, hidden_size=r.choice((48, 64)), intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=heads, num_key_value_heads=r.choice([k for k in (1, 2, 4) if heads % k == 0]),
        head_dim=head_dim, partial_rotary_factor=r.choice((0.5, 0.25, 1.0)), use_qk_norm=r.random() < 0.5,
        attention_bias=r.random() < 0.5, n_routed_experts=experts, n_group=n_group, topk_group=topk_group,
        num_experts_per_tok=r.randint(2, min(4, topk_group * experts // n_group)),
        n_shared_experts=r.choice((1, 2)), first_k_dense_replace=r.choice((0, 1, 2)),
        routed_scaling_factor=r.choice((1.0, 2.5)), norm_topk_prob=r.random() < 0.8, rope_theta=r.choice((1e4, 1e6)),
        rms_norm_eps=1e-5, max_position_embeddings=4096,
    )


def build_glm4_moe_checkpoint(tmp_dir, *, seed: int = 0, layout: str = "release", mtp: bool = True, **overrides) -> Path:
    """A tiny GLM-4.x checkpoint at tmp_dir/glm4_moe-<seed>-<layout>: random_dims(seed) with overrides."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    dims = {**random_dims(seed), **overrides}
    rope = dict(rope_type="default", rope_theta=dims.pop("rope_theta"), partial_rotary_factor=dims.pop("partial_rotary_factor"))
    tag = "-".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    out = Path(tmp_dir) / f"glm4_moe-{seed}-{layout}{'-' + tag if tag else ''}"
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("glm4_moe", rope_parameters=rope, **dims))
    # fresh values at realistic scales (transformers' init leaves norms at 1, biases at 0)
    state = redraw(model.state_dict(), torch.Generator().manual_seed(seed))
    save_bf16(model, out, state, original_format=layout == "release", float32=_FLOAT32,
              extra=(lambda tensors: mtp_layer(tensors, dims["num_hidden_layers"])) if mtp else None)
    config = json.loads((out / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"], rope_scaling=None,
                  num_nextn_predict_layers=1 if mtp else 0, dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out
