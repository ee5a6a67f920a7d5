"""DeepSeek-V3 / Kimi-K2 (`deepseek_v3`, `kimi_k2`) and DeepSeek-V3.2 (`deepseek_v32`: V3 + DSA).

Decoder layer i:  h = x + o_proj(MLA(input_layernorm(x)));  out = h + MLP(post_attention_layernorm(h))
    MLA: q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x) when q_lora_rank is null), per head
         [nope | rope]; kv_a_proj_with_mqa(x) = [latent C | shared rope key]; the latent is
         normalised and cached with the rotated key; attention runs in the absorbed form
         (ops/attention_mla.py) with w_uk / w_uv split from kv_b_proj at load.
    RoPE on the rope dims only, interleaved pairs (transformers rotates even/odd pairs and writes
         them de-interleaved, a permutation applied to q and k alike: dot products are the same).
         YaRN: cos/sin carry mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the softmax
         scale is qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2.
    DSA (V3.2): a lightning indexer picks each query's index_topk keys (ops/dsa.py); while the
         cache holds no more than index_topk keys every key is picked, so dense MLA runs instead.
    MLP: dense SwiGLU in the first first_k_dense_replace layers (V3.2: `mlp_layer_types`), else
         shared experts + routed experts picked by group-limited sigmoid routing (noaux_tc).
Weights as the real checkpoints ship them: every Linear of the layers FP8 E4M3 with 128x128
`weight_scale_inv` (float32) when quantization_config says fp8, routed experts per expert
(`mlp.experts.{j}.{gate,up,down}_proj`), stacked at load into ops/moe.py's canonical layout;
embeddings, norms, lm_head, the router and the indexer's weights_proj stay bf16/float32.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dayzero import ops
from dayzero.formats.fp8 import dequantize_weight_blocks
from dayzero.models import register_model
from dayzero.models.base import CausalLM, WeightTarget, copy_target, empty_param
from dayzero.weights.values import SCALES
from dayzero.models.layers import BiasedRouter, Linear, RMSNorm, lm_logits, pre_norm_residuals
from dayzero.models.sharded import ColumnLinear, ExpertShard, RowLinear, VocabEmbedding, other_ranks_experts
from dayzero.parallel.state import current
from dayzero.models.rotary import rope_from_config, yarn_mscale
from dayzero.ops.moe import Activation, ExpertWeights
from dayzero.spec import DEEPSEEK_ROPE_THETA, AttentionSpec, ModelSpec
from dayzero.weights import Chunk, Layout, Rename, Unstack

FP8_BLOCK = (128, 128)
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps
INDEXER_NORM_EPS = 1e-6

# Tensor layouts (dayzero.weights.layouts). transformers' save_pretrained writes the release names;
# its in-memory names (save_original_format=False) stack each layer's routed experts: gate_up_proj
# [E, 2I, H] (gate rows first), down_proj [E, H, I], FP8 scales `{..}_scale_inv` the same way.
LAYOUTS = (
    Layout("release", "model.layers.N.mlp.experts.J.gate_proj.weight; also what transformers' save_pretrained writes"),
    Layout("transformers in-memory", "model.layers.N.mlp.experts.gate_up_proj", (
        Unstack(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv)?$", r".mlp.experts.{i}.\1\2"),
        Chunk(r"\.experts\.(\d+)\.gate_up_proj(_scale_inv)?$",
              (r".experts.\1.gate_proj.weight\2", r".experts.\1.up_proj.weight\2")),
        Rename(r"\.experts\.(\d+)\.down_proj(_scale_inv)?$", r".experts.\1.down_proj.weight\2"),
    )),
)


class LinearFormats:
    """Which Linear modules are FP8 (checkpoint names, quantization_config.modules_to_not_convert)."""

    def __init__(self, spec: ModelSpec, config: dict):
        self.dense = spec.quant.dense_format
        qc = config.get("quantization_config") or {}
        self.skip = tuple(qc.get("modules_to_not_convert") or ())

    def of(self, name: str) -> str:
        return "bf16" if any(s and s in name for s in self.skip) else self.dense


def _linear(fmts: LinearFormats, name: str, n_in: int, n_out: int, dtype, device, bias: bool = False,
            split: str | None = None) -> Linear:
    """split: "column" (output features over the tensor-parallel ranks), "row" (input features), or None
    (every rank holds it whole)."""
    kw = dict(bias=bias, fmt=fmts.of(name), dtype=dtype, device=device, block=FP8_BLOCK)
    if split == "column":
        return ColumnLinear(n_in, n_out, name=name, **kw)
    if split == "row":
        return RowLinear(n_in, n_out, name=name, **kw)
    return Linear(n_in, n_out, **kw)


def _dequantized(linear: Linear, dtype: torch.dtype) -> torch.Tensor:
    if linear.fmt == "fp8":
        return dequantize_weight_blocks(linear.weight, getattr(linear, linear.scale_name), linear.block, dtype=dtype)
    return linear.weight.to(dtype)



class Indexer(nn.Module):
    """DSA lightning indexer: checkpoint names `self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`."""

    def __init__(self, a: AttentionSpec, hidden: int, fmts: LinearFormats, prefix: str, dtype, device):
        super().__init__()
        q_rank = a.q_lora_rank
        self.heads, self.head_dim, self.rope_dim, self.topk = a.index_n_heads, a.index_head_dim, a.qk_rope_head_dim, a.index_topk
        self.wq_b = _linear(fmts, prefix + "wq_b", q_rank, self.heads * self.head_dim, dtype, device)
        self.wk = _linear(fmts, prefix + "wk", hidden, self.head_dim, dtype, device)
        self.k_norm = nn.Module()
        self.k_norm.weight = empty_param((self.head_dim,), dtype, device)
        self.k_norm.bias = empty_param((self.head_dim,), dtype, device)
        # weights_proj ships bf16 and runs in float32 (transformers keeps it in fp32, as DeepSeek's fix does)
        self.weights_proj = Linear(hidden, self.heads, dtype=torch.float32, device=device)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Half-split RoPE on the first rope_dim dims of x [N, ..., head_dim]."""
        rot = ops.rope(x[..., : self.rope_dim], cos, sin, interleaved=False)
        return torch.cat([rot, x[..., self.rope_dim:]], dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> rotated index keys [N, head_dim]."""
        k = ops.layer_norm(self.wk(x), self.k_norm.weight, self.k_norm.bias, INDEXER_NORM_EPS)
        return self._rotate(k, cos, sin)

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, keys, cos, sin, seqs) -> torch.Tensor:
        """Top-k key positions int32 [N, topk] (-1 padded) of each query among its sequence's keys."""
        q = self._rotate(self.wq_b(q_latent).view(x.shape[0], self.heads, self.head_dim), cos, sin)
        weights = self.weights_proj(x.float()) * self.heads**-0.5
        return ops.paged_index_topk(q, weights, keys, self.head_dim**-0.5, self.topk, seqs)


class MLAttention(nn.Module):
    def __init__(self, a: AttentionSpec, hidden: int, config: dict, fmts: LinearFormats, prefix: str, dtype, device):
        super().__init__()
        dsa = a.kind == "dsa"
        heads = a.num_heads  # the model's; a tensor-parallel rank holds heads / tp of them (q, kv_b, o split)
        self.heads, self.nope, self.rope_dim = heads // current().tp_size, a.qk_nope_head_dim, a.qk_rope_head_dim
        self.v_dim, self.rank, self.q_rank, bias = a.v_head_dim, a.kv_lora_rank, a.q_lora_rank, a.bias
        qk_dim = self.nope + self.rope_dim
        if self.q_rank is None:
            self.q_proj = _linear(fmts, prefix + "q_proj", hidden, heads * qk_dim, dtype, device, split="column")
        else:
            self.q_a_proj = _linear(fmts, prefix + "q_a_proj", hidden, self.q_rank, dtype, device, bias)
            self.q_a_layernorm = RMSNorm(self.q_rank, LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = _linear(fmts, prefix + "q_b_proj", self.q_rank, heads * qk_dim, dtype, device,
                                    split="column")
        self.kv_a_proj_with_mqa = _linear(fmts, prefix + "kv_a_proj_with_mqa", hidden, self.rank + self.rope_dim,
                                          dtype, device, bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype, device)
        self.kv_b_proj = _linear(fmts, prefix + "kv_b_proj", self.rank, heads * (self.nope + self.v_dim), dtype, device,
                                 split="column")
        self.o_proj = _linear(fmts, prefix + "o_proj", heads * self.v_dim, hidden, dtype, device, bias, split="row")
        self.indexer = Indexer(a, hidden, fmts, prefix + "indexer.", dtype, device) if dsa else None
        self.interleaved = bool(config["rope_interleave"]) or dsa
        self.scale = qk_dim**-0.5 * _softmax_mscale(config) ** 2

    def post_load(self) -> None:
        """Split kv_b_proj per head into the absorbed form's w_uk [H, Dn, C] and w_uv [H, Dv, C]."""
        dtype = self.kv_a_layernorm.weight.dtype
        w = _dequantized(self.kv_b_proj, dtype).view(self.heads, self.nope + self.v_dim, self.rank)
        self.register_buffer("w_uk", w[:, : self.nope].contiguous(), persistent=False)
        self.register_buffer("w_uv", w[:, self.nope:].contiguous(), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """x [N, hidden] (the step's packed tokens) -> [N, hidden]. Cache streams: "kv_latent" [C],
        "k_pe" [Dr] and, with DSA, "index_k" [index_head_dim]."""
        n = x.shape[0]
        if self.q_rank is None:
            q_latent, q = None, self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        q = q.view(n, self.heads, self.nope + self.rope_dim)
        q_nope = q[..., : self.nope]
        q_pe = ops.rope(q[..., self.nope:], cos, sin, interleaved=self.interleaved)
        kv = self.kv_a_proj_with_mqa(x)
        latent = cache.append("kv_latent", self.kv_a_layernorm(kv[..., : self.rank]))
        k_pe = cache.append("k_pe", ops.rope(kv[..., self.rank:], cos, sin, interleaved=self.interleaved))
        seqs = cache.seqs
        if self.indexer is not None:
            index_keys = cache.append("index_k", self.indexer.keys(x, cos, sin))
            if seqs.max_seq_len > self.indexer.topk:  # sparse; below, every key is selected: dense MLA is the same
                selected = self.indexer.select(x, q_latent, index_keys, cos, sin, seqs)
                out = ops.paged_sparse_mla_attention(q_nope, q_pe, latent, k_pe, self.w_uk, self.w_uv, self.scale, seqs,
                                                     selected)
                return self.o_proj(out.reshape(n, -1))
        out = ops.paged_mla_attention(q_nope, q_pe, latent, k_pe, self.w_uk, self.w_uv, self.scale, seqs)
        return self.o_proj(out.reshape(n, -1))


def _softmax_mscale(config: dict) -> float:
    """YaRN's extra softmax factor (per side of q.k): mscale(factor, mscale_all_dim), 1 without YaRN."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind == "default" or not rope.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)); the dense MLP and the shared experts."""

    def __init__(self, fmts: LinearFormats, prefix: str, hidden: int, inter: int, dtype, device):
        """The intermediate features split over the tensor-parallel ranks (gate, up by rows, down by columns)."""
        super().__init__()
        self.gate_proj = _linear(fmts, prefix + "gate_proj", hidden, inter, dtype, device, split="column")
        self.up_proj = _linear(fmts, prefix + "up_proj", hidden, inter, dtype, device, split="column")
        self.down_proj = _linear(fmts, prefix + "down_proj", inter, hidden, dtype, device, split="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


class Experts(nn.Module):
    """Routed experts stacked in ops/moe.py's canonical layout, filled from the per-expert tensors
    `{j}.gate_proj.weight` -> w13[j, :I], `{j}.up_proj.weight` -> w13[j, I:], `{j}.down_proj.weight`
    -> w2[j] (and their `weight_scale_inv` into the same rows of w13_scale / w2_scale)."""

    def __init__(self, fmt: str, num: int, hidden: int, inter: int, dtype, device):
        """num: the model's experts; an expert-parallel rank holds [start, stop) of them (ExpertShard), local
        index j - start, and reads only theirs."""
        super().__init__()
        self.shard = ExpertShard(num)
        num = self.shard.num_local
        self.fmt, self.num, self.inter = fmt, num, inter
        wdtype = torch.float8_e4m3fn if fmt == "fp8" else dtype
        self.w13 = empty_param((num, 2 * inter, hidden), wdtype, device)
        self.w2 = empty_param((num, hidden, inter), wdtype, device)
        if fmt == "fp8":
            bn, bk = FP8_BLOCK
            self.w13_scale = empty_param((num, 2 * inter // bn, math.ceil(hidden / bk)), torch.float32, device)
            self.w2_scale = empty_param((num, math.ceil(hidden / bn), inter // bk), torch.float32, device)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = {}
        i, si = self.inter, self.inter // FP8_BLOCK[0]
        for j in range(self.num):
            views = {"gate_proj": (self.w13[j, :i], "w13_scale", slice(0, si)),
                     "up_proj": (self.w13[j, i:], "w13_scale", slice(si, 2 * si)),
                     "down_proj": (self.w2[j], "w2_scale", slice(None))}
            for proj, (weight, scale_name, rows) in views.items():
                name = f"{prefix}{self.shard.start + j}.{proj}.weight"
                targets[name] = copy_target(weight, name)
                if self.fmt == "fp8":
                    targets[name + "_scale_inv"] = copy_target(getattr(self, scale_name)[j, rows], name + "_scale_inv",
                                                               check=SCALES)
        return targets

    def weights(self) -> ExpertWeights:
        if self.fmt == "fp8":
            return ExpertWeights("fp8", self.w13, self.w2, self.w13_scale, self.w2_scale)
        return ExpertWeights("bf16", self.w13, self.w2)


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec, fmts: LinearFormats, prefix: str, dtype, device):
        super().__init__()
        e = spec.experts
        self.routing = e.routing
        self.gate = BiasedRouter(e.num, spec.hidden_size, device)
        self.experts = Experts(e.format, e.num, spec.hidden_size, e.intermediate_size, dtype, device)
        self.shared_experts = (MLP(fmts, prefix + "shared_experts.", spec.hidden_size, e.shared_intermediate_size, dtype, device)
                               if e.num_shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        r = self.routing
        logits = ops.linear(x.float(), self.gate.weight)
        ids, weights = ops.route_sigmoid_grouped(logits, self.gate.e_score_correction_bias, r.top_k, r.n_group,
                                                 r.topk_group, r.normalize, r.scaling_factor)
        expert_op = ops.moe_experts_fp8 if self.experts.fmt == "fp8" else ops.moe_experts_bf16
        y = self.experts.shard.run(expert_op, x, ids, weights, self.experts.weights(), Activation("swiglu"))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)


class DecoderLayer(nn.Module):
    """attention_class: MLAttention, or another attention built with the same arguments (GLM-4.x's GQA)."""

    attention_class = MLAttention

    def __init__(self, spec: ModelSpec, config: dict, fmts: LinearFormats, index: int, dtype, device):
        super().__init__()
        prefix = f"model.layers.{index}."
        eps = float(config["rms_norm_eps"])
        layer = spec.layers[index]
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, dtype, device)
        self.self_attn = self.attention_class(layer.attention, spec.hidden_size, config, fmts, prefix + "self_attn.",
                                              dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, dtype, device)
        if layer.mlp.kind == "moe":
            self.mlp = MoE(spec, fmts, prefix + "mlp.", dtype, device)
        else:
            self.mlp = MLP(fmts, prefix + "mlp.", spec.hidden_size, layer.mlp.intermediate_size, dtype, device)

    def blocks(self, cos, sin, layer_cache) -> list:
        """The layer's two pre-norm blocks (models.layers.pre_norm_residuals)."""
        return [(self.input_layernorm, lambda x: self.self_attn(x, cos, sin, layer_cache)),
                (self.post_attention_layernorm, self.mlp)]


@register_model
class DeepseekV3ForCausalLM(CausalLM):
    """Also the base of a family that is DeepSeek-V3's model with another attention (GLM-4.x): it sets
    `decoder_layer` (built as DecoderLayer is) and `make_rope`."""

    model_types = ("deepseek_v3", "kimi_k2")
    tensor_parallel = True  # MLA heads (q, kv_b, o), dense and shared MLPs, vocabulary; latent cache and indexer whole
    expert_parallel = True
    decoder_layer = DecoderLayer

    def __init__(self, spec: ModelSpec, config: dict, dtype: torch.dtype, device: torch.device | str):
        super().__init__(spec, config, dtype, device)
        config = self.config
        fmts = LinearFormats(spec, config)
        self.rope = self.make_rope(spec, config)
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.model.layers = nn.ModuleList(
            self.decoder_layer(spec, config, fmts, i, dtype, device) for i in range(spec.num_layers)
        )
        self.model.norm = RMSNorm(spec.hidden_size, float(config["rms_norm_eps"]), dtype, device)
        if not spec.tie_word_embeddings:
            self.lm_head = ColumnLinear(spec.hidden_size, spec.vocab_size, gather=True, name="lm_head (vocab_size)",
                                        dtype=dtype, device=device)

    @staticmethod
    def make_rope(spec: ModelSpec, config: dict):
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        theta = float(config.get("rope_theta") or (rope or {}).get("rope_theta") or DEEPSEEK_ROPE_THETA)
        return rope_from_config(rope, spec.layers[0].attention.qk_rope_head_dim, theta, config["max_position_embeddings"])

    def layouts(self) -> tuple[Layout, ...]:
        return LAYOUTS

    def ignore_patterns(self) -> tuple[str, ...]:
        """The multi-token-prediction layers ship as model.layers.{n}, {n+1}, ... (n = num_hidden_layers).
        With n_shared_experts 0 transformers builds (and saves) zero-width shared experts, which add nothing."""
        n = self.spec.num_layers
        patterns = tuple(rf"^model\.layers\.{n + k}\." for k in range(self.spec.mtp_layers))
        e = self.spec.experts
        if e is not None and not e.num_shared:
            patterns += (r"\.mlp\.shared_experts\.",)
        if e is not None:  # the other expert-parallel ranks' experts
            patterns += other_ranks_experts(e.num, self.parallel, r"\.mlp\.experts\.")
        return patterns

    def post_load(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.post_load()

    def cuda_graph_blocker(self, max_model_len: int) -> str | None:
        """None: dense MLA, the MoE layer and DSA's kernels capture. A graph is captured with max_model_len
        host lengths, so past index_topk its replays always take DSA's sparse path, which over a shorter
        history selects every key (dense MLA's result); the indexer kernel reads the real lengths from the
        device and scores only visible keys. Where an op runs its reference instead (host-length loops:
        engine.graphs.HOST_LENGTH_OPS), the capture is abandoned and decode runs eagerly."""
        return None

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        return self.forward_embeds(self.model.embed_tokens(input_ids), positions, cache)

    def forward_embeds(self, x: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """The packed forward from the input embeddings x [N, hidden] (a vision-language wrapper's
        tokens with image features in place: dayzero/models/kimi_k25.py)."""
        cos, sin = self.rope.cos_sin(positions)
        x = pre_norm_residuals(x, [b for layer, c in zip(self.model.layers, cache.layers) for b in layer.blocks(cos, sin, c)])
        head = self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        return lm_logits(x, cache, self.model.norm, head)


@register_model
class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: every layer's attention is DSA (spec attention kind "dsa"); the rest is V3."""

    model_types = ("deepseek_v32",)
