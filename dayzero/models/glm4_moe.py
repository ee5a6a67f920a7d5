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
from dayzero.models.base import CausalLM
from dayzero.models.deepseek_v3 import LAYOUTS, MLP, LinearFormats, MoE
from dayzero.models.layers import Embedding, Linear, RMSNorm, pre_norm_residuals
from dayzero.models.rotary import rope_from_config, rotate_partial
from dayzero.spec import GLM4_PARTIAL_ROTARY, GLM4_ROPE_THETA, AttentionSpec, ModelSpec, rope_fields
from dayzero.weights import Layout


class Glm4MoeAttention(nn.Module):
    """Cache streams "k", "v": entries [num_kv_heads, head_dim], the keys rotated."""

    def __init__(self, a: AttentionSpec, hidden: int, eps: float, dtype, device):
        super().__init__()
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


class Glm4MoeDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, config: dict, fmts: LinearFormats, index: int, dtype, device):
        super().__init__()
        prefix, eps, layer = f"model.layers.{index}.", float(config["rms_norm_eps"]), spec.layers[index]
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, dtype, device)
        self.self_attn = Glm4MoeAttention(layer.attention, spec.hidden_size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, dtype, device)
        if layer.mlp.kind == "moe":
            self.mlp = MoE(spec, fmts, prefix + "mlp.", dtype, device)
        else:
            self.mlp = MLP(fmts, prefix + "mlp.", spec.hidden_size, layer.mlp.intermediate_size, dtype, device)

    def blocks(self, cos: torch.Tensor, sin: torch.Tensor, cache) -> list:
        """The layer's two pre-norm blocks (models.layers.pre_norm_residuals)."""
        return [(self.input_layernorm, lambda x: self.self_attn(x, cos, sin, cache)),
                (self.post_attention_layernorm, self.mlp)]


@register_model
class Glm4MoeForCausalLM(CausalLM):
    model_types = ("glm4_moe",)

    def __init__(self, spec: ModelSpec, config: dict, dtype: torch.dtype, device: torch.device | str):
        super().__init__(spec, config, dtype, device)
        config = self.config
        params, theta, _ = rope_fields(config, GLM4_ROPE_THETA, GLM4_PARTIAL_ROTARY)
        self.rope = rope_from_config(params, spec.layers[0].attention.qk_rope_head_dim, theta)
        fmts, eps = LinearFormats(spec, config), float(config["rms_norm_eps"])
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.model.layers = nn.ModuleList(Glm4MoeDecoderLayer(spec, config, fmts, i, dtype, device)
                                          for i in range(spec.num_layers))
        self.model.norm = RMSNorm(spec.hidden_size, eps, dtype, device)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, dtype=dtype, device=device)

    def layouts(self) -> tuple[Layout, ...]:
        return LAYOUTS

    def ignore_patterns(self) -> tuple[str, ...]:
        """The MTP layers (model.layers.{n}, ...); zero-width shared experts when n_shared_experts is 0."""
        n = self.spec.num_layers
        patterns = tuple(rf"^model\.layers\.{n + k}\." for k in range(self.spec.mtp_layers))
        if self.spec.experts is not None and not self.spec.experts.num_shared:
            patterns += (r"\.mlp\.shared_experts\.",)
        return patterns + ((r"^lm_head\.weight$",) if self.spec.tie_word_embeddings else ())

    def cuda_graph_blocker(self, max_model_len: int) -> str | None:
        return None  # rope, paged GQA and the MoE layer: launches fixed by the batch size

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        cos, sin = self.rope.cos_sin(positions)
        x = self.model.embed_tokens(input_ids)
        x = pre_norm_residuals(x, [b for layer, c in zip(self.model.layers, cache.layers) for b in layer.blocks(cos, sin, c)])
        if cache.logits_indices is not None:
            x = x[cache.logits_indices]
        head = self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        return ops.linear(self.model.norm(x), head).float()
