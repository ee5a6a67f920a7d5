"""Qwen3.5-MoE (`qwen3_5_moe`, and its text tower alone, `qwen3_5_moe_text`): Gated DeltaNet layers beside
gated grouped-query attention (one layer in `full_attention_interval`), every MLP a softmax-routed MoE with
a sigmoid-gated shared expert.

Decoder layer i:  h = x + mixer(input_layernorm(x));  out = h + MoE(post_attention_layernorm(h))
    Norms (input, post-attention, final, q_norm, k_norm): zero-centred RMSNorm, the weight w shipped as an
        offset: normalise in float32, times (1 + w) in float32, cast back (transformers' Qwen3_5MoeRMSNorm).
    Gated DeltaNet (`linear_attn`, dayzero/ops/gdn.py), HK query/key heads of dk, HV value heads of dv:
        q | k | v = silu(causal depthwise conv over in_proj_qkv(x)), one convolution of 2 HK dk + HV dv channels
        g = -exp(A_log) softplus(in_proj_a(x) + dt_bias) [HV]  (kda_gate with one channel a head)
        beta = sigmoid(in_proj_b(x)) [HV]
        o = GDN(l2norm(q), l2norm(k), v, g, beta), scale dk^-1/2: gdn_chunk_varlen for a step's prompts,
            gdn_recurrent_slots for its decodes (states in their slots, as Kimi Linear's KDA)
        out = out_proj(RMSNorm(o) * norm.weight * silu(in_proj_z(x)))  per value head (gated_rms_norm "silu",
            all in float32 as fla's FusedRMSNormGated; transformers rounds the normed o to the model dtype
            before the weight: the same in float32)
    Gated attention (`self_attn`): q_proj gives per head [q (head_dim) | gate (head_dim)]; q and k through
        q_norm / k_norm per head; RoPE on the first d = int(head_dim * partial_rotary_factor) dims of each head
        (half-split pairs), the rest passes; o = GQA(q, k, v) * sigmoid(gate); o_proj. Biases on all four
        with `attention_bias`. MRoPE (rope_parameters' mrope_section, mrope_interleaved) rotates image tokens
        by their time, height and width positions; a text token has the three equal, where MRoPE is this
        1-D RoPE: text prompts only (the vision tower is not loaded).
    MoE: gate(x) logits in the model dtype, top-k, softmax over the k (ops.route_softmax_topk: the same as
        transformers' softmax over all E then renormalised over the k); routed SwiGLU experts (ops/moe.py's
        canonical layout) + sigmoid(shared_expert_gate(x)) * shared_expert(x).
Cache per layer: Gated DeltaNet: states "conv" [2 HK dk + HV dv, K - 1] and "recurrent" float32 [HV, dk, dv];
attention: streams "k", "v" [num_kv_heads, head_dim] (keys rotated).

Checkpoint (`model.layers.{i}.` below; a qwen3_5_moe checkpoint holds them under `model.language_model.`,
the vision tower under `model.visual.` and the multi-token-prediction layer under `mtp.`, neither loaded):
    linear_attn.{in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj}.weight, linear_attn.conv1d.weight
        [C, 1, K], linear_attn.{A_log, dt_bias} [HV], linear_attn.norm.weight [dv]
    self_attn.{q,k,v,o}_proj.weight (q_proj [heads x 2 head_dim, hidden]), self_attn.{q,k}_norm.weight
    mlp.gate.weight [E, hidden], mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight [1, hidden]
    mlp.experts.gate_up_proj [E, 2I, hidden] (gate rows, then up) and mlp.experts.down_proj [E, hidden, I]: the
        release (Qwen/Qwen3.5-*-A*B, bf16); transformers 5.25's save_pretrained writes them per expert,
        mlp.experts.{j}.{gate,up,down}_proj.weight. Both load (LAYOUTS), into ops/moe.py's w13 / w2.
"""

from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.models import register_model
from dayzero.models.base import CausalLM, empty_param
from dayzero.models.deepseek_v3 import LAYOUTS as DEEPSEEK_LAYOUTS
from dayzero.models.deepseek_v3 import MLP, Experts, LinearFormats
from dayzero.models.layers import Embedding, Linear, RMSNorm, decode_and_prompt_segments, lm_logits, pre_norm_residuals
from dayzero.models.rotary import rope_from_config, rotate_partial
from dayzero.ops.moe import Activation
from dayzero.spec import QWEN3_5_PARTIAL_ROTARY, QWEN3_5_ROPE_THETA, AttentionSpec, ModelSpec, rope_fields
from dayzero.weights import Layout, Rename

GDN_CHUNK_SIZE = 64  # tokens per chunk of gdn_chunk_varlen (fla's chunk_gated_delta_rule)

# The text tower's names under the wrapper's prefix; the release's stacked experts are cut per expert as
# DeepSeek-V3's in-memory layout does (transformers' save_pretrained writes them per expert already).
_TEXT = Rename(r"^model\.language_model\.", "model.")
LAYOUTS = (
    Layout("transformers", "model.language_model.layers.N.mlp.experts.J.gate_proj.weight (save_pretrained)", (_TEXT,)),
    DEEPSEEK_LAYOUTS[1].then(_TEXT, name="release", example="model.language_model.layers.N.mlp.experts.gate_up_proj"),
)


class CenteredRMSNorm(RMSNorm):
    """x normalised in float32, times (1 + weight) in float32, cast to x's dtype; `scale` = 1 + weight is
    made once the weight is loaded (post_load)."""

    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__(dim, eps, dtype, device)
        self.register_buffer("scale", torch.empty(dim, dtype=torch.float32, device=device), persistent=False)

    def post_load(self) -> None:
        self.scale.copy_(1 + self.weight.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.scale, self.eps, weight_in_float32=True)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.add_rms_norm(x, residual, self.scale, self.eps, weight_in_float32=True)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (module docstring); keeps "conv" and "recurrent" in its layer cache."""

    def __init__(self, a: AttentionSpec, hidden: int, eps: float, dtype, device):
        super().__init__()
        self.hv, self.hk, self.dk, self.dv, self.eps = a.num_heads, a.num_kv_heads, a.head_dim, a.v_head_dim, eps
        self.widths = (self.hk * self.dk, self.hk * self.dk, self.hv * self.dv)
        kw = dict(dtype=dtype, device=device)
        self.in_proj_qkv = Linear(hidden, sum(self.widths), **kw)
        self.in_proj_z = Linear(hidden, self.hv * self.dv, **kw)
        self.in_proj_b = Linear(hidden, self.hv, **kw)
        self.in_proj_a = Linear(hidden, self.hv, **kw)
        self.conv1d = nn.Module()
        self.conv1d.weight = empty_param((sum(self.widths), 1, a.conv_kernel), dtype, device)
        self.A_log = empty_param((self.hv,), torch.float32, device)  # float32 whatever they ship as (kda_gate)
        self.dt_bias = empty_param((self.hv,), torch.float32, device)
        self.norm = nn.Module()
        self.norm.weight = empty_param((self.dv,), dtype, device)
        self.out_proj = Linear(self.hv * self.dv, hidden, **kw)

    def _heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [..., C] -> q, k [..., HK, dk], v [..., HV, dv]."""
        q, k, v = y.split(self.widths, dim=-1)
        lead = y.shape[:-1]
        return q.reshape(*lead, self.hk, self.dk), k.reshape(*lead, self.hk, self.dk), v.reshape(*lead, self.hv, self.dv)

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        """x [N, hidden] (the step's packed tokens) -> [N, hidden]."""
        n = x.shape[0]
        qkv = self.in_proj_qkv(x)
        g = ops.kda_gate(self.in_proj_a(x).view(n, self.hv, 1), self.A_log, self.dt_bias)[..., 0]
        beta = torch.sigmoid(self.in_proj_b(x))
        conv_state = cache.get("conv")
        pool, slots = cache.state_pool("recurrent", (self.hv, self.dk, self.dv), torch.float32)
        weight, seqs = self.conv1d.weight[:, 0], cache.seqs
        qs = seqs.query_start_host
        outs, convs = [], []
        for first, end, decodes in decode_and_prompt_segments(seqs.runs):  # decodes: [B, 1]; prompts: packed
            rows = slice(qs[first], qs[end])
            state = None if conv_state is None else conv_state[first:end]
            if decodes:
                y, state = ops.short_conv1d(qkv[rows].unsqueeze(1), weight, state, "silu")
                o = ops.gdn_recurrent_slots(*self._heads(y), g[rows].unsqueeze(1), beta[rows].unsqueeze(1), pool,
                                            slots[first:end])
            else:
                starts = seqs.query_start[first:end + 1] - qs[first]
                host = tuple(t - qs[first] for t in qs[first:end + 1])
                y, state = ops.short_conv1d_varlen(qkv[rows], weight, starts, state, "silu")
                o = ops.gdn_chunk_varlen(*self._heads(y), g[rows], beta[rows], starts, host, pool, slots[first:end],
                                         chunk_size=GDN_CHUNK_SIZE)
            outs.append(o.reshape(-1, self.hv, self.dv))
            convs.append(state)
        cache["conv"] = torch.cat(convs)
        o = torch.cat(outs) if len(outs) > 1 else outs[0]
        o = ops.gated_rms_norm(o, self.in_proj_z(x).view(n, self.hv, self.dv), self.norm.weight, self.eps, "silu")
        return self.out_proj(o.reshape(n, -1))


class GatedAttention(nn.Module):
    """Cache streams "k", "v": entries [num_kv_heads, head_dim], the keys rotated."""

    def __init__(self, a: AttentionSpec, hidden: int, eps: float, dtype, device):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        kw = dict(bias=a.bias, dtype=dtype, device=device)
        self.q_proj = Linear(hidden, 2 * self.heads * self.head_dim, **kw)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, **kw)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim, **kw)
        self.o_proj = Linear(self.heads * self.head_dim, hidden, **kw)
        self.q_norm = CenteredRMSNorm(self.head_dim, eps, dtype, device)
        self.k_norm = CenteredRMSNorm(self.head_dim, eps, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """x [N, hidden] (the step's packed tokens) -> [N, hidden]."""
        n = x.shape[0]
        q, gate = self.q_proj(x).view(n, self.heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        k = self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim))
        keys = cache.append("k", rotate_partial(k, cos, sin))
        values = cache.append("v", self.v_proj(x).view(n, self.kv_heads, self.head_dim))
        q = rotate_partial(self.q_norm(q.contiguous()), cos, sin)
        out = ops.paged_gqa_attention(q, keys, values, cache.seqs, self.head_dim ** -0.5)
        return self.o_proj(out.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1)))


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, fmts: LinearFormats, prefix: str, dtype, device):
        super().__init__()
        e, hidden = spec.experts, spec.hidden_size
        self.top_k = e.top_k
        self.gate = Linear(hidden, e.num, dtype=dtype, device=device)
        self.experts = Experts(e.format, e.num, hidden, e.intermediate_size, dtype, device)
        self.shared_expert = MLP(fmts, prefix + "shared_expert.", hidden, e.shared_intermediate_size, dtype, device)
        self.shared_expert_gate = Linear(hidden, 1, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = ops.route_softmax_topk(self.gate(x), self.top_k)
        op = ops.moe_experts_fp8 if self.experts.fmt == "fp8" else ops.moe_experts_bf16
        routed = self.experts.shard.run(op, x, ids, weights, self.experts.weights(), Activation("swiglu"))
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, fmts: LinearFormats, index: int, eps: float, dtype, device):
        super().__init__()
        a, hidden = spec.layers[index].attention, spec.hidden_size
        self.input_layernorm = CenteredRMSNorm(hidden, eps, dtype, device)
        if a.kind == "gdn":
            self.linear_attn = GatedDeltaNet(a, hidden, eps, dtype, device)
        else:
            self.self_attn = GatedAttention(a, hidden, eps, dtype, device)
        self.post_attention_layernorm = CenteredRMSNorm(hidden, eps, dtype, device)
        self.mlp = SparseMoeBlock(spec, fmts, f"model.layers.{index}.mlp.", dtype, device)

    def blocks(self, cos, sin, cache) -> list:
        """The layer's two pre-norm blocks (models.layers.pre_norm_residuals)."""
        if hasattr(self, "linear_attn"):
            mixer = lambda x: self.linear_attn(x, cache)  # noqa: E731
        else:
            mixer = lambda x: self.self_attn(x, cos, sin, cache)  # noqa: E731
        return [(self.input_layernorm, mixer), (self.post_attention_layernorm, self.mlp)]


@register_model
class Qwen3_5MoeForCausalLM(CausalLM):
    """Qwen3.5-MoE's text tower, from a qwen3_5_moe checkpoint (text prompts) or a qwen3_5_moe_text one."""

    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")

    def __init__(self, spec: ModelSpec, config: dict, dtype: torch.dtype, device: torch.device | str):
        super().__init__(spec, config, dtype, device)
        text = self.config["text_config"] if spec.model_type == "qwen3_5_moe" else self.config
        eps = float(text["rms_norm_eps"])
        params, theta, _ = rope_fields(text, QWEN3_5_ROPE_THETA, QWEN3_5_PARTIAL_ROTARY)
        full = [layer.attention for layer in spec.layers if layer.attention.kind == "gqa"]
        self.rope = rope_from_config(params, full[0].qk_rope_head_dim, theta) if full else None
        fmts = LinearFormats(spec, text)
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.model.layers = nn.ModuleList(DecoderLayer(spec, fmts, i, eps, dtype, device) for i in range(spec.num_layers))
        self.model.norm = CenteredRMSNorm(spec.hidden_size, eps, dtype, device)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, dtype=dtype, device=device)

    def layouts(self) -> tuple[Layout, ...]:
        return LAYOUTS

    def ignore_patterns(self) -> tuple[str, ...]:
        """The vision tower and the multi-token-prediction layer (text prompts); lm_head when tied."""
        return (r"^model\.visual\.", r"^mtp\.") + ((r"^lm_head\.weight$",) if self.spec.tie_word_embeddings else ())

    def post_load(self) -> None:
        for module in self.modules():
            if isinstance(module, CenteredRMSNorm):
                module.post_load()

    def cuda_graph_blocker(self, max_model_len: int) -> str | None:
        """A decode step's Gated DeltaNet is one [B, 1] block of static-shape ops, attention as GLM's."""
        return None

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        cos, sin = self.rope.cos_sin(positions) if self.rope is not None else (None, None)
        x = self.model.embed_tokens(input_ids)
        x = pre_norm_residuals(x, [b for layer, c in zip(self.model.layers, cache.layers) for b in layer.blocks(cos, sin, c)])
        head = self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        return lm_logits(x, cache, self.model.norm, head)
