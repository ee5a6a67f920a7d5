"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`, Zhipu AI 2025): grouped-query attention with partial rotary and
optional QK norm, and DeepSeek-V3's MoE (sigmoid-scored, group-limited routing with a correction bias,
shared experts, dense first layers).

Decoder layer i:  h = x + o_proj(GQA(input_layernorm(x)));  out = h + MLP(post_attention_layernorm(h))
    GQA: q, k, v = q_proj(x), k_proj(x), v_proj(x) per head (biases on these three when
         `attention_bias`, never on o_proj); with `use_qk_norm`, RMSNorm over head_dim on every query
         and key head (q_norm, k_norm, eps rms_norm_eps); then RoPE on the first dims of each head only
         (half-split pairs over d = int(head_dim * partial_rotary_factor) frequencies' worth: ceil(d/2)
         pairs), the rest passes through; softmax scale head_dim^-1/2, no window, no sinks.
    MLP: dense SwiGLU in the first first_k_dense_replace layers, else DeepSeek-V3's MoE block
         (models/deepseek_v3.py: `MoE`, float32 router + correction bias, ops.route_sigmoid_grouped,
         stacked routed experts, shared experts of n_shared_experts x moe_intermediate_size).
Cache per layer: streams "k", "v" [num_kv_heads, head_dim] (rotated keys, values), as gpt-oss's.

Checkpoint (released zai-org/GLM-4.5, -Air, 4.6, 4.7: bf16, Hugging Face names; what transformers'
save_pretrained writes too), per layer `model.layers.{i}.`:
    self_attn.{q,k,v}_proj.{weight,bias}, self_attn.o_proj.weight, self_attn.{q,k}_norm.weight
    mlp.{gate,up,down}_proj.weight (dense layers)
    mlp.gate.weight, mlp.gate.e_score_correction_bias (float32), mlp.shared_experts.{gate,up,down}_proj.weight,
    mlp.experts.{j}.{gate,up,down}_proj.weight (stacked at load into ops/moe.py's canonical layout)
transformers' in-memory names (stacked `mlp.experts.gate_up_proj` / `down_proj`) load through DeepSeek-V3's
layouts. The multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`) is not loaded.
"""

from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.models import register_model
from dayzero.models.deepseek_v3 import DecoderLayer, DeepseekV3ForCausalLM, LinearFormats
from dayzero.models.layers import Linear, RMSNorm
from dayzero.models.rotary import rope_from_config, rotate_partial
from dayzero.spec import GLM4_PARTIAL_ROTARY, GLM4_ROPE_THETA, AttentionSpec, ModelSpec, rope_fields


class Glm4MoeAttention(nn.Module):
    """Cache streams "k", "v": entries [num_kv_heads, head_dim], the keys rotated."""

    def __init__(self, a: AttentionSpec, hidden: int, config: dict, fmts: LinearFormats, prefix: str, dtype, device):
        """As DeepSeek-V3's MLAttention is built; every projection bf16 (fmts and prefix name FP8 modules)."""
        super().__init__()
        eps = float(config["rms_norm_eps"])
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        kw = dict(dtype=dtype, device=device)
        self.q_proj = Linear(hidden, self.heads * self.head_dim, bias=a.qkv_bias, **kw)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=a.qkv_bias, **kw)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=a.qkv_bias, **kw)
        self.o_proj = Linear(self.heads * self.head_dim, hidden, **kw)
        if a.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype, device)
        self.qk_norm = a.qk_norm

    def post_load(self) -> None:
        """Nothing derived (MLA's absorbed matrices are its own)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """x [N, hidden] (the step's packed tokens) -> [N, hidden]."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        keys = cache.append("k", rotate_partial(k, cos, sin))
        values = cache.append("v", self.v_proj(x).view(n, self.kv_heads, self.head_dim))
        out = ops.paged_gqa_attention(rotate_partial(q, cos, sin), keys, values, cache.seqs, self.head_dim ** -0.5)
        return self.o_proj(out.reshape(n, -1))


class Glm4MoeDecoderLayer(DecoderLayer):
    """DeepSeek-V3's decoder layer (norms, dense MLP or MoE block) with GQA in place of MLA."""

    attention_class = Glm4MoeAttention


@register_model
class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3's model (embedding, layers, the MTP layers skipped, its layouts, final norm and head) with
    GLM's decoder layer and partial-rotary table."""

    model_types = ("glm4_moe",)
    tensor_parallel = False  # not built yet: GQA's heads are not split (docs/day0.md)
    expert_parallel = False
    decoder_layer = Glm4MoeDecoderLayer

    @staticmethod
    def make_rope(spec: ModelSpec, config: dict):
        params, theta, _ = rope_fields(config, GLM4_ROPE_THETA, GLM4_PARTIAL_ROTARY)
        return rope_from_config(params, spec.layers[0].attention.qk_rope_head_dim, theta)
