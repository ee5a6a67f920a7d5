"""gpt-oss (OpenAI, 2025): GQA with attention sinks, alternating sliding-window / full layers, and a
softmax-routed MoE of clamped-SwiGLU experts with biases, shipped in MXFP4.

One decoder layer:
    h = h + o_proj(paged_gqa_attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n), window, sinks)),  n = norm(h)
    h = h + sum_k w_k expert_k(n),  n = norm(h);  (ids, w) = top-k of router(n), softmax over those k
    expert(x) = down(swiglu_clamped(gate(x), up(x)))
`layer_types[i]` is "sliding_attention" (window `sliding_window`) or "full_attention". Every
projection has a bias; the router is a biased linear layer.

Checkpoint (Hugging Face names, as shipped by openai/gpt-oss-*), per layer `model.layers.{i}.`:
    self_attn.{q,k,v,o}_proj.{weight,bias}, self_attn.sinks [heads]            bf16
    mlp.router.{weight,bias}                                                     bf16
    mlp.experts.gate_up_proj_blocks uint8 [E, 2I, H/32, 16], _scales uint8 [E, 2I, H/32], _bias [E, 2I]
    mlp.experts.down_proj_blocks    uint8 [E, H, I/32, 16],  _scales uint8 [E, H, I/32],  _bias [E, H]
The gate_up rows alternate gate, up (row 2j is gate j, row 2j+1 is up j); loading moves them into
the canonical w13 layout (all gate rows, then all up rows). Blocks run along K, so permuting rows
of blocks and scales is exact. An unquantized checkpoint (transformers' own save) instead holds
gate_up_proj [E, H, 2I] and down_proj [E, I, H] (x @ W), transposed on load.
"""

from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.formats.mxfp4 import BLOCK_SIZE
from dayzero.models import register_model
from dayzero.models.base import CausalLM, WeightTarget, collect_weight_targets, empty_param
from dayzero.models.layers import Linear, RMSNorm, pre_norm_residuals
from dayzero.models.sharded import ColumnLinear, ExpertShard, RowLinear, VocabEmbedding, shard_target
from dayzero.parallel import comm
from dayzero.parallel.state import current
from dayzero.models.rotary import rope_from_config
from dayzero.ops.moe import Activation, ExpertWeights
from dayzero.ops.routing_softmax import route_softmax_topk
from dayzero.spec import GPT_OSS_ROPE_THETA, ModelSpec, UnsupportedModelError
from dayzero.weights.values import SCALES



def _gate_up_to_w13(t: torch.Tensor) -> torch.Tensor:
    """Rows along dim 1 interleaved (gate 0, up 0, gate 1, ...) -> all gate rows, then all up rows."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


class GptOssRMSNorm(RMSNorm):
    """gpt-oss scales by the weight in float32 and casts after (Llama casts before the scale)."""

    weight_in_float32 = True


class GptOssExperts(nn.Module):
    """Routed experts held in the canonical layout of dayzero.ops.moe (w13 gate rows first)."""

    fp8_workspace = None  # the engine's FP8 expert workspace, passed with the weights (dayzero/engine/llm.py)

    def __init__(self, num: int, hidden: int, inter: int, fmt: str, activation: Activation, dtype, device):
        """num: the model's experts; an expert-parallel rank holds its share (ExpertShard)."""
        super().__init__()
        self.shard = ExpertShard(num)
        self.full_num, num = num, self.shard.num_local
        self.num, self.hidden, self.inter, self.fmt, self.activation = num, hidden, inter, fmt, activation
        if fmt == "mxfp4":
            self.w13 = empty_param((num, 2 * inter, hidden // BLOCK_SIZE, BLOCK_SIZE // 2), torch.uint8, device)
            self.w13_scale = empty_param((num, 2 * inter, hidden // BLOCK_SIZE), torch.uint8, device)
            self.w2 = empty_param((num, hidden, inter // BLOCK_SIZE, BLOCK_SIZE // 2), torch.uint8, device)
            self.w2_scale = empty_param((num, hidden, inter // BLOCK_SIZE), torch.uint8, device)
        else:
            self.w13 = empty_param((num, 2 * inter, hidden), dtype, device)
            self.w2 = empty_param((num, hidden, inter), dtype, device)
            self.w13_scale = self.w2_scale = None
        self.b13 = empty_param((num, 2 * inter), dtype, device)
        self.b2 = empty_param((num, hidden), dtype, device)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        def target(param: torch.Tensor, shape: tuple[int, ...], convert=lambda t: t, check=None) -> WeightTarget:
            return self.shard.target(param, (self.full_num, *shape[1:]), convert, check)

        e, h, i = self.num, self.hidden, self.inter
        targets = {
            prefix + "gate_up_proj_bias": target(self.b13, (e, 2 * i), _gate_up_to_w13),
            prefix + "down_proj_bias": target(self.b2, (e, h)),
        }
        if self.fmt == "mxfp4":
            targets[prefix + "gate_up_proj_blocks"] = target(self.w13, tuple(self.w13.shape), _gate_up_to_w13)
            targets[prefix + "gate_up_proj_scales"] = target(self.w13_scale, tuple(self.w13_scale.shape), _gate_up_to_w13,
                                                             SCALES)
            targets[prefix + "down_proj_blocks"] = target(self.w2, tuple(self.w2.shape))
            targets[prefix + "down_proj_scales"] = target(self.w2_scale, tuple(self.w2_scale.shape), check=SCALES)
        else:  # transformers' in-memory layout: x @ W, W [E, in, out]
            targets[prefix + "gate_up_proj"] = target(self.w13, (e, h, 2 * i), lambda t: _gate_up_to_w13(t.transpose(1, 2)))
            targets[prefix + "down_proj"] = target(self.w2, (e, i, h), lambda t: t.transpose(1, 2))
        return targets

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        experts = ExpertWeights(self.fmt, self.w13, self.w2, self.w13_scale, self.w2_scale, self.b13, self.b2,
                                self.fp8_workspace)
        op = ops.moe_experts_mxfp4 if self.fmt == "mxfp4" else ops.moe_experts_bf16
        return self.shard.run(op, x, ids, weights, experts, self.activation)


class GptOssMLP(nn.Module):
    def __init__(self, hidden: int, num: int, top_k: int, inter: int, fmt: str, activation: Activation, dtype, device):
        super().__init__()
        self.top_k = top_k
        self.router = Linear(hidden, num, bias=True, dtype=dtype, device=device)
        self.experts = GptOssExperts(num, hidden, inter, fmt, activation, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = route_softmax_topk(self.router(flat), self.top_k)
        return self.experts(flat, ids, weights).reshape(x.shape)


class GptOssAttention(nn.Module):
    """Cache streams per layer: "k", "v", entries [kv_heads, head_dim] (rotated keys, values); a
    sliding layer's streams are windowed (only the window - 1 keys the next token can see are kept)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, window: int | None, dtype, device):
        """heads, kv_heads: the model's; a tensor-parallel rank holds its share of both (q, k, v split by
        output rows, o_proj by input columns, the sinks by head)."""
        super().__init__()
        p = current()
        self.head_range = p.split(heads, "num_attention_heads")
        self.heads, self.kv_heads = heads // p.tp_size, kv_heads // p.tp_size
        self.full_heads, self.head_dim, self.window = heads, head_dim, window
        kw = dict(bias=bias, dtype=dtype, device=device)
        self.q_proj = ColumnLinear(hidden, heads * head_dim, name="q_proj", **kw)
        self.k_proj = ColumnLinear(hidden, kv_heads * head_dim, name="k_proj (num_key_value_heads)", **kw)
        self.v_proj = ColumnLinear(hidden, kv_heads * head_dim, name="v_proj (num_key_value_heads)", **kw)
        self.o_proj = RowLinear(heads * head_dim, hidden, name="o_proj", **kw)
        self.sinks = empty_param((self.heads,), torch.float32, device)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = collect_weight_targets(self, prefix)
        targets[prefix + "sinks"] = shard_target(self.sinks, (self.full_heads,), 0, *self.head_range)
        return targets

    def post_load(self) -> None:
        """q, k and v as one projection: one [(H + 2 Hkv) D, hidden] matrix whose row blocks the three
        Linears' weights then view (no second copy)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = torch.cat([p.weight for p in projections])
        self.qkv_bias = None if self.q_proj.bias is None else torch.cat([p.bias for p in projections])
        rows = 0
        for p in projections:
            n = p.weight.shape[0]
            p.weight.data = self.qkv_weight[rows:rows + n]
            if self.qkv_bias is not None:
                p.bias.data = self.qkv_bias[rows:rows + n]
            rows += n

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """x [N, hidden] (the step's packed tokens) -> [N, hidden]."""
        n = x.shape[0]
        qkv = ops.linear(x, self.qkv_weight, self.qkv_bias)
        heads = qkv.view(n, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = heads[:, :self.heads], heads[:, self.heads:self.heads + self.kv_heads], heads[:, self.heads + self.kv_heads:]
        q, keys, values = cache.rope_append(q, k, v, cos, sin, False, self.window)  # one launch on CUDA
        out = ops.paged_gqa_attention(q, keys, values, cache.seqs, self.head_dim ** -0.5, self.window, self.sinks)
        return self.o_proj(out.reshape(n, -1))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, attention: GptOssAttention, mlp: GptOssMLP, hidden: int, eps: float, dtype, device):
        super().__init__()
        self.input_layernorm = GptOssRMSNorm(hidden, eps, dtype, device)
        self.self_attn = attention
        self.post_attention_layernorm = GptOssRMSNorm(hidden, eps, dtype, device)
        self.mlp = mlp

    def blocks(self, cos: torch.Tensor, sin: torch.Tensor, cache) -> list:
        """The layer's two pre-norm blocks (models.layers.pre_norm_residuals)."""
        return [(self.input_layernorm, lambda x: self.self_attn(x, cos, sin, cache)),
                (self.post_attention_layernorm, self.mlp)]


class GptOssModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: list[GptOssDecoderLayer], eps: float, dtype, device):
        super().__init__()
        self.embed_tokens = VocabEmbedding(vocab, hidden, dtype, device)
        self.layers = nn.ModuleList(layers)
        self.norm = GptOssRMSNorm(hidden, eps, dtype, device)


@register_model
class GptOssForCausalLM(CausalLM):
    model_types = ("gpt_oss",)
    tensor_parallel = True  # attention heads, embedding and lm_head split over tp
    expert_parallel = True  # the routed experts over ep

    def __init__(self, spec: ModelSpec, config: dict, dtype: torch.dtype, device: torch.device | str):
        super().__init__(spec, config, dtype, device)
        config = self.config
        experts = spec.experts
        attn = spec.layers[0].attention
        self.rope = self._rope(config, attn.head_dim, spec.source or "config.json")

        activation = spec.layers[0].mlp.activation
        act = Activation("swiglu_clamped", limit=activation.limit, alpha=activation.alpha)
        eps = float(config["rms_norm_eps"])
        hidden = spec.hidden_size
        layers = []
        for layer in spec.layers:
            a = layer.attention
            window = a.sliding_window if a.kind == "swa" else None
            attention = GptOssAttention(hidden, a.num_heads, a.num_kv_heads, a.head_dim, a.bias, window, dtype, device)
            mlp = GptOssMLP(hidden, experts.num, experts.top_k, experts.intermediate_size, experts.format, act, dtype, device)
            layers.append(GptOssDecoderLayer(attention, mlp, hidden, eps, dtype, device))
        self.model = GptOssModel(spec.vocab_size, hidden, layers, eps, dtype, device)
        self.lm_head = None if spec.tie_word_embeddings else ColumnLinear(hidden, spec.vocab_size, gather=True,
                                                                          name="lm_head (vocab_size)", dtype=dtype,
                                                                          device=device)

    @staticmethod
    def _rope(config: dict, head_dim: int, where: str):
        params = dict(config["rope_parameters"])  # transformers' GptOssConfig yarn when a config names none
        theta = float(params.get("rope_theta", config.get("rope_theta", GPT_OSS_ROPE_THETA)))
        try:
            return rope_from_config(params, head_dim, theta, config.get("max_position_embeddings"))
        except ValueError:
            kind = params.get("rope_type", params.get("type"))
            raise UnsupportedModelError("rope_parameters.rope_type", kind, ("default", "yarn"), where) from None

    def ignore_patterns(self) -> tuple[str, ...]:
        return (r"^lm_head\.weight$",) if self.lm_head is None else ()

    def cuda_graph_blocker(self, max_model_len: int) -> str | None:
        return None  # paged GQA kernels and the MoE layer: launches fixed by the batch size

    def post_load(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.post_load()

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        cos, sin = self.rope.cos_sin(positions)
        h = self.model.embed_tokens(input_ids)
        h = pre_norm_residuals(h, [b for layer, c in zip(self.model.layers, cache.layers) for b in layer.blocks(cos, sin, c)])
        if cache.logits_indices is not None:
            h = h[cache.logits_indices]
        h = self.model.norm(h)
        if self.lm_head is not None:
            return self.lm_head(h).float()
        return comm.all_gather(ops.linear(h, self.model.embed_tokens.weight), dim=-1).float()  # a rank's vocabulary
