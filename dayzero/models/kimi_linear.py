"""Kimi Linear (`kimi_linear`, arXiv 2510.26692): a hybrid of Kimi Delta Attention (KDA) layers and
NoPE MLA layers, with a sigmoid-routed MoE; Kimi K3's text tower.

Decoder layer i:  h = x + self_attn(input_layernorm(x));  out = h + MLP(post_attention_layernorm(h))
`linear_attn_config` names the layers (1-based): `kda_layers` are KDA, `full_attn_layers` MLA.
    KDA (ops/kda.py), H heads of d channels (dk = dv = d), per token x:
        q, k, v = short_conv1d(q_proj(x)), ... (causal depthwise, kernel K, SiLU), per head [H, d]
        g = kda_gate(f_b_proj(f_a_proj(x)), A_log, dt_bias)   per-channel log decay [H, d]
        beta = sigmoid(b_proj(x))                              per head
        o = KDA(l2norm(q), l2norm(k), v, g, beta), scale d^-1/2 (kda_chunk for prompts, kda_recurrent
            for one-token decode: the same function)
        out = o_proj(gated_rms_norm(o, g_b_proj(g_a_proj(x)), o_norm.weight))   per head, over d
    MLA: DeepSeek's latent attention (absorbed form, ops/attention_mla.py) without RoPE
        (`mla_use_nope`: transformers and the released model apply no rotation; the "rope" dims of q
        and of the shared key still take part in the dot product, unrotated); q from q_proj, or
        q_b_proj(q_a_layernorm(q_a_proj(x))) with q_lora_rank; softmax scale (nope + rope)^-1/2.
    MLP: dense SwiGLU in the first first_k_dense_replace layers (`mlp_layer_types`), else shared
        experts + routed experts, routed by sigmoid scores with a correction bias (selection only),
        group-limited top-k, renormalised (`moe_renormalize`) and scaled by routed_scaling_factor:
        exactly DeepSeek-V3's noaux_tc router (ops/routing_deepseek.py).
Cache per layer (`cache.layers[i]`): KDA: `conv_q`, `conv_k`, `conv_v` [B, H*d, K-1] (the last K-1
projected inputs) and `recurrent` float32 [B, H, d, d], fixed-size; MLA: `kv_latent` [B, S, C] and
`k_pe` [B, S, Dr] per token.

Checkpoint (the released names, as transformers also saves them), per layer `model.layers.{i}.`:
    self_attn.{q,k,v}_proj, self_attn.{q,k,v}_conv1d.weight [H*d, 1, K], self_attn.{f_a,f_b,b,g_a,g_b,o}_proj,
    self_attn.A_log [1, 1, H, 1], self_attn.dt_bias [H*d] (float32), self_attn.o_norm.weight [d]   (KDA)
    self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj (MLA)
    mlp.{gate,up,down}_proj (dense layers)
    block_sparse_moe.gate.{weight, e_score_correction_bias} (float32), block_sparse_moe.shared_experts.*,
    block_sparse_moe.experts.{j}.{w1 (gate), w3 (up), w2 (down)}.weight, stacked at load into
    ops/moe.py's canonical w13 [E, 2I, H] / w2 [E, H, I]
"""

from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.models import register_model
from dayzero.models.base import CausalLM, KVCache, WeightTarget, copy_target, empty_param
from dayzero.models.layers import Embedding, Linear, RMSNorm
from dayzero.ops.moe import Activation, ExpertWeights
from dayzero.spec import AttentionSpec, ModelSpec, UnsupportedModelError

KDA_CHUNK_SIZE = 64  # tokens per chunk of kda_chunk (FLA's chunk_kda)
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps


def _unsupported(config: dict, field: str, value, supported) -> UnsupportedModelError:
    return UnsupportedModelError(field, value, supported, f"config.json ({config.get('model_type')})")


class ShortConv(nn.Module):
    """A depthwise causal conv1d: `weight` [channels, 1, kernel] as nn.Conv1d stores it."""

    def __init__(self, channels: int, kernel: int, dtype, device):
        super().__init__()
        self.weight = empty_param((channels, 1, kernel), dtype, device)

    def forward(self, x: torch.Tensor, layer_cache: dict | None, name: str) -> torch.Tensor:
        state = None if layer_cache is None else layer_cache.get(name)
        y, state = ops.short_conv1d(x, self.weight[:, 0], state, "silu")
        if layer_cache is not None:
            layer_cache[name] = state
        return y


class DeltaAttention(nn.Module):
    """One KDA layer (module docstring); keeps conv_{q,k,v} and `recurrent` in its layer cache."""

    def __init__(self, attn: AttentionSpec, hidden: int, eps: float, dtype, device):
        super().__init__()
        self.heads, self.head_dim, self.eps = attn.num_heads, attn.head_dim, eps
        self.lower_bound = attn.gate_lower_bound
        h, d = self.heads, self.head_dim
        width = h * d
        for name in ("q", "k", "v"):
            setattr(self, f"{name}_proj", Linear(hidden, width, dtype=dtype, device=device))
            setattr(self, f"{name}_conv1d", ShortConv(width, attn.conv_kernel, dtype, device))
        self.A_log = empty_param((1, 1, h, 1), torch.float32, device)
        self.dt_bias = empty_param((width,), torch.float32, device)
        self.f_a_proj = Linear(hidden, d, dtype=dtype, device=device)
        self.f_b_proj = Linear(d, width, dtype=dtype, device=device)
        self.b_proj = Linear(hidden, h, dtype=dtype, device=device)
        self.g_a_proj = Linear(hidden, d, dtype=dtype, device=device)
        self.g_b_proj = Linear(d, width, dtype=dtype, device=device)
        self.o_norm = nn.Module()
        self.o_norm.weight = empty_param((d,), dtype, device)
        self.o_proj = Linear(width, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, layer_cache: dict | None) -> torch.Tensor:
        b, t, _ = x.shape
        heads = (b, t, self.heads, self.head_dim)
        q = self.q_conv1d(self.q_proj(x), layer_cache, "conv_q").view(heads)
        k = self.k_conv1d(self.k_proj(x), layer_cache, "conv_k").view(heads)
        v = self.v_conv1d(self.v_proj(x), layer_cache, "conv_v").view(heads)
        g = ops.kda_gate(self.f_b_proj(self.f_a_proj(x)).view(heads), self.A_log.view(-1), self.dt_bias,
                         self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x))
        state = None if layer_cache is None else layer_cache.get("recurrent")
        if t == 1:  # decode
            o, state = ops.kda_recurrent(q, k, v, g, beta, state)
        else:
            o, state = ops.kda_chunk(q, k, v, g, beta, state, chunk_size=KDA_CHUNK_SIZE)
        if layer_cache is not None:
            layer_cache["recurrent"] = state
        gate = self.g_b_proj(self.g_a_proj(x)).view(heads)
        out = ops.gated_rms_norm(o, gate, self.o_norm.weight, self.eps)
        return self.o_proj(out.reshape(b, t, -1))


def _append(layer_cache: dict | None, name: str, new: torch.Tensor) -> torch.Tensor:
    """Append this step's entries [B, T, ...] to the cached ones along the token dim; returns all."""
    if layer_cache is None:
        return new
    full = new if name not in layer_cache else torch.cat([layer_cache[name], new], dim=1)
    layer_cache[name] = full
    return full


class MLAttention(nn.Module):
    """NoPE MLA in the absorbed form: w_uk / w_uv split from kv_b_proj at load (`post_load`)."""

    def __init__(self, attn: AttentionSpec, hidden: int, dtype, device):
        super().__init__()
        self.heads, self.nope, self.rope_dim = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
        self.v_dim, self.rank, self.q_rank = attn.v_head_dim, attn.kv_lora_rank, attn.q_lora_rank
        qk_dim = self.nope + self.rope_dim
        h = self.heads
        if self.q_rank is None:
            self.q_proj = Linear(hidden, h * qk_dim, dtype=dtype, device=device)
        else:
            self.q_a_proj = Linear(hidden, self.q_rank, bias=attn.bias, dtype=dtype, device=device)
            self.q_a_layernorm = RMSNorm(self.q_rank, LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = Linear(self.q_rank, h * qk_dim, dtype=dtype, device=device)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope_dim, bias=attn.bias, dtype=dtype, device=device)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype, device)
        self.kv_b_proj = Linear(self.rank, h * (self.nope + self.v_dim), dtype=dtype, device=device)
        self.o_proj = Linear(h * self.v_dim, hidden, bias=attn.bias, dtype=dtype, device=device)
        self.scale = qk_dim**-0.5

    def post_load(self) -> None:
        """Split kv_b_proj per head into the absorbed form's w_uk [H, Dn, C] and w_uv [H, Dv, C]."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        self.register_buffer("w_uk", w[:, : self.nope].contiguous(), persistent=False)
        self.register_buffer("w_uv", w[:, self.nope:].contiguous(), persistent=False)

    def forward(self, x: torch.Tensor, layer_cache: dict | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x) if self.q_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, self.heads, self.nope + self.rope_dim)
        kv = self.kv_a_proj_with_mqa(x)
        latent = _append(layer_cache, "kv_latent", self.kv_a_layernorm(kv[..., : self.rank]))
        k_pe = _append(layer_cache, "k_pe", kv[..., self.rank:])  # NoPE: the shared key dims stay unrotated
        out = ops.mla_attention(q[..., : self.nope], q[..., self.nope:], latent, k_pe, self.w_uk, self.w_uv, self.scale)
        return self.o_proj(out.reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)); the dense MLP and the shared experts."""

    def __init__(self, hidden: int, inter: int, dtype, device):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, dtype=dtype, device=device)
        self.up_proj = Linear(hidden, inter, dtype=dtype, device=device)
        self.down_proj = Linear(inter, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


class Router(nn.Module):
    """`gate.weight` [E, hidden] and `gate.e_score_correction_bias` [E], both float32."""

    def __init__(self, num_experts: int, hidden: int, device):
        super().__init__()
        self.weight = empty_param((num_experts, hidden), torch.float32, device)
        self.e_score_correction_bias = empty_param((num_experts,), torch.float32, device)


class Experts(nn.Module):
    """Routed experts stacked in ops/moe.py's canonical layout, filled from the per-expert tensors
    `{j}.w1.weight` (gate) -> w13[j, :I], `{j}.w3.weight` (up) -> w13[j, I:], `{j}.w2.weight` -> w2[j]."""

    def __init__(self, num: int, hidden: int, inter: int, dtype, device):
        super().__init__()
        self.num, self.inter = num, inter
        self.w13 = empty_param((num, 2 * inter, hidden), dtype, device)
        self.w2 = empty_param((num, hidden, inter), dtype, device)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = {}
        for j in range(self.num):
            views = {"w1": self.w13[j, : self.inter], "w3": self.w13[j, self.inter:], "w2": self.w2[j]}
            for proj, view in views.items():
                name = f"{prefix}{j}.{proj}.weight"
                targets[name] = copy_target(view, name)
        return targets

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return ops.moe_experts_bf16(x, ids, weights, ExpertWeights("bf16", self.w13, self.w2), Activation("swiglu"))


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec, dtype, device):
        super().__init__()
        e = spec.experts
        self.routing = e.routing
        self.gate = Router(e.num, spec.hidden_size, device)
        self.experts = Experts(e.num, spec.hidden_size, e.intermediate_size, dtype, device)
        self.shared_experts = MLP(spec.hidden_size, e.shared_intermediate_size, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        r = self.routing
        logits = ops.linear(x.float(), self.gate.weight)
        ids, weights = ops.route_sigmoid_grouped(logits, self.gate.e_score_correction_bias, r.top_k, r.n_group,
                                                 r.topk_group, r.normalize, r.scaling_factor)
        y = self.experts(x, ids, weights) + self.shared_experts(x)
        return y.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, eps: float, dtype, device):
        super().__init__()
        layer = spec.layers[index]
        hidden = spec.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        if layer.attention.kind == "kda":
            self.self_attn = DeltaAttention(layer.attention, hidden, eps, dtype, device)
        else:
            self.self_attn = MLAttention(layer.attention, hidden, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.moe = layer.mlp.kind == "moe"
        if self.moe:
            self.block_sparse_moe = MoE(spec, dtype, device)
        else:
            self.mlp = MLP(hidden, layer.mlp.intermediate_size, dtype, device)

    def forward(self, x: torch.Tensor, layer_cache: dict | None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), layer_cache)
        mlp = self.block_sparse_moe if self.moe else self.mlp
        return h + mlp(self.post_attention_layernorm(h))


def _check_config(spec: ModelSpec, config: dict) -> None:
    """Raise UnsupportedModelError for a config value this file does not compute as transformers does."""
    if config.get("mla_use_nope") is not True:
        # transformers' kimi_linear never rotates; the released remote code rotates when this is false
        raise _unsupported(config, "mla_use_nope", config.get("mla_use_nope"), (True,))
    if config.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise _unsupported(config, "moe_router_activation_func", config["moe_router_activation_func"], ("sigmoid",))
    if config.get("hidden_act", "silu") != "silu":
        raise _unsupported(config, "hidden_act", config["hidden_act"], ("silu",))
    heads = config.get("num_attention_heads")
    if (config.get("num_key_value_heads") or heads) != heads:
        raise _unsupported(config, "num_key_value_heads", config["num_key_value_heads"], (heads,))
    if spec.quant.dense_format != "bf16" or spec.quant.method is not None:
        raise _unsupported(config, "quantization_config.quant_method", spec.quant.method, (None,))
    e = spec.experts
    if e is not None:
        if e.num_shared < 1:
            raise _unsupported(config, "num_shared_experts", e.num_shared, (">= 1",))
        if e.num % e.routing.n_group:
            raise _unsupported(config, "num_expert_group", e.routing.n_group, (f"a divisor of num_experts={e.num}",))
        if e.routing.topk_group < e.routing.n_group and e.num // e.routing.n_group < 2:
            raise _unsupported(config, "num_expert_group", e.routing.n_group, ("at most num_experts / 2",))


@register_model
class KimiLinearForCausalLM(CausalLM):
    model_types = ("kimi_linear",)

    def __init__(self, spec: ModelSpec, config: dict, dtype: torch.dtype, device: torch.device | str):
        super().__init__(spec, config, dtype, device)
        _check_config(spec, config)
        eps = float(config.get("rms_norm_eps", 1e-5))
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.model.layers = nn.ModuleList(DecoderLayer(spec, i, eps, dtype, device) for i in range(spec.num_layers))
        self.model.norm = RMSNorm(spec.hidden_size, eps, dtype, device)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, dtype=dtype, device=device)

    def post_load(self) -> None:
        for layer in self.model.layers:
            if isinstance(layer.self_attn, MLAttention):
                layer.self_attn.post_load()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """NoPE model: positions are checked but not used (KDA's recurrence carries order)."""
        self.check_inputs(input_ids, positions, cache, self.spec.vocab_size)
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, None if cache is None else cache.layers[i])
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        logits = ops.linear(x, head).float()
        if cache is not None:
            cache.length += input_ids.shape[1]
        return logits
