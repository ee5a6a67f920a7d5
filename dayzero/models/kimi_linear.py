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
Cache per layer (`cache.layers[i]`): KDA: states `conv_q`, `conv_k`, `conv_v` [H*d, K-1] (the last
K-1 projected inputs) and `recurrent` float32 [H, d, d] per sequence; MLA: streams `kv_latent` [C]
and `k_pe` [Dr] per token. KDA runs on segments of the packed step: consecutive decodes as one [B, 1]
block (the recurrent form, states updated in their slots), consecutive prompt chunks of any lengths as
one packed varlen call (short_conv1d_varlen, kda_chunk_varlen: states from and back to their slots).

Checkpoint (the released names, as transformers also saves them), per layer `model.layers.{i}.`:
    self_attn.{q,k,v}_proj, self_attn.{q,k,v}_conv1d.weight [H*d, 1, K], self_attn.{f_a,f_b,b,g_a,g_b,o}_proj,
    self_attn.A_log [1, 1, H, 1], self_attn.dt_bias [H*d] (float32), self_attn.o_norm.weight [d]   (KDA)
    self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj (MLA)
    mlp.{gate,up,down}_proj (dense layers)
    block_sparse_moe.gate.{weight, e_score_correction_bias} (float32), block_sparse_moe.shared_experts.*,
    block_sparse_moe.experts.{j}.{w1 (gate), w3 (up), w2 (down)}.weight, stacked at load into
    ops/moe.py's canonical w13 [E, 2I, H] / w2 [E, H, I]

Kimi K3 (`kimi_k3` wrapper: `text_config`, tensors under `language_model.`; docs/kimi_k3.md), each
addition driven by its config field, so that a checkpoint without the field runs as Kimi Linear:
    attn_res_block_size      Block Attention Residuals: the attention input, the MLP input and the
                             final norm's input are softmax mixes of the embedding, completed block
                             sums and the partial block (k3_parts.AttentionResidualState)
    routed_expert_hidden_size, latent_moe_use_norm   latent MoE: experts run between
                             routed_expert_down_proj and (routed_expert_norm,) routed_expert_up_proj
    hidden_act: situ         SiTU in the dense MLP, shared and routed experts
    mla_use_output_gate      o * sigmoid(g_proj(x)) before the MLA o_proj
    linear_attn_config.use_full_rank_gate   KDA output gate g_proj(x) instead of g_b_proj(g_a_proj(x))
    linear_attn_config.gate_lower_bound     g = lower_bound * sigmoid(exp(A_log) (raw + dt_bias))
                             (A_log ships [head_dim]: H values, then zeros)
    quantization_config compressed-tensors mxfp4-pack-quantized   routed experts kept packed as
                             canonical MXFP4 (`experts.{j}.{w}.weight_packed` / `weight_scale`)
The vision tower, the projector and MTP layers of a K3 checkpoint are not loaded (text prompts).

Split over processes (docs/parallel.md), K3 as Kimi Linear: KDA and MLA heads over tp (every per-head
tensor by head, K3's output gates `g_proj` too), dense MLPs, shared experts and the vocabulary over tp,
the routed experts (bf16 or MXFP4, as stored) over ep; the router, the norms, MLA's latent projections,
the attention residual mixers and the latent MoE's routed_expert_{down_proj,norm,up_proj} whole.
"""

from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.models import register_model
from dayzero.models.base import CausalLM, WeightTarget, collect_weight_targets, copy_target, empty_param
from dayzero.models.k3_parts import (AttentionResidual, AttentionResidualState, CompressedTensorsMxfp4Experts, LatentMoE,
                                     MLAOutputGate)
from dayzero.models.layers import BiasedRouter, Linear, RMSNorm, decode_and_prompt_segments, pre_norm_residuals
from dayzero.models.sharded import ColumnLinear, ExpertShard, RowLinear, VocabEmbedding, other_ranks_experts, shard_target
from dayzero.parallel import comm
from dayzero.parallel.state import current
from dayzero.ops.k3 import SituActivation
from dayzero.ops.moe import Activation, ExpertWeights
from dayzero.spec import ActivationSpec, AttentionSpec, ModelSpec
from dayzero.weights import FLOAT_DTYPES, Chunk, Layout, Rename, TensorSpec, Unstack

KDA_CHUNK_SIZE = 64  # tokens per chunk of kda_chunk (FLA's chunk_kda)
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps

# Tensor layouts (dayzero.weights.layouts), each mapped onto the released names above.
# transformers' save_pretrained writes those, except that the dense layers' MLP is saved as
# `block_sparse_moe.{gate,up,down}_proj`; its in-memory names (save_original_format=False) call
# every MLP `mlp`, hold the KDA gate's f_a/f_b/dt_bias/A_log under `self_attn.forget_gate.`, the
# three short convolutions as one `self_attn.conv1d.weight` [3 H*d, 1, K] (q, k, v), and stack the
# routed experts as gate_up_proj [E, 2I, H] (w1 rows, then w3) and down_proj [E, H, I].
_DENSE_MLP = Rename(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r".mlp.\1.")
_IN_MEMORY = (
    Rename(r"\.mlp\.(?!(gate_proj|up_proj|down_proj)\.)", ".block_sparse_moe."),
    Rename(r"\.self_attn\.forget_gate\.", ".self_attn."),
    Chunk(r"\.self_attn\.conv1d\.weight$", tuple(f".self_attn.{x}_conv1d.weight" for x in "qkv")),
    Unstack(r"\.experts\.(gate_up_proj|down_proj)$", r".experts.{i}.\1"),
    Chunk(r"\.experts\.(\d+)\.gate_up_proj$", (r".experts.\1.w1.weight", r".experts.\1.w3.weight")),
    Rename(r"\.experts\.(\d+)\.down_proj$", r".experts.\1.w2.weight"),
)
LAYOUTS = (
    Layout("release", "model.layers.N.mlp.gate_proj.weight (dense), model.layers.N.block_sparse_moe.experts.J.w1.weight"),
    Layout("transformers", "model.layers.N.block_sparse_moe.gate_proj.weight (dense)", (_DENSE_MLP,)),
    Layout("transformers in-memory", "model.layers.N.mlp.experts.gate_up_proj, self_attn.conv1d.weight", _IN_MEMORY),
)
# Kimi K3 (`kimi_k3` wrapper): the text tower's names under `language_model.` as released, or where
# transformers places a wrapper's language model in memory (`model.language_model.`, `lm_head.`).
_WRAPPED_IN_MEMORY = (
    Rename(r"^model\.language_model\.", "language_model.model."),
    Rename(r"^lm_head\.", "language_model.lm_head."),
    Rename(r"^model\.(vision_tower|mm_projector)\.", r"\1."),
)
K3_LAYOUTS = (
    LAYOUTS[0].then(name="release", example="language_model.model.layers.N.mlp.gate_proj.weight (dense)"),
    LAYOUTS[1].then(example="language_model.model.layers.N.block_sparse_moe.gate_proj.weight (dense)"),
    LAYOUTS[2].then(*_WRAPPED_IN_MEMORY, example="model.language_model.layers.N.mlp.experts.gate_up_proj, lm_head.weight"),
)


class ShortConv(nn.Module):
    """A depthwise causal conv1d: `weight` [channels, 1, kernel] as nn.Conv1d stores it."""

    def __init__(self, channels: int, kernel: int, dtype, device):
        super().__init__()
        self.weight = empty_param((channels, 1, kernel), dtype, device)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, channels], state [B, channels, K - 1] or None (zeros) -> (y, new state)."""
        return ops.short_conv1d(x, self.weight[:, 0], state, "silu")

    def varlen(self, x: torch.Tensor, starts: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, channels] of sequences packed from device offsets `starts` [B + 1] -> (y, new states)."""
        return ops.short_conv1d_varlen(x, self.weight[:, 0], starts, state, "silu")


class DeltaAttention(nn.Module):
    """One KDA layer (module docstring); keeps conv_{q,k,v} and `recurrent` in its layer cache."""

    def __init__(self, attn: AttentionSpec, hidden: int, eps: float, dtype, device):
        """attn.num_heads: the model's; a tensor-parallel rank holds its heads' share of every per-head
        tensor (q/k/v, their convolutions, the gate's f_b, b, g_b and A_log / dt_bias, o_proj's columns),
        and its states hold those heads only (dayzero.parallel.spec)."""
        super().__init__()
        p = current()
        self.head_range = p.split(attn.num_heads, "linear_attn_config.num_heads")
        self.heads, self.head_dim, self.eps = attn.num_heads // p.tp_size, attn.head_dim, eps
        self.full_heads = attn.num_heads
        self.lower_bound = attn.gate_lower_bound
        h, d = attn.num_heads, self.head_dim
        width = h * d  # the model's; ColumnLinear / RowLinear hold this rank's share
        self.channels = (self.head_range[0] * d, self.head_range[1] * d)
        kw = dict(dtype=dtype, device=device)
        for name in ("q", "k", "v"):
            setattr(self, f"{name}_proj", ColumnLinear(hidden, width, name=f"{name}_proj", **kw))
            setattr(self, f"{name}_conv1d", ShortConv(self.heads * d, attn.conv_kernel, dtype, device))
        self.A_log = empty_param((1, 1, self.heads, 1), torch.float32, device)
        self.dt_bias = empty_param((self.heads * d,), torch.float32, device)
        self.f_a_proj = Linear(hidden, d, **kw)
        self.f_b_proj = ColumnLinear(d, width, name="f_b_proj", **kw)
        self.b_proj = ColumnLinear(hidden, h, name="b_proj", **kw)
        self.full_rank_gate = attn.output_gate == "full_rank"
        if self.full_rank_gate:  # K3 `use_full_rank_gate`
            self.g_proj = ColumnLinear(hidden, width, name="g_proj", **kw)
        else:
            self.g_a_proj = Linear(hidden, d, **kw)
            self.g_b_proj = ColumnLinear(d, width, name="g_b_proj", **kw)
        self.o_norm = nn.Module()
        self.o_norm.weight = empty_param((d,), dtype, device)
        self.o_proj = RowLinear(width, hidden, name="o_proj", **kw)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """As named, except A_log: Kimi Linear ships [1, 1, H, 1]; K3 ships [head_dim], H values then
        zeros. Both load into A_log's H values; any other shape or a non-zero tail is refused."""
        targets = collect_weight_targets(self, prefix)
        (first, last), heads, a_log = self.head_range, self.full_heads, self.A_log

        def assign(t: torch.Tensor) -> None:
            flat = t.reshape(-1)
            if flat.numel() < heads or bool(flat[heads:].ne(0).any()):
                raise ValueError(f"{prefix}A_log: expected {heads} per-head values (then only zero padding), "
                                 f"got shape {tuple(t.shape)}")
            with torch.no_grad():
                a_log.copy_(flat[first:last].view(a_log.shape))  # this rank's heads

        targets[prefix + "A_log"] = WeightTarget(TensorSpec(None, FLOAT_DTYPES), assign)
        if current().tp_size > 1:  # this rank's channels of the per-channel tensors
            start, stop = self.channels
            width = self.heads * self.head_dim * current().tp_size
            for name in ("q", "k", "v"):
                conv = getattr(self, f"{name}_conv1d").weight
                targets[f"{prefix}{name}_conv1d.weight"] = shard_target(conv, (width, 1, conv.shape[2]), 0, start, stop)
            targets[prefix + "dt_bias"] = shard_target(self.dt_bias, (width,), 0, start, stop)
        return targets

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        """x [N, hidden] (the step's packed tokens) -> [N, hidden]."""
        n = x.shape[0]
        heads = (n, self.heads, self.head_dim)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        g = ops.kda_gate(self.f_b_proj(self.f_a_proj(x)).view(heads), self.A_log.view(-1), self.dt_bias,
                         self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x))
        names = ("conv_q", "conv_k", "conv_v")
        states = [cache.get(name) for name in names]
        # the recurrent states are read and written in their pool: decodes in place (kda_recurrent_slots),
        # prompts from and back to their slots
        pool, slots = cache.state_pool("recurrent", (self.heads, self.head_dim, self.head_dim), torch.float32)
        outs, new_states = [], [[] for _ in names]
        seqs = cache.seqs
        convs = ((self.q_conv1d, q), (self.k_conv1d, k), (self.v_conv1d, v))
        for first, end, decodes in decode_and_prompt_segments(seqs.runs):  # decodes: [B, 1]; prompt chunks: packed varlen
            qs = seqs.query_start_host
            rows = slice(qs[first], qs[end])
            part = [None if s is None else s[first:end] for s in states]
            parts = []
            if decodes:
                shape = (end - first, 1, self.heads, self.head_dim)
                for j, (conv, proj) in enumerate(convs):
                    y, st = conv(proj[rows].view(end - first, 1, -1), part[j])
                    parts.append(y.view(shape))
                    new_states[j].append(st)
                o = ops.kda_recurrent_slots(*parts, g[rows].view(shape), beta[rows].view(shape[:3]), pool,
                                            slots[first:end])
            else:
                starts = seqs.query_start[first:end + 1] - qs[first]
                host = tuple(x - qs[first] for x in qs[first:end + 1])
                shape = (rows.stop - rows.start, self.heads, self.head_dim)
                for j, (conv, proj) in enumerate(convs):
                    y, st = conv.varlen(proj[rows], starts, part[j])
                    parts.append(y.view(shape))
                    new_states[j].append(st)
                o = ops.kda_chunk_varlen(*parts, g[rows], beta[rows], starts, host, pool, slots[first:end],
                                         chunk_size=KDA_CHUNK_SIZE)
            outs.append(o.reshape(-1, self.heads, self.head_dim))
        for name, parts in zip(names, new_states):
            cache[name] = torch.cat(parts)
        o = torch.cat(outs) if len(outs) > 1 else outs[0]
        gate = (self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))).view(heads)
        out = ops.gated_rms_norm(o, gate, self.o_norm.weight, self.eps)
        return self.o_proj(out.reshape(n, -1))



class MLAttention(nn.Module):
    """NoPE MLA in the absorbed form: w_uk / w_uv split from kv_b_proj at load (`post_load`)."""

    def __init__(self, attn: AttentionSpec, hidden: int, dtype, device):
        super().__init__()
        h = attn.num_heads  # the model's; a tensor-parallel rank holds h / tp (q, kv_b and K3's g_proj by rows,
        # o by columns); the latent (q_a, kv_a and their norms) whole
        first, last = current().split(h, "num_attention_heads")
        self.heads, self.nope, self.rope_dim = last - first, attn.qk_nope_head_dim, attn.qk_rope_head_dim
        self.v_dim, self.rank, self.q_rank = attn.v_head_dim, attn.kv_lora_rank, attn.q_lora_rank
        qk_dim = self.nope + self.rope_dim
        kw = dict(dtype=dtype, device=device)
        if self.q_rank is None:
            self.q_proj = ColumnLinear(hidden, h * qk_dim, name="q_proj", **kw)
        else:
            self.q_a_proj = Linear(hidden, self.q_rank, bias=attn.bias, **kw)
            self.q_a_layernorm = RMSNorm(self.q_rank, LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = ColumnLinear(self.q_rank, h * qk_dim, name="q_b_proj", **kw)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope_dim, bias=attn.bias, **kw)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype, device)
        self.kv_b_proj = ColumnLinear(self.rank, h * (self.nope + self.v_dim), name="kv_b_proj", **kw)
        self.o_proj = RowLinear(h * self.v_dim, hidden, bias=attn.bias, name="o_proj", **kw)
        if attn.output_gate == "sigmoid":  # K3 `mla_use_output_gate`: o * sigmoid(g_proj(x)) before o_proj
            self.g_proj = MLAOutputGate(hidden, h * self.v_dim, bias=attn.bias, dtype=dtype, device=device)
        else:
            self.g_proj = None
        self.scale = qk_dim**-0.5

    def post_load(self) -> None:
        """Split kv_b_proj per head into the absorbed form's w_uk [H, Dn, C] and w_uv [H, Dv, C]."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        self.register_buffer("w_uk", w[:, : self.nope].contiguous(), persistent=False)
        self.register_buffer("w_uv", w[:, self.nope:].contiguous(), persistent=False)

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        """x [N, hidden] (the step's packed tokens) -> [N, hidden]."""
        n = x.shape[0]
        q = self.q_proj(x) if self.q_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, self.heads, self.nope + self.rope_dim)
        kv = self.kv_a_proj_with_mqa(x)
        latent = cache.append("kv_latent", self.kv_a_layernorm(kv[..., : self.rank]))
        k_pe = cache.append("k_pe", kv[..., self.rank:].contiguous())  # NoPE: the shared key dims stay unrotated
        out = ops.paged_mla_attention(q[..., : self.nope], q[..., self.nope:], latent, k_pe, self.w_uk, self.w_uv,
                                      self.scale, cache.seqs)
        out = out.reshape(n, -1)
        if self.g_proj is not None:
            out = self.g_proj(out, x)
        return self.o_proj(out)


def _gated(activation: ActivationSpec, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if activation.kind == "situ":
        return ops.situ(gate, up, activation.beta, activation.linear_beta)
    return ops.swiglu(gate, up)


def _expert_activation(activation: ActivationSpec) -> Activation:
    """The activation object the routed-expert ops apply between their two projections."""
    if activation.kind == "situ":
        return SituActivation(beta=activation.beta, linear_beta=activation.linear_beta)
    return Activation("swiglu")


class MLP(nn.Module):
    """down_proj(act(gate_proj(x), up_proj(x))), act SwiGLU (or K3's SiTU); the dense MLP and the
    shared experts."""

    def __init__(self, hidden: int, inter: int, activation: ActivationSpec, dtype, device):
        super().__init__()
        self.activation = activation  # the intermediate features split over the tensor-parallel ranks
        self.gate_proj = ColumnLinear(hidden, inter, name="gate_proj", dtype=dtype, device=device)
        self.up_proj = ColumnLinear(hidden, inter, name="up_proj", dtype=dtype, device=device)
        self.down_proj = RowLinear(inter, hidden, name="down_proj", dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_gated(self.activation, self.gate_proj(x), self.up_proj(x)))


class Experts(nn.Module):
    """Unquantized routed experts stacked in ops/moe.py's canonical layout, filled from the per-expert
    tensors `{j}.w1.weight` (gate) -> w13[j, :I], `{j}.w3.weight` (up) -> w13[j, I:], `{j}.w2.weight`
    -> w2[j]. dim: the width they read and write (hidden, or the latent width of a latent MoE)."""

    def __init__(self, num: int, inter: int, dim: int, dtype, device):
        """num: the model's experts; an expert-parallel rank holds [start, stop) (ExpertShard)."""
        super().__init__()
        self.shard = ExpertShard(num)
        num = self.shard.num_local
        self.num, self.inter = num, inter
        self.w13 = empty_param((num, 2 * inter, dim), dtype, device)
        self.w2 = empty_param((num, dim, inter), dtype, device)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = {}
        for j in range(self.num):
            views = {"w1": self.w13[j, : self.inter], "w3": self.w13[j, self.inter:], "w2": self.w2[j]}
            for proj, view in views.items():
                name = f"{prefix}{self.shard.start + j}.{proj}.weight"
                targets[name] = copy_target(view, name)
        return targets

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, activation: Activation) -> torch.Tensor:
        return self.shard.run(ops.moe_experts_bf16, x, ids, weights, ExpertWeights("bf16", self.w13, self.w2), activation)


class MoE(nn.Module):
    """Shared experts + routed experts routed on x. Routed experts bf16 (`Experts`) or compressed-tensors
    MXFP4 kept packed (K3); with `routed_expert_hidden_size` (K3 latent MoE) they run in the latent
    space between routed_expert_down_proj and routed_expert_up_proj (`LatentMoE`, mounted as
    `routed` but loading its tensors under this module's names)."""

    def __init__(self, spec: ModelSpec, activation: ActivationSpec, eps: float, dtype, device):
        super().__init__()
        e = spec.experts
        self.routing = e.routing
        self.activation = _expert_activation(activation)
        self.gate = BiasedRouter(e.num, spec.hidden_size, device)
        dim = e.latent_dim or spec.hidden_size
        if e.format == "mxfp4":
            experts = CompressedTensorsMxfp4Experts(e.num, e.intermediate_size, dim, device=device)
        else:
            experts = Experts(e.num, e.intermediate_size, dim, dtype, device)
        if e.latent_dim:
            self.routed = LatentMoE(spec.hidden_size, e.latent_dim, experts, self.activation, use_norm=e.latent_norm,
                                    eps=eps, dtype=dtype, device=device)
        else:
            self.experts = experts
        self.shared_experts = MLP(spec.hidden_size, e.shared_intermediate_size, activation, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        r = self.routing
        logits = ops.linear(x.float(), self.gate.weight)
        ids, weights = ops.route_sigmoid_grouped(logits, self.gate.e_score_correction_bias, r.top_k, r.n_group,
                                                 r.topk_group, r.normalize, r.scaling_factor)
        if hasattr(self, "routed"):
            y = self.routed(x, ids, weights)
        else:
            y = self.experts(x, ids, weights, self.activation)
        return (y + self.shared_experts(x)).view(shape)


class DecoderLayer(nn.Module):
    """attend: self_attn(input_layernorm(x)); feed_forward: MLP(post_attention_layernorm(h)). Plain
    residuals through `blocks`; with K3's attention residuals the model mixes the sublayer inputs."""

    def __init__(self, spec: ModelSpec, index: int, eps: float, dtype, device):
        super().__init__()
        layer = spec.layers[index]
        hidden = spec.hidden_size
        if layer.cross_layer == "attention_residual":
            self.self_attention_res = AttentionResidual(hidden, eps, dtype, device)
            self.mlp_res = AttentionResidual(hidden, eps, dtype, device)
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        if layer.attention.kind == "kda":
            self.self_attn = DeltaAttention(layer.attention, hidden, eps, dtype, device)
        else:
            self.self_attn = MLAttention(layer.attention, hidden, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.moe = layer.mlp.kind == "moe"
        if self.moe:
            self.block_sparse_moe = MoE(spec, layer.mlp.activation, eps, dtype, device)
        else:
            self.mlp = MLP(hidden, layer.mlp.intermediate_size, layer.mlp.activation, dtype, device)

    def attend(self, x: torch.Tensor, layer_cache) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x), layer_cache)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return (self.block_sparse_moe if self.moe else self.mlp)(self.post_attention_layernorm(h))

    def blocks(self, layer_cache) -> list:
        """The two plain pre-norm blocks (models.layers.pre_norm_residuals)."""
        return [(self.input_layernorm, lambda x: self.self_attn(x, layer_cache)),
                (self.post_attention_layernorm, self.block_sparse_moe if self.moe else self.mlp)]


@register_model
class KimiLinearForCausalLM(CausalLM):
    """Kimi Linear, and Kimi K3's text tower (`kimi_k3`: the wrapper's `text_config`, tensors under
    `language_model.`; the vision tower and MTP layers are not loaded: text prompts only)."""

    model_types = ("kimi_linear", "kimi_k3")

    def __init__(self, spec: ModelSpec, config: dict, dtype: torch.dtype, device: torch.device | str):
        super().__init__(spec, config, dtype, device)
        wrapped = spec.model_type == "kimi_k3"
        text = self.config["text_config"] if wrapped else self.config
        self.checkpoint_prefix = "language_model." if wrapped else ""
        eps = float(text["rms_norm_eps"])
        self.attn_res_block = spec.cross_layer.attn_res_block_size if spec.cross_layer.kind == "attention_residual" else None
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.model.layers = nn.ModuleList(DecoderLayer(spec, i, eps, dtype, device) for i in range(spec.num_layers))
        if self.attn_res_block:
            self.model.output_attn_res = AttentionResidual(spec.hidden_size, eps, dtype, device)
        self.model.norm = RMSNorm(spec.hidden_size, eps, dtype, device)
        if not spec.tie_word_embeddings:
            self.lm_head = ColumnLinear(spec.hidden_size, spec.vocab_size, gather=True, name="lm_head (vocab_size)",
                                        dtype=dtype, device=device)

    # KDA and MLA heads (with K3's output gates), dense and shared MLPs, vocabulary over tp; routed experts (K3's
    # MXFP4 too) over ep; router, attention residual mixers and the latent MoE's projections and norm whole
    tensor_parallel = True
    expert_parallel = True

    def weight_targets(self, prefix: str = "") -> dict[str, WeightTarget]:
        return collect_weight_targets(self, prefix + self.checkpoint_prefix)

    def layouts(self) -> tuple[Layout, ...]:
        return K3_LAYOUTS if self.checkpoint_prefix else LAYOUTS

    def ignore_patterns(self) -> tuple[str, ...]:
        experts = () if self.spec.experts is None else other_ranks_experts(self.spec.experts.num, self.parallel,
                                                                             r"\.block_sparse_moe\.experts\.")
        if not self.checkpoint_prefix:
            return experts
        return (r"^vision_tower\.", r"^mm_projector\.", r"^language_model\.model\.mtp", *experts)

    def post_load(self) -> None:
        for layer in self.model.layers:
            if isinstance(layer.self_attn, MLAttention):
                layer.self_attn.post_load()

    def cuda_graph_blocker(self, max_model_len: int) -> str | None:
        """A decode step's KDA is one [B, 1] block of static-shape ops; MLA as DeepSeek-V3's."""
        return None

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """NoPE model: positions are not used (KDA's recurrence carries order)."""
        x = self.model.embed_tokens(input_ids)
        if self.attn_res_block is None:
            x = pre_norm_residuals(x, [b for layer, c in zip(self.model.layers, cache.layers) for b in layer.blocks(c)])
        else:  # Block Attention Residuals: token-local, nothing of it is cached (k3_parts.AttentionResidualState)
            state = AttentionResidualState(x, self.attn_res_block)
            for i, (layer, layer_cache) in enumerate(zip(self.model.layers, cache.layers)):
                state.add(layer.attend(state.attention_input(layer.self_attention_res, i), layer_cache))
                state.add(layer.feed_forward(state.mlp_input(layer.mlp_res)))
            x = state.output(self.model.output_attn_res)
        if cache.logits_indices is not None:
            x = x[cache.logits_indices]
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        return comm.all_gather(ops.linear(x, head), dim=-1).float()  # a tensor-parallel rank's vocabulary
